"""The ``v41_compress_insert`` stage: vLLM 0.33.0's DeepSeek-V4.1 fused compressor
(``fused_save_compress_norm`` + ``rope_quant_insert``), registered in ``oracles.stages.STAGES`` on
import. Reference: ``reference.pipeline.compressor_v41`` (its docstring holds the contract).

Canonical outputs:
    ``latent``  bf16 ``[T, 512]``: compared on the rows the reference produces (group ends with
                a state slot); the other rows are not written by the kernel and not compared.
    ``state``   fp32 ``[blocks, capacity, 1024]``: the ring after the call (ratio 2 only).
    ``cache``   the compressed cache after the insert, in the case's form.

Judged in three parts, first failure decides:

1. ``state:bit_exact`` -- the ring stores are verbatim copies of input rows.
2. ``latent:compressor_tier`` -- per element ``|got - ref| <= A[d] + ulp_bf16(max(|got|, |ref|))``
   with ``ref`` the reference's fp32 normed row and ``A`` the compressor's derived error model
   (``oracles.compressor_tier.window_error_bound``, ``W`` = the ratio): the producer's
   ``tl.softmax`` / weighted sum / 512-term sum of squares / ``rsqrt.approx`` in fp32 (H7), then
   the bf16 store (half an ulp, taken as one ulp of the larger magnitude: the rounded value and
   its input share a binade or the rounded one is the larger).
3. ``cache:bit_exact_from_latent`` -- the cache equals ``compressor_v41.v41_rope_quant_insert`` of
   the kernel's OWN latent under the entry's policies (``scale_rule``, ``nvfp4_rule``,
   ``v41_layout``, ``rope_arith``): the insert is integer logic plus fp32 products the reference
   reproduces bit for bit. Every byte is compared, so bytes outside the written records must be
   unchanged.
"""

from __future__ import annotations

import math

import torch

from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.pipeline import compressor_v41 as cv41
from dsv4_numerics.reference.policies import Nvfp4ScaleRule, RopeArithmetic, ScaleRule, V41Layout

from ..compressor_tier import ulp_bf16, window_error_bound
from .core import JudgeScope, StageSpec, Verdict, policy_value, register

__all__ = ["V41_COMPRESS_DEFAULTS", "v41_compress_expected_cache"]

V41_COMPRESS_DEFAULTS = {"scale_rule": ScaleRule.AMAX_CLAMP.value, "nvfp4_rule": Nvfp4ScaleRule.RECIP_MUL.value,
                         "v41_layout": V41Layout.INTERLEAVED.value, "rope_arith": RopeArithmetic.FMA_TRITON.value}


def v41_compress_expected_cache(case: Case, latent: torch.Tensor, policies: dict) -> torch.Tensor:
    """The cache ``rope_quant_insert`` writes from ``latent`` (bf16 ``[T, 512]``) under ``policies``."""
    inp = case.inputs
    return cv41.v41_rope_quant_insert(
        inp["cache"], latent.detach().cpu(), inp["positions"], inp["cos_sin"], inp["cache_slots"],
        inp["compress_ratio"], inp["record"], inp["block_size"], inp.get("fp8_scale"),
        scale_rule=policy_value(policies, "scale_rule", ScaleRule.AMAX_CLAMP.value),
        nvfp4_rule=policy_value(policies, "nvfp4_rule", Nvfp4ScaleRule.RECIP_MUL.value),
        layout=policy_value(policies, "v41_layout", V41Layout.INTERLEAVED.value),
        arith=policy_value(policies, "rope_arith", RopeArithmetic.FMA_TRITON.value))


def _expected(case: Case, policies: dict) -> dict:
    inp = case.inputs
    res = cv41.v41_save_compress(inp["kv_score"], inp["positions"], inp["state_cache"], inp["state_slots"],
                                 inp["query_start_loc"], inp["token_to_req_indices"], inp["norm_weight"],
                                 inp["eps"], inp["compress_ratio"])
    T = inp["state_slots"].shape[0]
    latent = torch.zeros((inp["kv_score"].shape[0], inp["kv_score"].shape[1] // inp["compress_ratio"]),
                         dtype=torch.bfloat16)
    latent[res.tokens] = res.latent
    out = {"latent": latent, "cache": v41_compress_expected_cache(case, latent, policies),
           "_tokens": res.tokens, "_normed": res.normed,
           "_bound": window_error_bound(res.kv, res.score, torch.ones(res.kv.shape[:2], dtype=torch.bool),
                                        inp["norm_weight"].cpu(), inp["eps"], res.normed),
           "_n_tokens": T}
    if res.state is not None:
        out["state"] = res.state
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    if t.dtype in (torch.float32,):
        return t.view(torch.int32)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _judge(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    for key in ("latent", "cache") + (("state",) if "state" in expected else ()):
        if key not in got:
            return Verdict(False, f"{key}:missing", f"the kernel returned no {key!r} (got {sorted(got)})", headroom=0.0)
    details: dict = {}
    if "state" in expected:
        gs, ws = _bits(got["state"]), _bits(expected["state"])
        if tuple(gs.shape) != tuple(ws.shape) or not torch.equal(gs, ws):
            diff = (gs != ws).reshape(ws.shape[0] * ws.shape[1], -1).any(1).nonzero().flatten().tolist() \
                if gs.shape == ws.shape else "shape"
            return Verdict(False, "state:bit_exact", f"ring rows differ from the reference's (flat ring rows {diff})",
                           headroom=0.0, details={"ring_rows_differing": diff})
    tok = expected["_tokens"]
    gl = got["latent"].detach().cpu()
    if gl.dtype != torch.bfloat16 or gl.dim() != 2 or (tok.numel() and gl.shape[0] <= int(tok.max())):
        return Verdict(False, "latent:shape", f"latent {gl.dtype} {tuple(gl.shape)}", headroom=0.0)
    g64 = gl[tok].to(torch.float64)
    w64 = expected["_normed"].to(torch.float64)
    bound = expected["_bound"] + ulp_bf16(torch.maximum(g64.abs(), w64.abs()))
    err = (g64 - w64).abs()
    ratio = torch.nan_to_num(err / bound, nan=math.inf)
    worst = float(ratio.max()) if ratio.numel() else 0.0
    details.update(latents=int(tok.numel()), latent_over_bound=worst,
                   latent_bit_identical_rows=int((_bits(gl[tok]) == _bits(expected["latent"][tok])).all(1).sum()))
    if bool(((err > bound) | (ratio > 1.0)).any()):
        i = ((err > bound) | (ratio > 1.0)).nonzero()[0].tolist()
        return Verdict(False, "latent:compressor_tier",
                       f"{int(((err > bound) | (ratio > 1.0)).sum())} latent elements beyond the tier, first token "
                       f"{int(tok[i[0]])} dim {i[1]}: got {float(g64[i[0], i[1]])} want {float(w64[i[0], i[1]])} "
                       f"bound {float(bound[i[0], i[1]])}", headroom=1.0 / worst if worst else math.inf, details=details)
    want_cache = v41_compress_expected_cache(case, gl, scope.policies)
    gc, wc = _bits(got["cache"]), _bits(want_cache)
    if tuple(gc.shape) != tuple(wc.shape) or not torch.equal(gc, wc):
        n = int((gc != wc).sum()) if gc.shape == wc.shape else -1
        ref_cache_same = gc.shape == _bits(expected["cache"]).shape and torch.equal(gc, _bits(expected["cache"]))
        return Verdict(False, "cache:bit_exact_from_latent",
                       f"{n} cache elements differ from rope_quant_insert of the kernel's own latent under "
                       f"{ {k: scope.policies.get(k) for k in V41_COMPRESS_DEFAULTS} }"
                       + (" (it equals the reference latent's cache)" if ref_cache_same else ""),
                       headroom=0.0, details=details)
    exact = details["latent_bit_identical_rows"] == int(tok.numel())
    return Verdict(True, "bit_exact" if exact else "latent:compressor_tier", "", worst_ulps=None,
                   headroom=1.0 / worst if worst else math.inf, details=details)


register(StageSpec(
    name="v41_compress_insert",
    kind="numeric",
    outputs=("latent", "cache"),
    defaults=dict(V41_COMPRESS_DEFAULTS),
    expected=_expected,
    judge=_judge,
    doc="DeepSeek-V4.1 fused compressor (fused_save_compress_norm + rope_quant_insert): ring state "
        "bit-exact, bf16 latent by the compressor tier (H7), records bit-exact from the latent"))
