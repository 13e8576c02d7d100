"""The kernel registry and the availability probes (CPU; runs in CI)."""

from __future__ import annotations

import sys
import types

import pytest

from dsv4_numerics.kernels import probe as P
from dsv4_numerics.kernels import registry
from dsv4_numerics.kernels.registry import KernelEntry, UnknownKernelError, validate_entry
from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.errors import InputError

ENTRIES = registry.all_entries()


def test_registry_is_not_empty_and_names_are_unique():
    names = [e.name for e in ENTRIES]
    assert len(names) == len(set(names))
    # the adapters owned by this area are registered
    for n in ("flashmla.sparse_decode.sm90", "flashmla.sparse_prefill.sm90", "flashmla.sparse_decode.sm100",
              "flashinfer.dsv4_decode.trtllm_gen", "flashinfer.dsv4_decode.sm120", "cutedsl.dequant_gather"):
        assert n in names


_CASES: dict[str, list] = {}


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_entry_declaration(entry):
    assert validate_entry(entry) == []
    if entry.stage not in _CASES:  # KeyError if the stage has no registered cases
        _CASES[entry.stage] = default_cases(entry.stage)
    cases = _CASES[entry.stage]
    assert len(cases) > 0
    assert len({c.name for c in cases}) == len(cases), "case names must be unique (they are test ids)"


@pytest.mark.skipif(P.gpu_info().present, reason="checks the CPU-machine answer of every GPU probe")
@pytest.mark.parametrize("entry", [e for e in ENTRIES if "gpu" in e.markers], ids=lambda e: e.name)
def test_gpu_entries_say_why_they_cannot_run_on_a_cpu_machine(entry):
    ok, reason = entry.available()
    assert not ok
    assert isinstance(reason, str) and len(reason) > 10


def test_get_unknown_name_is_one_clear_line():
    with pytest.raises(UnknownKernelError) as ei:
        registry.get("flashmla.sparse_decode.sm9")
    msg = str(ei.value)
    assert "\n" not in msg
    assert "unknown kernel entry 'flashmla.sparse_decode.sm9'" in msg
    assert "did you mean flashmla.sparse_decode.sm90" in msg
    assert isinstance(ei.value, InputError)
    assert registry.get("flashmla.sparse_decode.sm90").stage == "decode"


def test_entries_attribute_is_assembled_lazily():
    assert [e.name for e in registry.ENTRIES] == [e.name for e in ENTRIES]
    with pytest.raises(AttributeError):
        registry.NO_SUCH_THING  # noqa: B018


def _entry(**kw):
    base = dict(name="x.y", stage="decode", family="CUDA", source="m.f", archs=("sm90",), dtypes=("bfloat16",),
                policies={"index_rule": "minus1_only"}, tolerance_scope="x", probe=lambda: None, call=lambda c: {})
    base.update(kw)
    return KernelEntry(**base)


def test_validate_entry_names_each_problem():
    assert validate_entry(_entry()) == []
    probs = validate_entry(_entry(family="Cuda", archs=("sm91",), dtypes=("bf16",),
                                  policies={"index_rule": "minus_one", "output_inv_roped": "yes"}, name="a b"))
    text = " | ".join(probs)
    for needle in ("family 'Cuda'", "sm91", "bf16", "index_rule='minus_one'", "output_inv_roped='yes'", "spaces"):
        assert needle in text


def test_available_turns_a_raising_probe_into_a_reason():
    def boom():
        raise RuntimeError("driver exploded")

    ok, reason = _entry(probe=boom).available()
    assert not ok and reason == "probe raised RuntimeError: driver exploded"
    assert _entry(probe=lambda: None).available() == (True, "")
    assert _entry(probe=lambda: "needs X").available() == (False, "needs X")


def test_markers_follow_archs():
    assert _entry(archs=("sm90",)).markers == ("gpu", "sm90")
    assert _entry(archs=("sm100", "sm103")).markers == ("gpu", "sm100")
    assert _entry(archs=("sm120", "sm121")).markers == ("gpu", "sm120")
    assert _entry(archs=("gfx942",)).markers == ("gpu", "rocm")
    assert _entry(archs=("any-gpu",)).markers == ("gpu",)
    assert _entry(archs=("cpu",)).markers == ()


def test_assembly_raises_for_a_missing_or_broken_family(monkeypatch):
    monkeypatch.setattr(registry, "FAMILY_MODULES", ("no_such_family_zz",))
    with pytest.raises(ModuleNotFoundError, match="no_such_family_zz"):
        registry.assemble()

    def bad_import(name, *a, **k):  # the family module exists but one of *its* imports is missing
        raise ModuleNotFoundError("No module named 'some_dependency'", name="some_dependency")

    monkeypatch.setattr(registry, "FAMILY_MODULES", ("_broken_fam",))
    monkeypatch.setattr(registry, "import_family", bad_import)
    with pytest.raises(ModuleNotFoundError, match="some_dependency"):
        registry.assemble()


def test_assembly_rejects_duplicate_names(monkeypatch):
    fam = types.ModuleType("dsv4_numerics.kernels._dup_fam")
    fam.ENTRIES = [_entry(), _entry()]
    monkeypatch.setitem(sys.modules, "dsv4_numerics.kernels._dup_fam", fam)
    monkeypatch.setattr(registry, "FAMILY_MODULES", ("_dup_fam",))
    with pytest.raises(RuntimeError, match="defined twice"):
        registry.assemble()


# ----------------------------------------------------------------------------- probes

def _fake_gpu(monkeypatch, info):
    monkeypatch.setattr(P, "gpu_info", lambda: info)


def test_arch_reason_texts(monkeypatch):
    h200 = P.GpuInfo(True, "cuda", "NVIDIA H200", (9, 0), "sm90")
    _fake_gpu(monkeypatch, h200)
    assert P.arch_reason(("sm90",)) is None
    assert P.arch_reason(("any-cuda",)) is None
    assert P.arch_reason(("any-gpu",)) is None
    assert P.arch_reason(("sm100", "sm103")) == "needs sm100/sm103 (found sm90 NVIDIA H200)"
    assert P.arch_reason(("gfx942",)) == "needs ROCm gfx942 (found CUDA sm90 NVIDIA H200)"
    assert "unknown architecture" in P.arch_reason(("sm91",))
    mi300 = P.GpuInfo(True, "rocm", "AMD Instinct MI300X", (9, 4), "gfx942")
    _fake_gpu(monkeypatch, mi300)
    assert P.arch_reason(("gfx942", "gfx950")) is None
    assert P.arch_reason(("sm90",)) == "needs sm90 (found ROCm gfx942 AMD Instinct MI300X)"
    _fake_gpu(monkeypatch, P.GpuInfo(False, why="no GPU visible"))
    assert P.arch_reason(("sm90",)) == "needs sm90 GPU (no GPU visible)"
    assert P.arch_reason(("cpu",)) is None


def test_module_reason_names_the_distribution(monkeypatch):
    P.reset_caches()
    assert P.module_reason("no_such_module_zz", "no-such-dist") == \
        "no-such-dist not installed (module no_such_module_zz not importable)"
    assert P.module_reason("torch") is None
    monkeypatch.setattr(P, "dist_version", lambda d: "0.6.0")
    P.module_reason.cache_clear()
    assert P.module_reason("torch", "flashinfer-python", "0.7.2") == "flashinfer-python 0.6.0 installed, needs >= 0.7.2"
    P.reset_caches()


def test_import_reason_reports_loader_errors(tmp_path, monkeypatch):
    (tmp_path / "dsv4_bad_so_zz.py").write_text("raise OSError('libcudart.so.13: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    P.reset_caches()
    r = P.import_reason("dsv4_bad_so_zz")
    assert r == "dsv4_bad_so_zz failed to load: OSError: libcudart.so.13: cannot open shared object file"
    assert P.import_reason("json") is None
    P.reset_caches()


def test_staged_vllm_reason_without_vllm():
    P.reset_caches()
    r = P.staged_vllm_reason("vllm_zz_not_there.third_party.flashmla")
    assert r is not None and "vllm_zz_not_there.third_party.flashmla not importable" in r
    P.reset_caches()


def test_chain_returns_the_first_reason_and_caches():
    calls = []

    def a():
        calls.append("a")
        return None

    def b():
        calls.append("b")
        return "needs b"

    def c():
        calls.append("c")
        return "needs c"

    probe = P.chain(a, b, c)
    assert probe() == "needs b" and probe() == "needs b"
    assert calls == ["a", "b"]
