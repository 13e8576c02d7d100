"""The DeepSeek-V4.1 attention stages and the V4.1 query quantiser stage (registered into
``oracles.stages.STAGES`` when ``oracles.stages`` is imported).

=====================  =====================================================================
v41_sparse_decode      ``out`` ``[T, H, 512]`` bf16, optional ``lse`` / ``max_logits`` /
v41_sparse_prefill     ``lse_with_sink`` ``[T, H]``: the decode / prefill conventions of
                       ``oracles.stages`` over the V4.1 caches (``reference.attention.v41``)
v41_query_quant        ``q_codes`` uint8 ``[T, Q]`` (E4M3FN bytes), ``q_scales`` uint8
                       (F8_128x4 buffer), optional ``kv_normed`` bf16 ``[T, KV]``; bit-exact
=====================  =====================================================================

Policies: the attention stages honour those of ``decode`` / ``prefill`` (``nan``,
``attention_mode``, ``index_rule``, ``missing_lengths``, ``ue8m0``, ``oracle``) plus ``v41_layout``,
the byte order the READER assumes. The expected outputs are always those of the rows as written
(the case's ``v41_layout`` input); when the reader's declared order differs from the writer's, the
judge still compares against the written rows and its verdict names both layout policies and
whether the kernel's output is the misread one (hazard H13: the two orders have the same bytes per
token, so nothing rejects the wrong one).
"""

from __future__ import annotations

from typing import Any

import torch

from dsv4_numerics.reference.attention.ordered import sparse_attention
from dsv4_numerics.reference.attention.v41 import V41Paged, v41_segments
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.constants import V41_MXFP8_GROUP
from dsv4_numerics.reference.policies import IndexRule, NanPolicy, Ue8m0Consumer, V41Layout, V41Record
from dsv4_numerics.reference.pipeline.query_quant import f8_128x4_offsets, fused_q_kv_rmsnorm_quant

from .. import bytes_diff as bd
from . import core as st

__all__ = ["v41_decode_segments", "v41_prefill_segments", "written_layout", "reader_layout"]


def written_layout(case: Case) -> str:
    """The byte order the case's caches were written in (input ``v41_layout``; interleaved if absent)."""
    return V41Layout(case.inputs.get("v41_layout", V41Layout.INTERLEAVED.value)).value


def reader_layout(policies: dict | None) -> str:
    """The byte order the entry's reader assumes (policy ``v41_layout``, default interleaved)."""
    return V41Layout(st.policy_value(policies, "v41_layout", V41Layout.INTERLEAVED.value)).value


def _paged(inp: dict, prefix: str, on) -> V41Paged:
    """The ``swa`` / ``extra`` cache of a case with its indices (``[0, 0]`` in prefill cases, which
    index the workspace instead) and lengths."""
    idx = inp.get(f"{prefix}_indices")
    return V41Paged(on(inp[f"{prefix}_cache"]), int(inp[f"{prefix}_block_size"]),
                    V41Record(inp.get(f"{prefix}_record", V41Record.MXFP8.value)),
                    on(idx) if idx is not None else torch.zeros(0, 0, dtype=torch.int32), on(inp.get(f"{prefix}_lens")))


def _decoded(case: Case, policies: dict, layout: str) -> list:
    """The V4.1 segments of a case on the CPU (the fast oracle moves them to its device itself)."""
    inp = case.inputs

    def on(x):
        return x if x is None else x.cpu()

    main = _paged(inp, "swa", on)
    extra = _paged(inp, "extra", on) if "extra_cache" in inp else None
    rule = IndexRule(st.index_rule_of(case, policies))
    consumer = st.policy_value(policies, "ue8m0", Ue8m0Consumer.EXACT.value)
    return v41_segments(main, extra, layout, rule, consumer)


def v41_decode_segments(case: Case, policies: dict, layout: str | None = None) -> list:
    """``[SWA, compressed?]`` oracle segments of a ``v41_sparse_decode`` case (CPU), the caches decoded
    in ``layout`` (default: the order they were written in)."""
    return _decoded(case, policies, layout or written_layout(case))


def v41_prefill_segments(case: Case, policies: dict, layout: str | None = None) -> list:
    """The one combined segment of a ``v41_sparse_prefill`` case: the workspace rows ``[extra slots |
    SWA slots]`` (``cases_v41_attention``) under the prefill conventions (``stages.prefill_segments``:
    index rule, ``missing_lengths``)."""
    segs = _decoded(case, policies, layout or written_layout(case))
    rows = torch.cat([s.rows for s in segs[::-1]])  # extra region first, then the SWA region
    inp = case.inputs
    ws = {"kv": rows, "indices": inp["indices"]}
    if inp.get("topk_length") is not None:
        ws["topk_length"] = inp["topk_length"]
    return st.prefill_segments(Case(case.name, "prefill", ws, case.params), policies)


def _misread(case: Case, policies: dict, segs: list) -> torch.Tensor:
    nan = st.policy_value(policies, "nan", NanPolicy.PROPAGATE.value)
    sink = case.inputs.get("sink")  # the segments are decoded on the CPU: the misread runs there too
    return sparse_attention(case.inputs["q"].cpu(), segs, case.inputs["scale"], None if sink is None else sink.cpu(),
                            nan_policy=nan).out


def _expected_v41_decode(case: Case, policies: dict) -> dict:
    # decoded on the CPU (the V4.1 cases are small); under oracle=fast the attention runs on the device
    out = st.attention_outputs(case, policies, case.inputs["q"].cpu(), v41_decode_segments(case, policies))
    if reader_layout(policies) != written_layout(case):
        out["_misread"] = _misread(case, policies, v41_decode_segments(case, policies, layout=reader_layout(policies)))
    return out


def _expected_v41_prefill(case: Case, policies: dict) -> dict:
    out = st.attention_outputs(case, policies, case.inputs["q"].cpu(), v41_prefill_segments(case, policies))
    if reader_layout(policies) != written_layout(case):
        out["_misread"] = _misread(case, policies, v41_prefill_segments(case, policies, reader_layout(policies)))
    return out


def _distance(g: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest ``|g - ref|`` where both are finite; ``inf`` when their NaN / inf positions differ."""
    if not torch.equal(torch.isfinite(g), torch.isfinite(ref)) or not torch.equal(torch.isnan(g), torch.isnan(ref)):
        return float("inf")
    fin = torch.isfinite(g)
    return float((g - ref).abs()[fin].max()) if bool(fin.any()) else 0.0


def _judge_v41_attention(case: Case, expected: dict, got: dict, scope: st.JudgeScope) -> st.Verdict:
    """``judge_attention`` against the rows as written; a reader whose declared ``v41_layout``
    differs from the writer's gets a verdict naming both policies (module docstring)."""
    v = st.judge_attention(case, expected, got, scope, st.ATTN_OUTPUTS)
    reader, writer = reader_layout(scope.policies), written_layout(case)
    if reader == writer or "_misread" not in expected:
        return v
    note = (f"writer/reader byte-order disagreement (H13): the caches were written with v41_layout={writer}, "
            f"the reader declares v41_layout={reader}")
    if "out" in got:
        g = got["out"].detach().cpu().to(torch.float64)
        d_mis, d_true = _distance(g, expected["_misread"]), _distance(g, expected["out"])
        if d_mis < d_true:
            note += (f"; the kernel's out is the misread one (max |out - misread| {d_mis:.3g} vs "
                     f"|out - written| {d_true:.3g}): declare policies={{'v41_layout': '{reader}'}} only for "
                     f"caches written {reader}")
    details = dict(v.details, v41_layout={"writer": writer, "reader": reader, "note": note})
    if v.passed:
        return st.Verdict(True, v.rule, v.message, v.worst_ulps, v.headroom, details)
    return st.Verdict(False, "v41_layout_mismatch", f"{note}; {v.message}", v.worst_ulps, v.headroom, details)


# --------------------------------------------------------------------------- query quantiser


def _expected_query_quant(case: Case, policies: dict) -> dict:
    inp = case.inputs
    return fused_q_kv_rmsnorm_quant(inp["qr"], inp["kv"], inp["q_weight"], inp["kv_weight"], float(inp["eps"]))


def _scale_describer(tokens: int, groups: int):
    """``describe(index)`` of the flat F8_128x4 buffer: the (row, group) a byte holds."""
    t_pad = -(-tokens // 128) * 128
    g_pad = -(-groups // 4) * 4
    rows = torch.arange(t_pad)[:, None].expand(t_pad, g_pad)
    grp = torch.arange(g_pad)[None, :].expand(t_pad, g_pad)
    where = torch.empty(t_pad * g_pad, 2, dtype=torch.int64)
    off = f8_128x4_offsets(rows, grp, groups).reshape(-1)
    where[off] = torch.stack([rows.reshape(-1), grp.reshape(-1)], dim=1)

    def describe(idx: tuple[int, ...]) -> dict[str, Any]:
        r, g = (int(x) for x in where[idx[-1]])
        return {"row": r, "group": g, "padding": r >= tokens or g >= groups}

    return describe


def _judge_query_quant(case: Case, expected: dict, got: dict, scope: st.JudgeScope) -> st.Verdict:
    """Bit-exact ``q_codes`` (per token / 32-group) and ``q_scales`` (every byte of the F8_128x4
    buffer, padding included); ``kv_normed`` bit-exact when returned."""
    for k in ("q_codes", "q_scales"):
        if k not in got:
            return st.missing_verdict(k, got)
    t, q = expected["q_codes"].shape
    describers = {
        "q_codes": lambda idx: {"token": int(idx[0]), "group": int(idx[-1]) // V41_MXFP8_GROUP},
        "q_scales": _scale_describer(t, q // V41_MXFP8_GROUP),
        "kv_normed": lambda idx: {"token": int(idx[0]), "column": int(idx[-1])},
    }
    reports, bad = {}, []
    for k in ("q_codes", "q_scales", "kv_normed"):
        if k not in got:
            continue
        g = got[k].detach().cpu()
        if k == "q_codes" and g.dtype != torch.uint8:
            g = g.view(torch.uint8)  # float8_e4m3fn codes
        rep = bd.diff_values(expected[k], g.reshape(expected[k].shape) if g.numel() == expected[k].numel() else g,
                             layout=f"v41_query_quant.{k}", describe=describers[k])
        reports[k] = rep.to_dict()
        if not rep.passed:
            bad.append((k, rep))
    if bad:
        k, rep = bad[0]
        msg = " | ".join(r.summary(max_lines=2).replace("\n", " | ") for _, r in bad)
        return st.Verdict(False, f"{k}:bit_exact", msg, headroom=0.0, details=reports)
    return st.Verdict(True, "bit_exact", "", headroom=float("inf"), details=reports)


# --------------------------------------------------------------------------- registry

_V41_ATTN_DEFAULTS = dict(st.ATTN_DEFAULTS, v41_layout=V41Layout.INTERLEAVED.value, ue8m0=Ue8m0Consumer.EXACT.value)

st.register(st.StageSpec(
    name="v41_sparse_decode",
    kind="numeric",
    outputs=st.ATTN_OUTPUTS,
    defaults=dict(_V41_ATTN_DEFAULTS),
    expected=_expected_v41_decode,
    judge=_judge_v41_attention,
    doc="DeepSeek-V4.1 sparse decode: one softmax over the MXFP8 SWA + MXFP8/NVFP4 compressed "
        "caches, sink (reference.attention.v41; datapath 1.6, H13)"))
st.register(st.StageSpec(
    name="v41_sparse_prefill",
    kind="numeric",
    outputs=st.ATTN_OUTPUTS,
    defaults=dict(_V41_ATTN_DEFAULTS),
    expected=_expected_v41_prefill,
    judge=_judge_v41_attention,
    doc="DeepSeek-V4.1 sparse prefill over the workspace gathered from the V4.1 caches "
        "(one combined segment; attention 1.4, 2)"))
st.register(st.StageSpec(
    name="v41_query_quant",
    kind="bytes",
    outputs=("q_codes", "q_scales", "kv_normed"),
    defaults={},
    expected=_expected_query_quant,
    judge=_judge_query_quant,
    doc="DeepSeek-V4.1 query quantiser: RMS-normalised q as MXFP8 (UE8M0 ceil, zero inverse "
        "for byte 0, F8_128x4 scales) and normalised kv, bit-exact (reference.pipeline.query_quant)"))
