"""``dsv4-numerics stage-sglang`` on CPU: a small fake SGLang wheel (the required files plus a
few that must / must not be copied), additivity next to a vLLM part in one MANIFEST.json, the
stand-ins, the probe reasons, one-line errors; and one test on the real wheel when
/tmp/wheels holds it (import closure of the staged Triton modules resolved inside the folder)."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

from dsv4_numerics.staging import vllm as staging

from dsv4_numerics.staging import sglang as sg
from dsv4_numerics.cli import main as cli_main
from dsv4_numerics.kernels import probe as P
from dsv4_numerics.kernels import staged

REAL_WHEEL = Path("/tmp/wheels/sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl")
EXTRA = {
    sg.DSV4 + "asm/gfx950/mla_v4/kernel.co": False,          # HIP code object: left out
    sg.DSV4 + "unified_kv_kernels/paged_decode.py": True,
    "sglang/kernels/ops/kvcache/dsv4_unified_kv_store.py": True,
    "sglang/kernels/ops/kvcache/hicache.py": False,           # not a dsv4 store
    sg.JIT + "csrc/deepseek_v4/store.cuh": True,
    sg.JIT + "include/sgl_kernel/utils.cuh": True,
    sg.JIT + "benchmark/notes.md": False,                      # neither *.py nor csrc/include
    "sglang/__init__.py": False,                               # replaced by a stand-in
    "sglang/srt/server_args.py": False,
}


def _content(rel: str) -> bytes:
    return f'"""copy of {rel}"""\nORIGIN = "wheel"\n'.encode()


def _fake_wheel(folder: Path, name: str = "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
                drop: str | None = None) -> Path:
    w = folder / name
    with zipfile.ZipFile(w, "w") as zf:
        for rel in dict.fromkeys((*sg.REQUIRED, *sg.EXTRA_COPIES, *EXTRA)):
            if rel != drop:
                zf.writestr(rel, _content(rel))
    return w


def test_copies_standins_and_manifest(tmp_path):
    dest = tmp_path / "st"
    m = sg.stage(dest, _fake_wheel(tmp_path), log=lambda s: None)
    assert m["sglang_version"] == sg.VERSION and m["part_versions"]["sglang"] == "sglang 0.5.23"
    assert m["parts"] == ["sglang"]
    for rel in (*sg.REQUIRED, *sg.EXTRA_COPIES):
        rec = m["files"][rel]
        assert rec["kind"] == "copy" and (dest / rel).read_bytes() == _content(rel)
        assert rec["sha256"] == hashlib.sha256(_content(rel)).hexdigest()
    for rel, copied in EXTRA.items():
        kind = m["files"].get(rel, {}).get("kind")
        assert (kind == "copy") == copied, rel
    for rel in sg.STANDINS:
        assert m["files"][rel]["kind"] == "stand-in" and m["files"][rel]["reason"], rel
    on_disk = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()} - {staged.MANIFEST}
    assert on_disk == set(m["files"])


def test_additive_next_to_a_vllm_part(tmp_path):
    vw = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(vw, "w") as zf:
        for rel in staging.COPIES["flashmla"]:
            zf.writestr(rel, b"x")
    dest = tmp_path / "st"
    staging.stage(dest, ["flashmla"], vw, log=lambda s: None)
    sg.stage(dest, _fake_wheel(tmp_path), log=lambda s: None)
    staging.stage(dest, ["flashmla"], vw, log=lambda s: None)  # vLLM again after SGLang: parts keep both
    m = json.loads((dest / staged.MANIFEST).read_text())
    assert m["parts"] == ["flashmla", "sglang"]
    assert m["vllm_version"] == "0.33.0" and m["sglang_version"] == "0.5.23"
    assert set(m["part_versions"]) == {"flashmla", "sglang"}
    assert "vllm/third_party/flashmla/flash_mla_interface.py" in m["files"]


def test_another_release_stages_what_it_has_and_records_the_missing_files(tmp_path):
    w = _fake_wheel(tmp_path, name="sglang-0.5.19-cp311-cp311-manylinux_2_34_x86_64.whl",
                    drop=sg.DSV4 + "dequant_k_cache.py")
    m = sg.stage(tmp_path / "st", w, log=lambda s: None)
    assert m["sglang_version"] == "0.5.19"
    assert m["missing"] == {sg.DSV4 + "dequant_k_cache.py": "sglang 0.5.19 does not ship " + sg.DSV4 + "dequant_k_cache.py"}
    assert sg.DSV4 + "kv_layout.py" in m["files"]
    with pytest.raises(staging.StagingError, match="holds SGLang 0.5.19 kernels; stage 0.5.23 elsewhere"):
        sg.stage(tmp_path / "st", _fake_wheel(tmp_path), log=lambda s: None)  # one release per folder


@pytest.mark.parametrize("case,msg", [
    ("other", "not an SGLang wheel"),
    ("nofile", "no such file"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, case, msg):
    if case == "other":
        w = _fake_wheel(tmp_path, name="vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl")
    else:
        w = tmp_path / "sglang-0.5.23-none.whl"
    assert cli_main(["stage-sglang", "--wheel", str(w), str(tmp_path / "st")]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "\n" not in err and "Traceback" not in err


def test_refuses_foreign_folder(tmp_path):
    dest = tmp_path / "st"
    dest.mkdir()
    (dest / "something").write_text("x")
    with pytest.raises(staging.StagingError, match="holds no MANIFEST.json"):
        sg.stage(dest, _fake_wheel(tmp_path), log=lambda s: None)


def test_probe_reason_names_the_sglang_command(monkeypatch, tmp_path):
    monkeypatch.delenv(staged.ENV, raising=False)
    assert staged.part_for("sglang.kernels.ops.attention.dsv4.dequant_k_cache") == "sglang"
    hint = staged.missing_hint("sglang.kernels.ops.attention.dsv4.dequant_k_cache")
    assert staged.SGLANG_STAGE_COMMAND in hint and staged.ENV in hint and "--parts" not in hint
    monkeypatch.setenv(staged.ENV, str(tmp_path))
    assert "stage-sglang" in staged.missing_hint("sglang.kernels.ops.attention.dsv4.kv_layout")
    P.reset_caches()


def _top_level_imports(path: Path, root: Path) -> set[str]:
    """Modules a staged file imports at module level (relative imports resolved)."""
    tree = ast.parse(path.read_text())
    pkg = list(path.relative_to(root).with_suffix("").parts)
    base = pkg[:-1]
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mod = ".".join((base[: len(base) - node.level + 1] if node.level else []) + ([node.module] if node.module else []))
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}
    return {m for m in out if m.split(".")[0] == "sglang"}


def _resolves(root: Path, mod: str) -> bool:
    p = root.joinpath(*mod.split("."))
    return (p / "__init__.py").is_file() or p.with_suffix(".py").is_file()


@pytest.mark.skipif(not REAL_WHEEL.is_file(), reason=f"the real SGLang wheel is not at {REAL_WHEEL}")
def test_real_wheel_stages_and_entry_modules_resolve(tmp_path):
    """The real 0.5.23 wheel: every REQUIRED file is copied; the module-level import closure of
    the modules the sglang entries import resolves inside the folder (copies or stand-ins), so
    on a GPU machine only torch and triton come from outside."""
    from dsv4_numerics.kernels.sglang.triton import MODULES

    dest = tmp_path / "st"
    m = sg.stage(dest, REAL_WHEEL, log=lambda s: None)
    assert all(m["files"][r]["kind"] == "copy" for r in sg.REQUIRED)
    assert not any(k.startswith(sg.DSV4 + "asm/") for k in m["files"])
    assert any(k.startswith(sg.JIT + "csrc/deepseek_v4/") for k in m["files"])
    todo, seen, unresolved = list(MODULES), set(), set()
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        parts = mod.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        p = dest.joinpath(*parts)
        f = p / "__init__.py" if (p / "__init__.py").is_file() else p.with_suffix(".py")
        if not f.is_file():
            parent = ".".join(parts[:-1])  # "from pkg import name" where name is not a module
            if not (parent and _resolves(dest, parent)):
                unresolved.add(mod)
            continue
        todo += [d for d in _top_level_imports(f, dest) if d not in seen]
    assert not unresolved, sorted(unresolved)
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    assert size < 16 * 2**20  # travels inside .staged within one 64 MiB carry


_FAKE_TRITON = '''
import importlib.abc, importlib.machinery, sys, types

class _Any:
    def __init__(self, name): self._n = name
    def __getattr__(self, k): return _Any(self._n + "." + k)
    def __call__(self, *a, **k):
        return a[0] if len(a) == 1 and callable(a[0]) and not k else _Any(self._n + "()")
    def __getitem__(self, k): return _Any(self._n + "[]")

class _Mod(types.ModuleType):
    def __getattr__(self, k):
        if k.startswith("__"):
            raise AttributeError(k)
        return _Any(self.__name__ + "." + k)

class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        m = _Mod(spec.name); m.__path__ = []; return m
    def exec_module(self, m):
        pass

sys.meta_path.insert(0, _Finder())
'''


@pytest.mark.skipif(not REAL_WHEEL.is_file(), reason=f"the real SGLang wheel is not at {REAL_WHEEL}")
def test_real_wheel_modules_import_with_the_standins(tmp_path):
    """Every module the sglang entries import really imports from the staged folder (activation as
    the probes do it; module-level code runs, so every name a stand-in must provide is checked) --
    with a permissive fake ``triton`` where none is installed (a CPU machine): kernels are only
    defined, never compiled. ``msgspec`` comes from the staged fallback when not installed."""
    import subprocess
    import sys

    from dsv4_numerics.kernels.sglang.triton import MODULES

    dest = tmp_path / "st"
    sg.stage(dest, REAL_WHEEL, log=lambda s: None)
    (tmp_path / "fake_triton.py").write_text(_FAKE_TRITON)
    code = (
        "import importlib, importlib.util, sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "if importlib.util.find_spec('triton') is None:\n"
        "    import fake_triton\n"
        "from dsv4_numerics.kernels import staged\n"
        "assert staged.activate() == []\n"
        f"for m in {list(MODULES)!r}:\n"
        "    importlib.import_module(m)\n"
        "import sglang, msgspec\n"
        "print('ok', sglang.__file__)\n"
    )
    env = dict(os.environ, DSV4_STAGED=str(dest))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ok ") and str(dest) in r.stdout
