"""``dsv4_numerics.compare_writers`` / ``read_foreign``: the cross-engine checks for a kernel
author's own callables, ``KernelEntry`` objects and registry names (``dsv4_numerics/api/cross_engine.py``)."""

from __future__ import annotations

import pytest

import dsv4_numerics as dn
from dsv4_numerics.reference.caches import model1
from dsv4_numerics.reference.errors import InputError

from ..mutants import reference_entry


def _writer(rule: str):
    def write(inputs):
        return {"cache": model1.insert(inputs["cache"], inputs["k"], inputs["slot_mapping"], inputs["block_size"],
                                       rule=rule)}
    return write


def test_a_user_writer_against_another_is_explained_by_the_declared_rules():
    rows = dn.compare_writers(_writer("scale_clamp"), _writer("amax_clamp"), policies_a={"scale_rule": "scale_clamp"},
                              name_a="mine.q_s", name_b="theirs.q_a")
    assert len(rows) == len(dn.cases("swa_write")) and all(r.explained for r in rows), [r.line() for r in rows]
    assert sum(r.differing_bytes for r in rows) > 0
    assert rows[0].writer_a == "mine.q_s" and rows[0].policy_differences == {"scale_rule": ("scale_clamp", "amax_clamp")}


def test_an_undeclared_difference_is_not_explained():
    # writer A writes Q_S but declares nothing: its bytes differ where the reference predicts none
    rows = dn.compare_writers(_writer("scale_clamp"), _writer("amax_clamp"))
    bad = [r for r in rows if not r.explained]
    assert bad and all(r.unexplained_bytes == r.differing_bytes > 0 for r in bad)
    assert "NOT explained" in bad[0].line()


def test_a_reader_of_the_registry_skips_with_its_reason_and_a_user_reader_is_judged():
    gpu_reader = dn.read_foreign(_writer("scale_clamp"), "flashmla.sparse_decode.sm90", cases=dn.cases("decode")[:1])
    assert gpu_reader[0].verdict in ("skip", "pass")
    if gpu_reader[0].verdict == "skip":
        assert "flashmla.sparse_decode.sm90" in gpu_reader[0].line()
    mine = reference_entry("gather")
    rows = dn.read_foreign(_writer("scale_clamp"),
                           lambda inputs: mine.call(dn.Case(inputs.name, inputs.stage, dict(inputs), inputs.params)),
                           reader_stage="gather")
    assert rows and all(r.verdict == "pass" for r in rows), [r.line() for r in rows]
    assert all(r.changed_records > 0 for r in rows if r.rewritten_records > 8)


def test_registry_writer_unavailable_here_is_a_skip_not_a_crash():
    rows = dn.compare_writers("sglang.store_jit", _writer("amax_clamp"), cases=dn.cases("swa_write")[:1])
    if rows[0].skipped:
        assert rows[0].skipped.startswith("sglang.store_jit:")


def test_bad_arguments_name_the_argument():
    with pytest.raises(InputError, match="no.such"):
        dn.compare_writers("no.such.writer", _writer("amax_clamp"))
    with pytest.raises(InputError, match="reader_stage"):
        dn.read_foreign(_writer("amax_clamp"), lambda inputs: {})
    with pytest.raises(InputError, match="reader"):
        dn.read_foreign(_writer("amax_clamp"), "vllm_cuda.swa_quant_insert")
    with pytest.raises(InputError, match="prefill"):  # a prefill reads a bf16 workspace, no paged cache
        dn.read_foreign(_writer("amax_clamp"), "flashmla.sparse_prefill.sm90")
    with pytest.raises(InputError, match="device"):
        dn.compare_writers(_writer("amax_clamp"), _writer("amax_clamp"), device="warp-drive")
    with pytest.raises(InputError, match="policies"):
        dn.compare_writers(_writer("amax_clamp"), _writer("amax_clamp"), policies_a={"scale_rule": "nope"})


def test_the_default_device_is_the_gpu_for_a_gpu_entry_and_the_cpu_otherwise(monkeypatch):
    from dsv4_numerics.api import cross_engine as api
    from dsv4_numerics.kernels import registry

    gpu_entry, cpu_entry = registry.get("flashmla.sparse_decode.sm90"), reference_entry("gather")
    monkeypatch.setattr(api.torch.cuda, "is_available", lambda: True)
    assert api.resolve_device("read_foreign", None, _writer("amax_clamp"), gpu_entry) == "cuda"
    assert api.resolve_device("read_foreign", None, _writer("amax_clamp"), cpu_entry) is None
    assert api.resolve_device("read_foreign", "cpu", gpu_entry) == "cpu"
    monkeypatch.setattr(api.torch.cuda, "is_available", lambda: False)
    assert api.resolve_device("read_foreign", None, gpu_entry) is None  # the entry's probe then skips it
