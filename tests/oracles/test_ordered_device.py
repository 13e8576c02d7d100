"""Where the ordered oracle runs (``matrix.run_entry(ordered_device=...)`` / ``DSV4_ORDERED_DEVICE``):
only calls of at least ``ORDERED_OFFLOAD_WORK`` multiply-adds move, a name that is no device is an
error result naming the argument, a CPU or an absent CUDA device changes nothing, and on a GPU the
moved calls give the CPU's bits and verdicts (GPU test: skips without CUDA)."""
from __future__ import annotations

import pytest
import torch

from dsv4_numerics.oracles import matrix
from dsv4_numerics.oracles import stages as stg
from dsv4_numerics.oracles.stages.core import ORDERED_OFFLOAD_WORK, _ordered_device
from dsv4_numerics.reference.attention.ordered import Segment
from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.policies import IndexRule

from ..mutants import reference_entry


def _shape_only(T, H, D, Ks):
    q = torch.empty((T, H, D), device="meta")
    return q, [Segment(torch.empty((8, D), device="meta"), torch.empty((T, k), dtype=torch.int32, device="meta"),
                       None, IndexRule.MINUS1_ONLY) for k in Ks]


def test_only_calls_of_the_offload_size_move():
    pol = {"ordered_device": "cuda"}
    q, segs = _shape_only(4, 8, 512, (64, 64))  # 2**20 multiply-adds: stays where q is
    assert 4 * 8 * 512 * 128 < ORDERED_OFFLOAD_WORK and _ordered_device(q, segs, pol) == q.device
    q, segs = _shape_only(64, 64, 512, (128, 512))  # 2**30.3: moves
    assert _ordered_device(q, segs, pol) == torch.device("cuda")
    assert _ordered_device(q, segs, {}) == q.device  # no policy: where q is


def _largest_decode_case():
    return max(default_cases("decode"),
               key=lambda c: c.inputs["q"].shape[0] * c.inputs["q"].shape[1] * (
                   c.inputs["swa_indices"].shape[1] + (c.inputs["extra_indices"].shape[1] if "extra_indices" in c.inputs else 0)))


def test_a_name_that_is_no_device_is_an_error_result_and_cpu_changes_nothing(monkeypatch):
    case = _largest_decode_case()
    e = reference_entry("decode")
    bad = matrix.run_entry(e, cases=[case], ordered_device="abacus")
    assert [r.verdict for r in bad] == ["error"] and bad[0].rule == "ordered_device" and "abacus" in bad[0].message
    monkeypatch.setenv("DSV4_ORDERED_DEVICE", "abacus")  # the environment's value is checked the same way
    assert matrix.run_entry(e, cases=[case])[0].rule == "ordered_device"
    monkeypatch.delenv("DSV4_ORDERED_DEVICE")
    plain = matrix.run_entry(e, cases=[case])
    cpu = matrix.run_entry(e, cases=[case], ordered_device="cpu")
    assert [(r.verdict, r.rule) for r in cpu] == [(r.verdict, r.rule) for r in plain] == [("pass", r.rule) for r in plain]
    if not torch.cuda.is_available():  # an absent CUDA device: a placement hint, ignored
        hint = matrix.run_entry(e, cases=[case], ordered_device="cuda")
        assert [(r.verdict, r.rule) for r in hint] == [(r.verdict, r.rule) for r in plain]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the ordered oracle moved there)")
def test_on_a_gpu_the_large_calls_move_with_the_same_bits_and_verdicts():
    case = _largest_decode_case()
    spec = stg.get("decode")
    q = case.inputs["q"]
    K = case.inputs["swa_indices"].shape[1] + case.inputs["extra_indices"].shape[1]
    assert q.shape[0] * q.shape[1] * q.shape[2] * K >= ORDERED_OFFLOAD_WORK  # the case really moves
    pol = spec.policies({})
    cpu = spec.expected(case, pol)
    gpu = spec.expected(case, dict(pol, ordered_device="cuda"))
    assert cpu["_oracle"]["device"] == "cpu" and gpu["_oracle"]["device"].startswith("cuda")
    for k in ("out", "lse", "max_logits", "lse_with_sink"):
        a, b = cpu[k], gpu[k]
        assert b.device.type == "cpu" and torch.equal(a.view(torch.int64), b.view(torch.int64)), k
    e = reference_entry("decode")
    r_cpu = matrix.run_entry(e, cases=[case], oracle_mode="ordered", ordered_device="cpu")
    r_gpu = matrix.run_entry(e, cases=[case], oracle_mode="ordered", ordered_device="cuda")
    assert [(r.verdict, r.rule) for r in r_gpu] == [(r.verdict, r.rule) for r in r_cpu]
    assert r_gpu[0].details["oracle"]["device"].startswith("cuda")
