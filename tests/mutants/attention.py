"""Mutants of sparse attention decode and prefill."""

from __future__ import annotations

import math

import torch

from dsv4_numerics.reference.attention.ordered import Segment
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.constants import NOPE_DIM

from .machinery import MutantEntry, attn_out, case_segments, mutant, run_oracle


def _extra_dropped(case: Case) -> dict:
    """The compressed (extra) segment not attended: main-only decode."""
    return attn_out(run_oracle(case, case_segments(case)[:1]))


def _separate_softmaxes(case: Case) -> dict:
    """Each segment softmaxed on its own and the outputs added (attention 2.6 requires one softmax
    over the union)."""
    segs = case_segments(case)
    if len(segs) == 1:
        return attn_out(run_oracle(case, segs))
    parts = [run_oracle(case, [s]) for s in segs]
    out = sum(p.out for p in parts)
    return {"out": out.to(torch.bfloat16), "lse": parts[0].lse.to(torch.float32)}


def sink_negated(case: Case) -> dict:
    """Sink applied with the wrong sign (``sigmoid(lse + sink)``)."""
    sink = case.inputs.get("sink")
    return attn_out(run_oracle(case, case_segments(case), sink=None if sink is None else -sink))


def _sink_scaled(case: Case) -> dict:
    """Sink multiplied by the softmax scale (attention 1.1, H14: the sink is never scaled)."""
    sink = case.inputs.get("sink")
    return attn_out(run_oracle(case, case_segments(case), sink=None if sink is None else sink * case.inputs["scale"]))


def _lse_base2(case: Case) -> dict:
    """LSE returned in base 2 (FlashMLA README's stale claim, attention 2.1; FI SM120's convention)."""
    r = run_oracle(case, case_segments(case))
    return attn_out(r, r.lse / math.log(2.0))


LSE_OFFSET = 2.0**-12  # the constant-offset mutant's shift (~2.4e-4: 25x the tier-A lse atol)


def _lse_sink_merged(case: Case) -> dict:
    """The sink term ``ln(1 + exp(sink - lse))`` folded into the returned sink-free LSE (a sink-merged
    LSE, FlashInfer SM120's convention, returned where the sink-free one is declared; attention 2.2).
    Lonely rows and ``+-inf`` sinks keep the sink-free value, so only the tolerance, not the anomaly
    rule, can catch it."""
    r = run_oracle(case, case_segments(case))
    return attn_out(r, torch.where(torch.isfinite(r.lse) & torch.isfinite(r.lse_with_sink), r.lse_with_sink, r.lse))


def _lse_offset(case: Case) -> dict:
    """LSE off by a constant ``LSE_OFFSET`` (a stale correction term): the per-row logit allowance
    must not hide it."""
    r = run_oracle(case, case_segments(case))
    return attn_out(r, r.lse + LSE_OFFSET)


def _lonely_nan(case: Case) -> dict:
    """A query with no valid key gives 0/0 = NaN instead of exact 0 (attention 2.4)."""
    r = run_oracle(case, case_segments(case))
    lonely = (r.n_valid == 0).reshape(-1, 1, 1)
    out = torch.where(lonely, torch.full_like(r.out, float("nan")), r.out)
    return {"out": out.to(torch.bfloat16), "lse": r.lse.to(torch.float32)}


def _lse_plus_inf_lonely(case: Case) -> dict:
    """FlashMLA's ``+inf`` empty-row LSE passed through without conversion (H1)."""
    r = run_oracle(case, case_segments(case))
    lse = torch.where(r.lse == -math.inf, torch.full_like(r.lse, math.inf), r.lse)
    return attn_out(r, lse)


def _rope_dims_not_in_v(case: Case) -> dict:
    """V taken as the 448 NoPE dims only (the V3.2 convention; DSv4's V is the full 512-dim row)."""
    r = run_oracle(case, case_segments(case))
    out = r.out.clone()
    out[..., NOPE_DIM:] = 0.0
    return {"out": out.to(torch.bfloat16), "lse": r.lse.to(torch.float32)}


def _topk_length_ignored(case: Case) -> dict:
    """``topk_length`` / segment lengths ignored: every column is attended (vLLM#36616)."""
    segs = [Segment(s.rows, s.idx, None, s.rule) for s in case_segments(case)]
    return attn_out(run_oracle(case, segs))


def _dense(case: Case, *, zero_invalid: bool = True, sum_bf16: bool = False) -> dict:
    """A plain dense attention over the gathered rows (float64), with two bug switches:
    ``zero_invalid=False``: invalid slots are masked in the logits but their (clamped) rows are
    not zeroed, so NaN in unreferenced rows leaks through ``0 * NaN`` (attention 2.7; FlashMLA
    zero-fills them for this reason); ``sum_bf16``: the softmax row sum is accumulated in bf16."""
    from dsv4_numerics.reference.attention.ordered import segment_validity

    inp = case.inputs
    segs = case_segments(case)
    q = inp["q"].to(torch.float64)
    T = q.shape[0]
    valid = segment_validity(segs, T)
    rows = torch.cat([s.rows.index_select(0, s.idx.to(torch.int64).clamp(0, s.rows.shape[0] - 1).reshape(-1))
                      .reshape(T, -1, s.rows.shape[1]) for s in segs], dim=1).to(torch.float64)
    if zero_invalid:
        rows = rows.masked_fill(~valid.unsqueeze(-1), 0.0)
    s = torch.einsum("thd,tkd->thk", q, torch.nan_to_num(rows, nan=0.0) if not zero_invalid else rows) * inp["scale"]
    s = s.masked_fill(~valid.unsqueeze(1), -math.inf)
    m = s.amax(-1, keepdim=True)
    has = torch.isfinite(m)
    p = torch.exp(s - torch.where(has, m, torch.zeros_like(m)))
    if sum_bf16:
        acc = torch.zeros(p.shape[:-1], dtype=torch.bfloat16, device=p.device)
        for k in range(p.shape[-1]):
            acc = acc + p[..., k].to(torch.bfloat16)
        L = acc.to(torch.float64).unsqueeze(-1)
    else:
        L = p.sum(-1, keepdim=True)
    sink = inp.get("sink")
    den = L if sink is None else L + torch.exp(sink.to(torch.float64).view(1, -1, 1) - torch.where(has, m, torch.zeros_like(m)))
    out = torch.einsum("thk,tkd->thd", p, rows) / den
    out = torch.where(has, out, torch.zeros_like(out))
    if sink is not None:
        out = torch.where(torch.isposinf(sink.view(1, -1, 1)), torch.zeros_like(out), out)
    lse = torch.where(has, m + torch.log(L), torch.full_like(m, -math.inf)).squeeze(-1)
    return {"out": out.to(torch.bfloat16), "lse": lse.to(torch.float32)}


MUTANTS: list[MutantEntry] = [
    mutant("extra_segment_dropped", "decode", "compressed segment not attended (attention 2.6)", _extra_dropped),
    mutant("segments_separate_softmax", "decode", "one softmax per segment instead of over the union (attention 2.6)",
           _separate_softmaxes),
    mutant("sink_wrong_sign", "decode", "sigmoid(lse + sink) (attention 2.3)", sink_negated),
    mutant("sink_scaled", "decode", "sink multiplied by the softmax scale (H14)", _sink_scaled),
    mutant("lse_base2", "decode", "LSE returned in base 2 (FlashMLA README, H1)", _lse_base2),
    mutant("lse_plus_inf_lonely_unconverted", "decode", "FlashMLA's +inf empty-row LSE not converted (H1)", _lse_plus_inf_lonely),
    mutant("lse_sink_merged", "decode", "sink term folded into the sink-free LSE (attention 2.2)", _lse_sink_merged),
    mutant("lse_constant_offset", "decode", "LSE off by a constant 2**-12 (hidden by no per-row allowance)",
           _lse_offset),
    mutant("lonely_query_nan", "decode", "0/0 for a query with no valid key (attention 2.4)", _lonely_nan),
    mutant("rowsum_in_bf16", "decode", "softmax row sum accumulated in bf16 (attention 4.1: L stays fp32)",
           lambda c: _dense(c, sum_bf16=True)),
    mutant("rope_dims_excluded_from_v", "decode", "V = NoPE dims only (V3.2 convention; DSv4 V is 512 wide)", _rope_dims_not_in_v),
    mutant("invalid_rows_not_zeroed", "decode", "unreferenced NaN rows leak through 0*NaN (attention 2.7, FMLA zero-fill)",
           lambda c: _dense(c, zero_invalid=False)),
    mutant("topk_length_ignored", "decode", "segment lengths ignored: columns past the prefix attended (vLLM#36616)",
           _topk_length_ignored),
    mutant("prefill_topk_length_ignored", "prefill", "topk_length not passed to the prefill kernel (vLLM#36616)",
           _topk_length_ignored),
]
