"""The float64 DSv4 sparse-attention oracle (attention.md sections 2, 4.1, 7).

One query token ``t``, head ``h``: a single softmax over the union of the *valid* slots of all
segments (decode: ``[SWA, compressed]``; prefill: one combined segment), plus a per-head sink:

    s_j   = scale * <q[t,h], K_j>                      (natural-log units)
    m     = max_j s_j,   L = sum_j exp(s_j - m),   lse = m + ln L      (sink NOT included)
    O     = sum_j exp(s_j - lse) * V_j,   V_j = K_j[:d_v]   (V includes the RoPE dims)
    out   = O * f,   f = 1 / (1 + exp(sink[h] - lse))      (= sigmoid(lse - sink))

Conventions (attention 7 "Conventions" 1-6, 2.3, 2.4, 2.7)
1. Validity of column ``c`` of segment ``s`` for token ``t``: ``c < length_s[t]`` and the index
   is in ``[0, N_s)`` (``N_s`` = rows of the segment). Under ``IndexRule.MINUS1_ONLY``
   (FlashMLA decode, trtllm-gen) only ``-1`` marks an invalid slot inside the prefix; any other
   out-of-range value there is a *generator error* and raises ``InputError`` (naming segment,
   token, column and value). Columns at or after the length are never read (may hold garbage).
   Rows are gathered with clamped indices and invalid rows are **zeroed before any
   arithmetic**, so NaN/Inf in unreferenced rows can never reach a result.
2. NaN in a *valid* row: ``NanPolicy.PROPAGATE`` (FlashMLA) lets it flow (the logit is NaN, so
   the row max, ``lse`` and every output element of that (token, head) are NaN);
   ``NanPolicy.SCRUB`` (ROCm Triton, ``k == k ? k : 0``) replaces each NaN element of a valid
   gathered row by 0 first (Inf is kept).
3. Lonely query (no valid slot in any segment): ``out = 0`` exactly (for any sink),
   ``lse = max_logits = -inf``, ``lse_with_sink = sink`` (``-inf`` without a sink).
4. Sink: ``-inf`` -> ``f = 1`` (no effect); ``+inf`` -> ``f = 0``, output 0 (NaN stays NaN);
   sink None = no sink. ``lse`` stays sink-free; ``lse_with_sink = logaddexp(lse, sink)``
   (the SM120 quantity before the base-2 conversion).
5. Duplicate indices are distinct slots: a key listed twice is counted twice.
6. ``mode=AttentionMode.BF16_P`` emulates the bf16 kernels' rounding (attention 4.1, 7 conv. 6):
   ``p = exp(s - m)`` is rounded fp32 -> bf16 (RNE) for the numerator ``sum p_bf16 * V``; the
   denominator is ``sum fl32(p) + exp(sink - m)`` (unrounded fp32 P, the kernels' row sum and
   sink term); the output is rounded once, float64 -> fp32 -> bf16. Logits stay exact
   (the kernels' fp32-accumulated bf16 MMA is not modelled). ``lse = m + ln(sum fl32(p))``.
   ``bf16_p_error_bound`` gives a rigorous elementwise bound on ``|bf16_p - exact|``.

Determinism (identical bits on CPU and GPU, run to run). Every value that defines bits is
computed by IEEE float64 ``+ - * /`` (correctly rounded on every device; separate eager ops, so
no FMA contraction, except one ``addcmul_`` per loop step where the product is exact,
``exact_product``, which gives the same sum fused or not), exact operations (gather, ``where``, ``max``, comparisons, integer bit
logic, conversions) and ``detmath.det_exp``/``det_log`` (built from the same primitives), in a
*fixed order*: the logit dot products are accumulated sequentially over ``d = 0 .. D-1`` with an
elementwise multiply then add on ``[chunk, H, K]`` tensors; the row sum and ``P @ V`` are
accumulated sequentially over the slot axis ``k = 0 .. K-1`` (segments in list order).
No ``matmul``/``einsum``/``bmm``/``sum`` (whose reduction order depends on the device and BLAS)
touches a result bit, and no tensor is divided by a Python scalar (PyTorch's CUDA kernel computes
``tensor / scalar`` as ``tensor * (1/scalar)``, which the CPU does not; all divisions here are
tensor by tensor). An installed loop backend (``set_loop_backend``; the judge's Triton one,
``oracles.ordered_loops``) runs the three loops in one launch each with the same operations in the
same order. Verified bit-identical CPU vs H200 by ``tests/attention/test_gpu.py``. Each token's result depends only on that token's inputs, so chunking and
batch permutation give bit-identical per-token results. (Assumes denormals are not flushed,
torch's default: ``torch.set_flush_denormal(True)`` would change tiny values on the CPU.)

Memory: tokens are processed in chunks of ``chunk_tokens``; ``peak_bytes_estimate`` is the
bound on the oracle's simultaneously live tensors per chunk (formula in its docstring). The
gathered rows are per token, not per head: ``[chunk, K, D]`` float64. ``chunk_tokens=None``
picks the largest chunk whose estimate fits ``DEFAULT_BUDGET_BYTES`` (256 MiB), and on the CPU
at most what keeps one ``[chunk, H, K]`` logit tensor near ``CPU_CHUNK_TARGET_BYTES`` (speed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..constants import HEAD_DIM
from ..detmath import det_exp, det_log, det_log1p_exp_neg
from ..errors import INDEX_DTYPES, check_dtype, check_enum, check_int, check_tensor, fail
from ..policies import AttentionMode, IndexRule, NanPolicy

__all__ = [
    "Segment",
    "OracleOut",
    "sparse_attention",
    "segment_validity",
    "bf16_p_error_bound",
    "exact_product",
    "set_loop_backend",
    "loop_backend",
    "peak_bytes_estimate",
    "auto_chunk_tokens",
    "lse_to_flashmla",
    "lse_to_sm120",
    "logaddexp",
    "DEFAULT_BUDGET_BYTES",
    "CPU_CHUNK_TARGET_BYTES",
]

DEFAULT_BUDGET_BYTES = 256 * 2**20
# CPU speed heuristic (never affects bits): keep one [chunk, H, K] float64 logit tensor within
# about this many bytes so the d-loop's operands stay in cache.
CPU_CHUNK_TARGET_BYTES = 2 * 2**20
_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
_LOG2E = 1.0 / math.log(2.0)


@dataclass(frozen=True)
class Segment:
    """One list of key slots per token (attention 5 "Abstract call").

    rows:   ``[N, D]`` exact dequantised K/V rows (any float dtype; converted to float64
            exactly), in the index space the kernel uses (slot = block * block_size + offset).
    idx:    ``[T, K]`` int32/int64 indices into ``rows``; ``-1`` = empty.
    length: ``[T]`` int prefix length (columns ``>= length[t]`` are ignored), or None = K.
    rule:   which index values are invalid (``IndexRule``; see module docstring, conv. 1).
    """

    rows: torch.Tensor
    idx: torch.Tensor
    length: torch.Tensor | None = None
    rule: IndexRule = IndexRule.ANY_OUT_OF_RANGE_INVALID


@dataclass(frozen=True)
class OracleOut:
    """Oracle result. All float64 on the device of ``q``; ``n_valid`` int32.

    out:           ``[T, H, d_v]`` sink applied; exact zeros for lonely rows.
    lse:           ``[T, H]`` natural log, sink-free; ``-inf`` for lonely rows.
    lse_with_sink: ``[T, H]`` ``logaddexp(lse, sink)``; equals ``lse`` when ``sink`` is None.
    max_logits:    ``[T, H]`` max scaled logit; ``-inf`` for lonely rows.
    n_valid:       ``[T]`` number of valid slots (duplicates counted), all segments.
    """

    out: torch.Tensor
    lse: torch.Tensor
    lse_with_sink: torch.Tensor
    max_logits: torch.Tensor
    n_valid: torch.Tensor

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {"out": self.out, "lse": self.lse, "lse_with_sink": self.lse_with_sink,
                "max_logits": self.max_logits, "n_valid": self.n_valid}


# --------------------------------------------------------------------------- validation
@dataclass
class _Seg:
    rows: torch.Tensor  # original dtype [N, D]
    idx: torch.Tensor  # int64 [T, K]
    valid: torch.Tensor  # bool [T, K]


def _check_segment_host(fn: str, si: int, seg: object, T: int, D: int, device: torch.device) -> IndexRule:
    """The checks of one segment that need no device value (type, dtypes, shapes, devices, rule)."""
    a = f"segments[{si}]"
    if not isinstance(seg, Segment):
        fail(fn, a, "must be a Segment", type(seg).__name__)
    check_dtype(fn, f"{a}.rows", seg.rows, _FLOATS)
    if seg.rows.dim() != 2 or seg.rows.shape[1] != D:
        fail(fn, f"{a}.rows", f"must have shape [N, {D}] (D of q)", f"shape {tuple(seg.rows.shape)}")
    check_dtype(fn, f"{a}.idx", seg.idx, INDEX_DTYPES)
    if seg.idx.dim() != 2 or seg.idx.shape[0] != T:
        fail(fn, f"{a}.idx", f"must have shape [T={T}, K]", f"shape {tuple(seg.idx.shape)}")
    rule = check_enum(fn, f"{a}.rule", IndexRule, seg.rule)
    for name, t in ((f"{a}.rows", seg.rows), (f"{a}.idx", seg.idx)):
        if t.device != device:
            fail(fn, name, f"must be on the device of q ({device})", str(t.device))
    if seg.length is not None:
        check_dtype(fn, f"{a}.length", seg.length, INDEX_DTYPES)
        if tuple(seg.length.shape) != (T,):
            fail(fn, f"{a}.length", f"must have shape [T={T}]", f"shape {tuple(seg.length.shape)}")
        if seg.length.device != device:
            fail(fn, f"{a}.length", f"must be on the device of q ({device})", str(seg.length.device))
    return rule


def _check_segment_list(fn: str, segments: object) -> None:
    if not isinstance(segments, (list, tuple)) or len(segments) == 0:
        fail(fn, "segments", "must be a non-empty list of Segment", type(segments).__name__)


def _prepare_segments(fn: str, segments: object, T: int, D: int, device: torch.device) -> list[_Seg]:
    _check_segment_list(fn, segments)
    out = []
    for si, seg in enumerate(segments):
        a = f"segments[{si}]"
        rule = _check_segment_host(fn, si, seg, T, D, device)
        K = seg.idx.shape[1]
        idx = seg.idx.to(torch.int64)
        col = torch.arange(K, device=device)
        if seg.length is None:
            in_prefix = torch.ones(T, K, dtype=torch.bool, device=device)
        else:
            ln = seg.length.to(torch.int64)
            if T and (int(ln.min()) < 0 or int(ln.max()) > K):
                fail(fn, f"{a}.length", f"must lie in [0, K={K}]", f"range [{int(ln.min())}, {int(ln.max())}]")
            in_prefix = col[None, :] < ln[:, None]
        N = seg.rows.shape[0]
        in_range = (idx >= 0) & (idx < N)
        if rule == IndexRule.MINUS1_ONLY:
            bad = in_prefix & ~in_range & (idx != -1)
            if bool(bad.any()):
                t, c = (int(v) for v in bad.nonzero()[0])
                fail(fn, f"{a}.idx", "under IndexRule.MINUS1_ONLY may hold only -1 or an index in "
                     f"[0, N={N}) inside the length prefix (a generator error)",
                     f"token {t}, column {c}: {int(idx[t, c])}")
        out.append(_Seg(seg.rows, idx, in_prefix & in_range))
    return out


def _check_scale(fn: str, scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        fail(fn, "scale", "must be a finite number > 0", scale)
    return float(scale)


def _check_sink_host(fn: str, sink: object, H: int, device: torch.device) -> None:
    """The sink's dtype, shape and device (no device value read)."""
    check_dtype(fn, "sink", sink, _FLOATS)
    if tuple(sink.shape) != (H,):
        fail(fn, "sink", f"must have shape [H={H}]", f"shape {tuple(sink.shape)}")
    if sink.device != device:
        fail(fn, "sink", f"must be on the device of q ({device})", str(sink.device))


def _check_sink(fn: str, sink: object, H: int, device: torch.device) -> torch.Tensor | None:
    if sink is None:
        return None
    _check_sink_host(fn, sink, H, device)
    if bool(torch.isnan(sink).any()):
        fail(fn, "sink", "must not contain NaN (+-inf are allowed)")
    return sink.to(torch.float64)


def _check_q(fn: str, q: object) -> tuple[int, int, int]:
    check_dtype(fn, "q", q, _FLOATS)
    if q.dim() != 3:
        fail(fn, "q", "must have shape [T, H, D]", f"shape {tuple(q.shape)}")
    T, H, D = q.shape
    if H < 1 or D < 1:
        fail(fn, "q", "must have H >= 1 and D >= 1", f"shape {tuple(q.shape)}")
    return T, H, D


def _check_dv_chunk(fn: str, d_v: object, D: int, chunk_tokens: object) -> int:
    """``d_v`` (None: ``D``) in ``[1, D]`` and ``chunk_tokens`` (None or >= 1); returns ``d_v``."""
    if d_v is None:
        d_v = D
    check_int(fn, "d_v", d_v, minimum=1)
    if d_v > D:
        fail(fn, "d_v", f"must be <= D={D}", d_v)
    if chunk_tokens is not None:
        check_int(fn, "chunk_tokens", chunk_tokens, minimum=1)
    return d_v


def check_common(fn: str, q: object, segments: object, scale: object, sink: object, d_v: object,
                  chunk_tokens: object):
    T, H, D = _check_q(fn, q)
    segs = _prepare_segments(fn, segments, T, D, q.device)
    sc = _check_scale(fn, scale)
    sk = _check_sink(fn, sink, H, q.device)
    d_v = _check_dv_chunk(fn, d_v, D, chunk_tokens)
    return T, H, D, segs, sc, sk, d_v


def check_host(fn: str, q: object, segments: object, scale: object, sink: object, d_v: object,
                chunk_tokens: object) -> tuple[int, int, int, list[IndexRule], float, int]:
    """Every check of ``check_common`` that reads no device value (types, dtypes, shapes, devices,
    rules, scale, sink shape, d_v, chunk_tokens), in the same order: ``(T, H, D, rules, scale,
    d_v)``. The value checks (lengths in [0, K], -1-only indices, a NaN sink) stay
    ``check_common``'s: a caller that defers them (``attention_fast``) calls ``check_common`` to
    raise the precise error."""
    T, H, D = _check_q(fn, q)
    _check_segment_list(fn, segments)
    rules = [_check_segment_host(fn, si, seg, T, D, q.device) for si, seg in enumerate(segments)]
    sc = _check_scale(fn, scale)
    if sink is not None:
        _check_sink_host(fn, sink, H, q.device)
    return T, H, D, rules, sc, _check_dv_chunk(fn, d_v, D, chunk_tokens)


def segment_validity(segments: list[Segment], num_tokens: int) -> torch.Tensor:
    """Validity mask ``[T, sum K_s]`` (bool) of the concatenated segments (convention 1).

    ``segments`` rows only need their first dimension (N); D is taken from the first segment.
    Raises ``InputError`` exactly as ``sparse_attention`` would.
    """
    fn = "segment_validity"
    check_int(fn, "num_tokens", num_tokens, minimum=0)
    if not isinstance(segments, (list, tuple)) or not segments or not isinstance(segments[0], Segment):
        fail(fn, "segments", "must be a non-empty list of Segment")
    check_tensor(fn, "segments[0].rows", segments[0].rows)
    D = segments[0].rows.shape[-1]
    segs = _prepare_segments(fn, segments, num_tokens, D, segments[0].rows.device)
    return torch.cat([s.valid for s in segs], dim=1)


# --------------------------------------------------------------------------- memory
def peak_bytes_estimate(chunk_tokens: int, num_heads: int, total_topk: int, head_dim: int = HEAD_DIM,
                        d_v: int = HEAD_DIM, rows_itemsize: int = 2) -> int:
    """Upper estimate (bytes) of the oracle's live tensors while processing one chunk.

    With ``c = chunk_tokens``, ``H = num_heads``, ``K = total_topk`` (all segments), ``D =
    head_dim``, ``b = rows_itemsize`` (2 for bf16 rows):

        c * ( K*D*(b + 16)                gathered rows (source dtype + float64) and the
                                          transposed float64 copy for the logit loop
            + 7*H*K*8                     logits, product temp, masked logits, exp input,
                                          P, transposed P, rounded P (BF16_P / bound)
            + H*(2*D + 4*d_v)*8           q (float64 + transposed), accumulator, product temp,
                                          |V| accumulator and temp (bound only)
            + K*25 + H*64 )               indices, masks, per-row scalars

    Production decode (c=1, H=128, K=128+1024, D=d_v=512): 21.4 MiB per token, so the default
    256 MiB budget gives 11-token chunks; ``chunk_tokens=256`` would need ~5.4 GiB.
    """
    fn = "peak_bytes_estimate"
    for name, v in (("chunk_tokens", chunk_tokens), ("num_heads", num_heads), ("head_dim", head_dim),
                    ("d_v", d_v), ("rows_itemsize", rows_itemsize)):
        check_int(fn, name, v, minimum=1)
    check_int(fn, "total_topk", total_topk, minimum=0)
    c, H, K, D = chunk_tokens, num_heads, total_topk, head_dim
    return c * (K * D * (rows_itemsize + 16) + 7 * H * K * 8 + H * (2 * D + 4 * d_v) * 8 + K * 25 + H * 64)


def auto_chunk_tokens(num_heads: int, total_topk: int, head_dim: int = HEAD_DIM, d_v: int = HEAD_DIM,
                      rows_itemsize: int = 2, budget_bytes: int = DEFAULT_BUDGET_BYTES,
                      device: torch.device | str | None = None) -> int:
    """Largest chunk (>= 1) whose ``peak_bytes_estimate`` fits ``budget_bytes``; on a CPU
    ``device`` additionally at most ``CPU_CHUNK_TARGET_BYTES // (8 H K)`` tokens (a cache-locality
    heuristic: the logit loop is memory-bound). Chunking never changes a result bit."""
    check_int("auto_chunk_tokens", "budget_bytes", budget_bytes, minimum=1)
    per = peak_bytes_estimate(1, num_heads, total_topk, head_dim, d_v, rows_itemsize)
    c = max(1, budget_bytes // per)
    if device is not None and torch.device(device).type == "cpu":
        c = min(c, max(1, CPU_CHUNK_TARGET_BYTES // max(1, 8 * num_heads * total_topk)))
    return c


# --------------------------------------------------------------------------- core
def logaddexp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Deterministic float64 ``log(exp(a) + exp(b))`` with exact handling of +-inf; NaN propagates."""
    hi = torch.maximum(a, b)
    lo = torch.minimum(a, b)
    d = hi - lo
    res = hi + det_log1p_exp_neg(torch.where(torch.isfinite(d), d, torch.zeros_like(d)))
    res = torch.where(lo == -math.inf, hi, res)
    res = torch.where(hi == math.inf, hi, res)
    return torch.where(torch.isnan(a) | torch.isnan(b), torch.full_like(res, math.nan), res)


# ----------------------------------------------------------------------------- loop backend
# The three fixed-order loops below (``scaled_logits``, ``seq_sum_last``, ``seq_pv``) issue one or two
# device operations per step: thousands per call, bound by the host's launch cost on a GPU. A
# backend that runs a loop in one launch with the same per-element order and the same IEEE
# operations may be installed (``set_loop_backend``; the judge installs a Triton one for CUDA
# tensors, ``oracles.ordered_loops``); it must give these functions' bits (its tests compare them on
# adversarial values). ``backend(name, *args)`` returns the result, or None to leave the call to the
# PyTorch loop. None (the default) keeps every loop in PyTorch.
_LOOP_BACKEND = None


def set_loop_backend(backend) -> None:
    """Install ``backend`` (``callable(name, *args) -> Tensor | None``; ``name`` one of
    ``"scaled_logits"``, ``"seq_sum_last"``, ``"seq_pv"`` with those functions' arguments, the
    ``scale`` of ``scaled_logits`` excluded: the backend returns the unscaled accumulator) or remove
    it (None)."""
    global _LOOP_BACKEND
    _LOOP_BACKEND = backend


def loop_backend():
    """The installed loop backend (None: the PyTorch loops)."""
    return _LOOP_BACKEND


def seq_sum_last(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis in the fixed order k = 0, 1, ... (x: [c, H, K] float64; the
    accumulator has x's dtype, so float32 input gives an fp32 chain: ``oracles/derive.py``)."""
    if _LOOP_BACKEND is not None:
        out = _LOOP_BACKEND("seq_sum_last", x)
        if out is not None:
            return out
    xt = x.permute(2, 0, 1).contiguous()
    acc = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    for k in range(xt.shape[0]):
        acc.add_(xt[k])
    return acc


def exact_product(a: torch.dtype, b: torch.dtype) -> bool:
    """True when the float64 product of any value of dtype ``a`` and any value of dtype ``b`` is
    exact: both are floating dtypes narrower than float64 (so no product leaves float64's exponent
    range: ``|x y| >= 2**-298`` or 0, ``< 2**256``) whose significands, implicit bit included
    (``1 - log2(finfo.eps)``: bfloat16 8, float16 11, float32 24, the FP8 formats 3-4), hold at most
    53 bits together. Where it holds, a multiply-add ``acc + x y`` is the same number whether the
    product is rounded first or fused into one FMA (the product rounds to itself), so the fixed-order
    loops may issue one ``addcmul_`` instead of a multiply and an add with identical bits on every
    device."""
    def bits(dt: torch.dtype) -> int:
        return 1 - int(round(math.log2(torch.finfo(dt).eps)))

    return (a.is_floating_point and b.is_floating_point and torch.float64 not in (a, b)
            and bits(a) + bits(b) <= 53)


def seq_pv(p: torch.Tensor, v: torch.Tensor, exact_products: bool = False) -> torch.Tensor:
    """``sum_k p[:, :, k, None] * v[:, k, None, :]`` in the fixed order k = 0, 1, ...

    p: [c, H, K] float64; v: [c, K, dv] float64 -> [c, H, dv] (both float32: each product is
    rounded to fp32, then added to an fp32 accumulator; ``oracles/derive.py``).
    ``exact_products``: the caller knows every ``p v`` product is exact in p's dtype (``p`` and ``v``
    hold values of dtypes for which ``exact_product`` holds): each step is then one ``addcmul_``
    (the same bits, half the launches and memory traffic)."""
    if _LOOP_BACKEND is not None:
        out = _LOOP_BACKEND("seq_pv", p, v, exact_products)
        if out is not None:
            return out
    c, H, K = p.shape
    dv = v.shape[2]
    pt = p.permute(2, 0, 1).contiguous()  # [K, c, H]
    acc = torch.zeros(c, H, dv, dtype=p.dtype, device=p.device)
    if exact_products:
        for k in range(K):
            acc.addcmul_(pt[k].unsqueeze(2), v[:, k].unsqueeze(1))
        return acc
    tmp = torch.empty_like(acc)
    for k in range(K):
        torch.mul(pt[k].unsqueeze(2), v[:, k].unsqueeze(1), out=tmp)
        acc.add_(tmp)
    return acc


def _gather(segs: list[_Seg], t0: int, t1: int, nan_policy: NanPolicy) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered float64 rows [c, K, D] (invalid rows zeroed) and validity [c, K]."""
    gs, vs = [], []
    for s in segs:
        idx = s.idx[t0:t1]
        valid = s.valid[t0:t1]
        c, K = idx.shape
        N, D = s.rows.shape
        if N == 0 or K == 0:
            g = torch.zeros(c, K, D, dtype=torch.float64, device=idx.device)
        else:
            safe = idx.clamp(0, N - 1).reshape(-1)
            g = s.rows.index_select(0, safe).reshape(c, K, D).to(torch.float64)
            g.masked_fill_(~valid.unsqueeze(-1), 0.0)  # zero invalid rows before any arithmetic
            if nan_policy == NanPolicy.SCRUB:
                g.masked_fill_(torch.isnan(g), 0.0)
        gs.append(g)
        vs.append(valid)
    return torch.cat(gs, dim=1), torch.cat(vs, dim=1)


def scaled_logits(qc: torch.Tensor, g: torch.Tensor, scale: float, exact_products: bool = False) -> torch.Tensor:
    """``scale * <q, K>`` with the dot product accumulated over d = 0..D-1 in order.
    qc [c, H, D], g [c, K, D] (float64) -> [c, H, K] (float32 operands: an fp32 chain,
    ``oracles/derive.py``). ``exact_products``: every ``q_d k_d`` is exact in qc's dtype (q and the
    rows come from dtypes for which ``exact_product`` holds): one ``addcmul_`` per step, the same bits."""
    if _LOOP_BACKEND is not None:
        out = _LOOP_BACKEND("scaled_logits", qc, g, exact_products)
        if out is not None:
            return out.mul_(scale)
    c, H, D = qc.shape
    K = g.shape[1]
    qt = qc.permute(2, 0, 1).contiguous()  # [D, c, H]
    gt = g.permute(2, 0, 1).contiguous()  # [D, c, K]
    acc = torch.zeros(c, H, K, dtype=qc.dtype, device=qc.device)
    if exact_products:
        for d in range(D):
            acc.addcmul_(qt[d].unsqueeze(2), gt[d].unsqueeze(1))
        return acc.mul_(scale)
    tmp = torch.empty_like(acc)
    for d in range(D):
        torch.mul(qt[d].unsqueeze(2), gt[d].unsqueeze(1), out=tmp)
        acc.add_(tmp)
    return acc.mul_(scale)


def _attend_chunk(qc, g, valid, scale, sink, d_v, mode, want_abs=False, exact_qk=False, exact_pv=False):
    c, H, _ = qc.shape
    dev = qc.device
    n_valid = valid.sum(dim=1)  # [c]
    has = (n_valid > 0).unsqueeze(1)  # [c, 1]
    ninf = torch.full((c, H), -math.inf, dtype=torch.float64, device=dev)
    if g.shape[1] == 0:
        zero = torch.zeros(c, H, d_v, dtype=torch.float64, device=dev)
        lws = ninf if sink is None else sink.unsqueeze(0).expand(c, H).clone()
        extra = (zero,) if want_abs else ()
        return (zero, ninf, lws, ninf.clone(), n_valid) + extra
    s = scaled_logits(qc, g, scale, exact_products=exact_qk)
    vmask = valid.unsqueeze(1)  # [c, 1, K]
    s = torch.where(vmask, s, torch.full_like(s, -math.inf))
    m = s.amax(dim=2) + 0.0  # [c, H]; +0.0 turns a -0 max into +0
    diff = torch.where(vmask, s - m.unsqueeze(2), torch.full_like(s, -math.inf))
    del s
    p = det_exp(diff)  # exactly 0 on invalid slots
    del diff
    v = g[:, :, :d_v]
    extra = ()
    if mode == AttentionMode.EXACT:
        L = seq_sum_last(p)
        O = seq_pv(p, v) / L.unsqueeze(2)
        lse = m + det_log(L)
        if sink is None:
            out = O
        else:
            f = 1.0 / (1.0 + det_exp(sink.unsqueeze(0) - lse))
            out = O * f.unsqueeze(2)
        if want_abs:
            extra = (seq_pv(p, v.abs()) / L.unsqueeze(2),)
    else:  # BF16_P
        p32 = p.to(torch.float32)
        L = seq_sum_last(p32.to(torch.float64))
        num = seq_pv(p32.to(torch.bfloat16).to(torch.float64), v, exact_products=exact_pv)
        lse = m + det_log(L)
        den = L if sink is None else L + det_exp(sink.unsqueeze(0) - m)
        out = (num / den.unsqueeze(2)).to(torch.float32).to(torch.bfloat16).to(torch.float64)
    zero3 = torch.zeros_like(out)
    out = torch.where(has.unsqueeze(2), out, zero3)
    lse = torch.where(has, lse, ninf)
    m = torch.where(has, m, ninf)
    lws = lse if sink is None else logaddexp(lse, sink.unsqueeze(0).expand(c, H))
    extra = tuple(torch.where(has.unsqueeze(2), e, zero3) for e in extra)
    return (out, lse, lws, m, n_valid) + extra


def run_ordered(fn, q, segments, scale, sink, d_v, mode, nan_policy, chunk_tokens, want_abs):
    T, H, D, segs, sc, sk, d_v = check_common(fn, q, segments, scale, sink, d_v, chunk_tokens)
    mode = check_enum(fn, "mode", AttentionMode, mode)
    nan_policy = check_enum(fn, "nan_policy", NanPolicy, nan_policy)
    K = sum(s.idx.shape[1] for s in segs)
    if chunk_tokens is None:
        itemsize = max(s.rows.element_size() for s in segs)
        chunk_tokens = auto_chunk_tokens(H, K, D, d_v, itemsize, device=q.device)
    # one multiply-add per step where every product is exact (``exact_product``): q times a row
    # value in the logit loop, bf16 P times a row value in the BF16_P numerator
    rdts = {s.rows.dtype for s in segs}
    exact_qk = all(exact_product(q.dtype, dt) for dt in rdts)
    exact_pv = mode == AttentionMode.BF16_P and all(exact_product(torch.bfloat16, dt) for dt in rdts)
    parts = []
    for t0 in range(0, T, chunk_tokens):
        t1 = min(T, t0 + chunk_tokens)
        g, valid = _gather(segs, t0, t1, nan_policy)
        qc = q[t0:t1].to(torch.float64)
        parts.append(_attend_chunk(qc, g, valid, sc, sk, d_v, mode, want_abs, exact_qk, exact_pv))
        del g, valid
    if not parts:  # T == 0
        dev = q.device
        e2 = torch.empty(0, H, dtype=torch.float64, device=dev)
        e3 = torch.empty(0, H, d_v, dtype=torch.float64, device=dev)
        n = torch.empty(0, dtype=torch.int64, device=dev)
        parts = [(e3, e2, e2, e2, n) + ((e3,) if want_abs else ())]
    cols = [torch.cat([p[i] for p in parts], dim=0) for i in range(len(parts[0]))]
    cols[4] = cols[4].to(torch.int32)
    return cols


def sparse_attention(q: torch.Tensor, segments: list[Segment], scale: float, sink: torch.Tensor | None = None,
                     d_v: int | None = None, mode: AttentionMode | str = AttentionMode.EXACT,
                     nan_policy: NanPolicy | str = NanPolicy.PROPAGATE,
                     chunk_tokens: int | None = None) -> OracleOut:
    """The DSv4 sparse-attention oracle (module docstring: semantics, determinism, memory).

    q:            ``[T, H, D]`` any float dtype (converted to float64 exactly); D = 512 for DSv4.
    segments:     ordered list of ``Segment`` (decode: ``[SWA, compressed]``; prefill: one).
    scale:        softmax scale (> 0, finite; DSv4 ``512**-0.5``); the sink is not scaled.
    sink:         ``[H]`` float (natural-logit units, +-inf allowed, NaN rejected) or None.
    d_v:          value width (first ``d_v`` dims of each row); None = D (DSv4: 512, the full
                  row, RoPE dims included).
    mode:         ``AttentionMode.EXACT`` (float64) or ``BF16_P`` (bf16-kernel emulation).
    nan_policy:   NaN in a valid row: ``PROPAGATE`` or ``SCRUB``.
    chunk_tokens: tokens per chunk (None: auto, see ``peak_bytes_estimate``); results are
                  bit-identical for every chunk size.
    """
    out, lse, lws, m, n = run_ordered("sparse_attention", q, segments, scale, sink, d_v, mode, nan_policy,
                               chunk_tokens, want_abs=False)
    return OracleOut(out, lse, lws, m, n)


def bf16_p_error_bound(q: torch.Tensor, segments: list[Segment], scale: float,
                       sink: torch.Tensor | None = None, d_v: int | None = None,
                       nan_policy: NanPolicy | str = NanPolicy.PROPAGATE,
                       chunk_tokens: int | None = None) -> torch.Tensor:
    """Elementwise bound ``[T, H, d_v]`` (float64) on ``|out_bf16_p - out_exact|``.

    Derivation (per token, head, output dim; ``p_k = exp(s_k - m)`` exact, ``L = sum p_k``,
    ``S = exp(sink - m)`` (0 without sink), ``f = L / (L + S)``, ``A = sum_k (p_k / L) |v_k|``
    the softmax-weighted mean of ``|V|``; ``u_b = 2**-8`` (bf16 unit roundoff: 8 significant bits), ``u_f = 2**-24``, ``eta = 2**-133``):
    - ``pb_k = bf16(fl32(p_k))``: ``|pb_k - p_k| <= (u_b + u_f + u_b u_f) p_k + eta`` (two RNE
      roundings; ``eta`` covers the bf16/fp32 subnormal range, ``p_k <= 1``).
    - ``L~ = sum fl32(p_k)`` (float64 sum): ``|L~ - L| <= (u_f + K 2**-53) L``; the same bounds
      the denominators ``L~ + S`` vs ``L + S``.
    - Numerator ``N~ = sum pb_k v_k`` vs ``N = sum p_k v_k``:
      ``|N~ - N| <= u1 L A + K eta max|v| + K 2**-53 L A(1+u1)`` with ``u1 = u_b + u_f + u_b u_f``.
    - ``|N~/(L~+S) - N/(L+S)| <= (|N~ - N| + |N| e_L) / ((L+S)(1 - e_L))``, ``e_L = u_f + K 2**-53``,
      and ``|N| <= L A``, so with ``f = L/(L+S)``:  ``E1 = f A (u1 + e_L + K 2**-53 (1+u1)) /
      (1 - e_L) + K eta max|v| / (L + S)`` (``L >= 1`` because the max term is 1).
    - Final rounding (fp32 then bf16 of ``y = N~/(L~+S)``): ``<= (u_f + u_b + u_f u_b) |y| + eta``
      with ``|y| <= |exact| + E1``.
    Result: ``E1 + (u_b + u_f + u_b u_f)(|exact| + E1) + eta`` plus the exact mode's own float64
    error (``<= 64 (K + D) 2**-53 (A + |exact|)``, a generous allowance). Lonely rows: 0.
    Rows with non-finite values: NaN (no bound).
    """
    fn = "bf16_p_error_bound"
    out, lse, _, _, n, A = run_ordered(fn, q, segments, scale, sink, d_v, AttentionMode.EXACT, nan_policy,
                                chunk_tokens, want_abs=True)
    T, H, D = q.shape
    d_v = out.shape[2]
    K = sum(s.idx.shape[1] for s in segments)
    ub, uf, eta = 2.0**-8, 2.0**-24, 2.0**-133
    u1 = ub + uf + ub * uf
    eL = uf + K * 2.0**-53
    # the subnormal term K*eta*max|v_k|/(L+S) is bounded with L+S >= 1 and max over ALL rows
    vmax = max((s.rows[:, :d_v].to(torch.float64).abs().nan_to_num(nan=0.0).amax().item()
                if s.rows.numel() else 0.0) for s in segments)
    if sink is None:
        f = torch.ones_like(lse)
    else:
        f = 1.0 / (1.0 + det_exp(sink.to(torch.float64).unsqueeze(0) - lse))
    f3 = f.unsqueeze(2)
    # multiply by a Python-computed reciprocal: CUDA evaluates tensor / scalar as tensor * (1/scalar)
    E1 = f3 * A * ((u1 + eL + K * 2.0**-53 * (1 + u1)) / (1 - eL)) + K * eta * vmax
    bound = E1 + u1 * (out.abs() + E1) + eta + 64 * (K + D) * 2.0**-53 * (A + out.abs())
    lonely = (n == 0).view(T, 1, 1)
    return torch.where(lonely, torch.zeros_like(bound), bound)


# --------------------------------------------------------------------------- LSE adapters
def lse_to_flashmla(lse: torch.Tensor) -> torch.Tensor:
    """Oracle ``lse`` (natural, sink-free, ``-inf`` lonely) -> FlashMLA's convention: natural,
    sink-free, ``+inf`` for a query with no valid key (attention 2.2, H1). Same shape/dtype."""
    check_dtype("lse_to_flashmla", "lse", lse, (torch.float64, torch.float32))
    return torch.where(lse == -math.inf, torch.full_like(lse, math.inf), lse)


def lse_to_sm120(lse_with_sink: torch.Tensor, lse_scale: float | None = None) -> torch.Tensor:
    """Oracle ``lse_with_sink`` -> FlashInfer SM120's LSE: ``lse_with_sink * log2(e) * lse_scale``
    (default ``lse_scale`` 1: base 2; ``lse_scale = ln 2`` gives natural units; attention 2.2,
    7 "Adapters"). Lonely rows: ``-inf`` without a sink, ``sink * log2(e) * lse_scale`` with a
    finite sink (already so in ``lse_with_sink``)."""
    fn = "lse_to_sm120"
    check_dtype(fn, "lse_with_sink", lse_with_sink, (torch.float64, torch.float32))
    if lse_scale is not None and (isinstance(lse_scale, bool) or not isinstance(lse_scale, (int, float))
                                  or not math.isfinite(lse_scale) or lse_scale <= 0):
        fail(fn, "lse_scale", "must be a finite number > 0 or None", lse_scale)
    x = lse_with_sink * _LOG2E
    return x if lse_scale is None else x * float(lse_scale)
