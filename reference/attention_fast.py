"""The fast judging oracle: the mathematics of ``attention.sparse_attention`` with unordered float64
GEMMs, and an a-priori bound on its distance from the ordered oracle, returned with the result.

``fast_sparse_attention(q, segments, scale, sink=None, d_v=None, nan_policy=..., chunk_tokens=None)
-> FastOracleOut``: the ``OracleOut`` fields (same conventions 1-5 of ``attention.py``: lonely rows
exactly 0 / ``-inf``, +-inf sinks, invalid rows zeroed before any arithmetic, NaN per
``NanPolicy``) plus ``bound``: per output (``out`` ``[T, H, d_v]``; ``lse``, ``lse_with_sink``,
``max_logits`` ``[T, H]``) an elementwise float64 ``B`` with ``|fast - ordered| <= B`` wherever the
output is finite; non-finite outputs are the same values in both modes (``B = 0`` there, as on
lonely rows). Not bit-identical across devices (cuBLAS/BLAS choose the reduction order); the
ordered oracle stays the fixture path. Only ``AttentionMode.EXACT`` is provided.

Derivation (per token t, head h; ``u = 2**-53``, ``g_n = n u / (1 - n u)``, valid slots only):

1. Logits ``s~ = fl(bmm(q, K^T) * scale)``. Each q*k product of a bf16 q and a K value that is an
   FP8 code times a power of two (NoPE) or bf16 (RoPE, prefill rows) has <= 16 significant bits.
   If every product is a multiple of ``2**(lq + lk)`` (``lq``, ``lk``: the least-significant-bit
   exponents, minimum over the row's dims, of q[t,h] and K_k) and ``sum_d |q_d k_d| < 2**(53 + lq
   + lk)``, every product and partial sum is an exact float64 integer multiple of that unit, so
   the dot product is EXACT in any order (FMA or not): ``s~_k`` equals the ordered oracle's logit
   bit for bit. With ``sum |q_d k_d| <= A = ||q||_2 ||K_k||_2`` (Cauchy-Schwarz, inflated by
   ``1 + 2**-30`` for the norms' own rounding) the test is per row: ``alpha[t,h] + max_k
   beta[t,k] < 53`` with ``alpha = log2||q|| - lq``, ``beta = log2||K_k|| - lk`` (norms and lsb
   exponents of q and of the table rows are computed once per call, then gathered; for bfloat16
   data the norm is a proven float32-computed upper bound, ``_row_stats``: every use of a norm
   below only needs an upper bound). Elsewhere both the
   GEMM and the ordered d-loop are within ``g_D A`` of the exact dot product, and the two scale
   multiplications add ``u`` each: ``e_k = scale A (2 g_D + 4u)``, bounded per row by
   ``scale ||q|| max_k ||K_k|| (2 g_D + 4u)``. Logits whose ``A`` is
   not finite or above ``2**1000`` (NaN/Inf in q or a valid row, overflow risk) make their whole
   (t, h) row recomputed by the ordered d-loop itself (bit-identical, so non-finite logits match),
   ``e_s = 0`` there.
   ``e_s = max_k e_k``; ``max_logits``: ``|m~ - m| <= e_s`` (max is 1-Lipschitz), 0 if all exact.
   A (t, h) row whose ``delta`` (step 2) would exceed ``2**-30`` (logits so large that ``g_D A``
   is not small against 1: extreme magnitudes) takes the ordered logits too (``e_s = 0``), so
   ``r`` below never exceeds ~``2**-30`` and every bound stays meaningful.
2. ``p~_k = torch.exp(s~_k - m~)`` (one elementwise pass; the ordered oracle uses ``det_exp``).
   The fast path uses torch's own float64 ``exp``/``log``/``logaddexp`` everywhere (steps 2, 4, 6,
   7): CUDA's libdevice ``exp``/``log``/``log1p`` are documented within 1-2 ulps, CPU's (SLEEF
   1.0-ulp variants or libm) within 1 ulp; ``det_exp``/``det_log`` are within a few ulps
   (``detmath``). One ulp is at most ``2u = 2**-52`` relative, so ``eps_e = eps_l = 2**-48`` (16
   ulps) covers either side with margin. Both exps are within ``eps_e`` relative of ``exp``, plus
   ``eta = 2**-1022`` absolute in the subnormal range. The arguments agree to ``delta = 2 e_s (1 +
   2u) + 2u (max|d~| + 2 e_s)`` (0 where ``e_s = 0``: the same logits give the same difference),
   with ``max|d~| <= 2 scale ||q|| max_k ||K_k|| (1 + 2**-40)`` (Cauchy-Schwarz again; no pass
   over the logits). So ``|p~_k - p_k| <= r p_k + eta`` with
   ``r = e^delta (1 + eps_e)/(1 - eps_e) - 1 + 2 eps_e/(1 - eps_e)``.
3. ``L = sum p`` (ordered: sequential; fast: ``torch.sum``): both within ``g_K`` of their exact
   sums ``S~``, ``S``; ``S <= (S~ + K eta)/(1 - r)``, ``S~ <= L~/(1 - g_K)``:
   ``|L~ - L| <= rho L~``, ``rho = [g_K + (g_K + r)/(1 - r)]/(1 - g_K) + K eta (1 + (g_K+r)/(1-r))``
   (``L~ >= 1``: the arg-max slot contributes ``exp(0) = 1`` exactly).
4. ``lse = m + log(L)`` (ordered: ``det_log``; fast: ``torch.log``): ``e_lse = e_s + rho/(1 - rho)
   + 2 eps_l (|ln L~| + 1) + 2u (|lse~| + e_s + 1)`` with ``eps_l = 2**-48`` (a few ulps, step 2).
5. ``O = bmm(p, V) / L``: with ``V_j = max |v_kj|`` over the token's valid slots k and all dims
   (finite values only: a non-finite value reaches only outputs that are non-finite in both
   modes) the same argument as 3 bounds ``|N~ - N| <= rho L~ V_j`` and ``|O| <= V_j (1 + 3 g_K)``,
   so ``e_O = V_j (2 rho + 2u) (1 + 3 g_K)``.
6. Sink factor ``f = 1/(1 + exp(sink - lse))`` (``det_exp`` / ``torch.exp``): ``|df/dlse| <=
   1/4``; each side's rounding is
   ``<= eps_f f``, ``eps_f = eps_e + u (|sink - lse~| + e_lse) + 3u``: ``e_f = e_lse / 4 + 2
   eps_f`` (0 for +-inf sinks: ``f`` is exactly 0 or 1 on both sides). ``out = O f``:
   ``e_out = e_O + V_j (1 + 3 g_K) (e_f + 2u)``.
7. ``lse_with_sink = logaddexp(lse, sink)`` (ordered: ``hi + det_log1p_exp_neg(lo - hi)``; fast:
   ``torch.logaddexp``, the same ``max + log1p(exp(-|d|))`` form) is 1-Lipschitz in ``lse``; each
   side rounds ``<= eps_l (1 + |lws|) + 2u |lws|`` (the rounding ``u |d|`` of ``d`` moves
   ``log1p(exp(-|d|))`` by ``<= u |d| e^-|d| <= u/e``): ``e_lws = e_lse + 2 eps_l (1 + |lws~|) + 4u (|lws~| + e_lse)``
   (= ``e_lse`` without a sink, 0 with a ``+inf`` sink).
Every bound is multiplied by ``1 + 2**-20`` (second-order terms). Magnitude at DSv4 shapes
(K = 640..1152, D = 512, random FP8 caches): ``e_out <= 2e-10 V`` and ``e_lse <= 1.1e-10`` on rows
whose logits are not proven exact, ``~1e-13 V`` and ``~1e-13`` on rows that are (the default
cases: ``<= 3e-11``), against bf16 output tolerances ~4e-3 relative and LSE tolerances ~1e-5
absolute: at least 1e5 times smaller.

Assumes IEEE float64 GEMMs (every product and sum correctly rounded or fused; no reduced-precision
float64 emulation) and denormals not flushed.

Memory: ``peak_bytes_estimate_fast`` per chunk; ``chunk_tokens=None`` fits ``FAST_BUDGET_BYTES``
(1.5 GiB) on a GPU, and on the CPU keeps one ``[chunk, H, K]`` logit tensor near 8 MiB (speed).
Results do not depend on the chunk size beyond the bound.

Speed (the GPU call is launch-bound): the row statistics take one pass per table (pieces of
``_STAT_BYTES``), chunks issue ~50 kernels and no host sync (``_chunk``), steps 4-7 run once on
``[T, H]`` tensors (``_finish``), and one host sync at the end finds the rare chunks that need
ordered logits (NaN/Inf, extreme magnitudes), which are then recomputed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .attention import _check_common, _enum
from .errors import check_int
from .policies import NanPolicy

__all__ = ["FastOracleOut", "fast_sparse_attention", "peak_bytes_estimate_fast", "FAST_BUDGET_BYTES",
           "BOUND_OUTPUTS"]

FAST_BUDGET_BYTES = 3 * 2**29  # 1.5 GiB of per-chunk tensors
_CPU_LOGIT_BYTES = 8 * 2**20
_U = 2.0**-53
_EPS_E = 2.0**-48  # exp relative accuracy allowance (det_exp, torch.exp: a few ulps)
_EPS_L = 2.0**-48  # log accuracy allowance (relative to |ln x| + 1; det_log, torch.log/logaddexp)
_ETA = 2.0**-1022  # subnormal rounding of one exp value
_SAFE = 1.0 + 2.0**-20
_BIG = 2.0**1000
_DELTA_MAX = 2.0**-30  # larger logit-difference bounds: those rows take the ordered logits
_NO_LSB = 1 << 20
_STAT_BYTES = 2**30  # temporaries of one piece of the row statistics
_STAT_PER_ELEM = 56  # bytes per element of the float64 statistics path (copy, bits, lsb temporaries)
_STAT_PER_ELEM_BF16 = 32  # bytes per element of the bfloat16 path (float32 square, int64 bits, ...)
BOUND_OUTPUTS = ("out", "lse", "lse_with_sink", "max_logits")


def _gamma(n: int) -> float:
    return n * _U / (1.0 - n * _U)


def _gamma32(n: int) -> float:
    """``g_n`` for float32 (``u = 2**-24``)."""
    return n * 2.0**-24 / (1.0 - n * 2.0**-24)


@dataclass(frozen=True)
class FastOracleOut:
    """``OracleOut`` fields (float64, on the device of ``q``) plus ``bound`` (dict of float64
    tensors shaped like ``out``/``lse``/``lse_with_sink``/``max_logits``: ``|fast - ordered|``
    bound, 0 where both are exact or non-finite) and ``exact_logits``: the fraction of valid
    logits proven exact (equal to the ordered oracle's bits)."""

    out: torch.Tensor
    lse: torch.Tensor
    lse_with_sink: torch.Tensor
    max_logits: torch.Tensor
    n_valid: torch.Tensor
    bound: dict
    exact_logits: float

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {"out": self.out, "lse": self.lse, "lse_with_sink": self.lse_with_sink,
                "max_logits": self.max_logits, "n_valid": self.n_valid}


def peak_bytes_estimate_fast(chunk_tokens: int, num_heads: int, total_topk: int, head_dim: int = 512,
                             d_v: int = 512, rows_itemsize: int = 2) -> int:
    """Upper estimate (bytes) of the fast oracle's live tensors for one chunk of ``c`` tokens:
    ``c * (K*D*(b + 8 + 8) + 8*H*K*8 + 5*H*d_v*8 + 16*K + 64*H)``: gathered rows (source dtype
    and float64, with a float64 allowance to spare), up to eight ``[H, K]`` logit-sized tensors,
    output-sized tensors (outputs, their bounds, q's bit temporaries), per-slot scalars. Once per
    call come the zero-row copy of each row table (``(N + 1) * D * b``) and the row statistics,
    computed in pieces of ``<= _STAT_BYTES`` (1 GiB) of temporaries; the outputs and bounds of
    all ``T`` tokens (``T * (2 * H * d_v + 8 * H) * 8`` bytes) are held until the call returns.
    Production decode (H=128, K=1152, D=d_v=512): 21.7 MiB per token, so the default 1.5 GiB
    budget gives 70-token chunks."""
    for name, v in (("chunk_tokens", chunk_tokens), ("num_heads", num_heads), ("head_dim", head_dim),
                    ("d_v", d_v), ("rows_itemsize", rows_itemsize)):
        check_int("peak_bytes_estimate_fast", name, v, minimum=1)
    check_int("peak_bytes_estimate_fast", "total_topk", total_topk, minimum=0)
    c, H, K, D = chunk_tokens, num_heads, total_topk, head_dim
    return c * (K * D * (rows_itemsize + 16) + 8 * H * K * 8 + 5 * H * d_v * 8 + 16 * K + 64 * H)


def _lsb_exp(x: torch.Tensor) -> torch.Tensor:
    """int64 exponent of the least significant set bit of each float64 ``x`` (``_NO_LSB`` for
    zeros; NaN/Inf give garbage and are excluded by the caller's finiteness test)."""
    bits = x.view(torch.int64) & 0x7FFFFFFFFFFFFFFF
    ef = bits >> 52
    man = bits & 0x000FFFFFFFFFFFFF
    sig = torch.where(ef > 0, man | (1 << 52), man)
    low = (sig & (-sig)).to(torch.float64)  # a power of two (exact)
    _, e = torch.frexp(low)
    lsb = (e.to(torch.int64) - 1) + torch.where(ef > 0, ef - 1075, torch.full_like(ef, -1074))
    return torch.where(sig == 0, torch.full_like(lsb, _NO_LSB), lsb)


_BF16_LSB: dict = {}


def _lsb_exp_bf16(x: torch.Tensor) -> torch.Tensor:
    """int32 lsb exponent of each bfloat16 ``x``: one lookup of its 15 magnitude bits in a table of
    all 2**15 patterns (built once per device by ``_lsb_exp_bf16_bits``; no float64 copy)."""
    lut = _BF16_LSB.get(x.device)
    if lut is None:
        pat = torch.arange(2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        lut = _BF16_LSB[x.device] = _lsb_exp_bf16_bits(pat).to(x.device)
    return lut[(x.view(torch.int16) & 0x7FFF).to(torch.int64)]


def _lsb_exp_bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """int32 lsb exponent of each bfloat16 ``x`` read from its 16 bits: a finite bf16 is
    ``sig * 2**(ef - 134)`` (normal: ``sig = 0x80 | man``, ``ef >= 1``) or ``man * 2**-133``
    (subnormal); ``_NO_LSB`` for zeros, garbage for NaN/Inf (excluded by the caller)."""
    b = x.view(torch.int16).to(torch.int32) & 0x7FFF
    ef = b >> 7
    sig = torch.where(ef > 0, (b & 0x7F) | 0x80, b)
    _, e = torch.frexp((sig & (-sig)).to(torch.float32))  # a power of two <= 2**7 (exact)
    lsb = e - 1 + torch.clamp(ef, min=1) - 134
    return torch.where(sig == 0, _NO_LSB, lsb)


def _ordered_dots(qc: torch.Tensor, g: torch.Tensor, where: torch.Tensor, scale: float) -> torch.Tensor:
    """The ordered oracle's logits (d = 0..D-1, multiply then add from +0) for the listed
    ``(t, h, k)`` positions ``where`` ``[n, 3]``: bit-identical to ``attention._logits``."""
    t, h, k = where.unbind(1)
    a, b = qc[t, h], g[t, k]  # [n, D]
    acc = torch.zeros(a.shape[0], dtype=torch.float64, device=a.device)
    for d in range(a.shape[1]):
        acc.add_(a[:, d] * b[:, d])
    return acc.mul_(scale)


def _row_stats(rows: torch.Tensor, nan_policy: NanPolicy, d_v: int) -> tuple[torch.Tensor, ...]:
    """Per row of a 2-D table (``[N]`` each): an upper bound of the float64 L2 norm (float64),
    least-significant-bit exponent (int64, min over dims) and ``max_j |v_j|`` (float64) over the
    finite values of the first ``d_v`` dims (a non-finite value only reaches outputs that are
    non-finite in both modes), of the row as the oracle reads it (NaN scrubbed under ``SCRUB``).
    Pieces of ``_STAT_BYTES`` of temporaries (``_stats_many`` runs same-dtype tables, q included,
    as one table: one pass per call at production shapes).

    bfloat16 rows (the production caches and q): lsb exponents from the int16 bits; the norm from
    an float32 sum of squares. A bf16 value has 8 significant bits, so its float32 square is exact
    unless it underflows (absolute error ``<= 2**-150`` per square, float32 subnormal spacing / 2)
    or overflows (``inf``: the norm is then ``inf`` and the caller takes the ordered path, exactly
    as for a non-finite value); the float32 sum of ``D`` squares in any order is within ``g_D(2**-24)``
    relative of the exact sum of the rounded squares. So ``||x||^2 <= S32 / (1 - g_D(2**-24)) + D
    2**-149`` and the float64 ``sqrt`` of that, times ``1 + 2**-50`` for the two float64 roundings,
    is an upper bound of the exact (hence of the float64-computed, up to ``2**-30``) norm. The
    bound is only used as an upper bound (Cauchy-Schwarz, the exactness test's ``log2||x||``)."""
    N, D = rows.shape
    dev = rows.device
    out = (torch.empty(N, dtype=torch.float64, device=dev), torch.empty(N, dtype=torch.int64, device=dev),
           torch.empty(N, dtype=torch.float64, device=dev))
    bf16 = rows.dtype == torch.bfloat16
    step = max(1, _STAT_BYTES // (max(1, D) * (_STAT_PER_ELEM_BF16 if bf16 else _STAT_PER_ELEM)))
    g32 = _gamma32(D)
    for r0 in range(0, N, step):
        x = rows[r0:r0 + step]
        if nan_policy == NanPolicy.SCRUB and x.is_floating_point():
            x = x.nan_to_num(nan=0.0, posinf=math.inf, neginf=-math.inf)
        r1 = r0 + x.shape[0]
        if bf16:
            s32 = x.float().square_().sum(dim=1)
            torch.sqrt(s32.double().mul_(1.0 / (1.0 - g32)).add_(D * 2.0**-149), out=out[0][r0:r1])
            out[0][r0:r1].mul_(1.0 + 2.0**-50)
            out[1][r0:r1].copy_(_lsb_exp_bf16(x).amin(dim=1))
            xv = x[:, :d_v].abs()
            out[2][r0:r1].copy_(torch.where(torch.isfinite(xv), xv, 0.0).amax(dim=1))
        else:
            x = x.to(torch.float64)
            out[0][r0:r1].copy_(torch.linalg.vector_norm(x, dim=1))
            out[1][r0:r1].copy_(_lsb_exp(x).amin(dim=1))
            xv = x[:, :d_v].abs()
            out[2][r0:r1].copy_(torch.where(torch.isfinite(xv), xv, 0.0).amax(dim=1))
    return out


def _stats_many(mats, d_v: int) -> list:
    """``_row_stats`` of several ``(rows, nan_policy)`` tables, in order; consecutive tables of the
    same dtype, width and effective policy share one pass over their concatenation (fewer kernel
    launches; the statistics are per row, so the result is the same)."""
    out, i = [], 0
    while i < len(mats):
        x, pol = mats[i]
        key = (x.dtype, x.shape[1], pol if x.is_floating_point() else None)
        j = i + 1
        while j < len(mats) and (mats[j][0].dtype, mats[j][0].shape[1],
                                 mats[j][1] if mats[j][0].is_floating_point() else None) == key:
            j += 1
        group = [m[0] for m in mats[i:j]]
        st = _row_stats(group[0] if j == i + 1 else torch.cat(group), pol, d_v)
        sizes = [g.shape[0] for g in group]
        out.extend(zip(*(t.split(sizes) for t in st)))
        i = j
    return out


def _stat_tables(segs, stats):
    """The per-segment row statistics concatenated, with one trailing entry for the zero row
    (norm 0, no lsb, ``max |v|`` 0), and the ``[T, K]`` index of every slot into them (invalid
    slots point at the trailing entry): one gather per statistic per chunk."""
    dev = segs[0].idx.device
    nks, lks, vms, idxs, off = [], [], [], [], 0
    for seg, (nk, lk, vm) in zip(segs, stats):
        nks.append(nk), lks.append(lk), vms.append(vm)
        idxs.append(seg.idx.to(torch.int64) + off)
        off += nk.shape[0]
    nks.append(torch.zeros(1, dtype=torch.float64, device=dev))
    lks.append(torch.full((1,), _NO_LSB, dtype=torch.int64, device=dev))
    vms.append(torch.zeros(1, dtype=torch.float64, device=dev))
    valid = torch.cat([sg.valid for sg in segs], dim=1)
    gidx = torch.where(valid, torch.cat(idxs, dim=1), off)
    return (torch.cat(nks), torch.cat(lks), torch.cat(vms)), gidx


def _zero_row_tables(segs, nan_policy: NanPolicy) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per segment: the rows with one zero row appended (scrubbed under ``SCRUB``) and ``[T, K]``
    indices with every invalid slot pointing at that zero row: one ``index_select`` then gathers
    exactly what ``attention._gather`` produces (invalid rows +0, NaN scrubbed), in two passes."""
    out = []
    for sg in segs:
        rows = sg.rows
        if nan_policy == NanPolicy.SCRUB and rows.is_floating_point():
            rows = rows.masked_fill(torch.isnan(rows), 0.0)
        N = rows.shape[0]
        table = torch.cat([rows, torch.zeros(1, rows.shape[1], dtype=rows.dtype, device=rows.device)])
        out.append((table, torch.where(sg.valid, sg.idx, N)))
    return out


def _gather_rows(tables, t0: int, t1: int, D: int) -> torch.Tensor:
    """Gathered float64 rows ``[c, K, D]`` of tokens ``t0:t1`` (invalid slots: +0 rows)."""
    K = sum(ix.shape[1] for _, ix in tables)
    g = torch.empty(t1 - t0, K, D, dtype=torch.float64, device=tables[0][0].device)
    off = 0
    for table, ix in tables:
        Ks = ix.shape[1]
        if Ks:
            sel = table.index_select(0, ix[t0:t1].reshape(-1)).view(t1 - t0, Ks, D)
            g[:, off:off + Ks].copy_(sel)
        off += Ks
    return g


def _chunk(qc, g, valid, scale, d_v, nk, lk, vrow, nq, lq, apply_redo=False):
    """Steps 1-3 and ``bmm(p, V) / L`` for one chunk of ``c`` tokens: ``qc`` ``[c, H, D]`` float64,
    ``g`` ``[c, K, D]`` gathered rows, ``valid`` ``[c, K]``, slot statistics ``nk``/``lk``/``vrow``
    ``[c, K]`` (0 / none / 0 on invalid slots), q statistics ``nq`` (norm upper bound) / ``lq``
    ``[c, H]``. Returns ``(O [c, H, d_v], m, L, e_s, delta [c, H], vmax [c], n_valid [c], n_exact,
    needs_redo)`` (device tensors, no host sync). ``needs_redo``: some row must take the ordered
    logits; without ``apply_redo`` they are NOT recomputed: the caller runs such a chunk again
    with ``apply_redo=True``. Lonely rows (no valid slot) give garbage, masked by ``_finish``."""
    c, H, D = qc.shape
    K = g.shape[1]
    dev = qc.device
    n_valid = valid.sum(dim=1)
    if K == 0:
        z = torch.zeros(c, H, dtype=torch.float64, device=dev)
        return (torch.zeros(c, H, d_v, dtype=torch.float64, device=dev), z, z, z, z, z[:, 0], n_valid,
                torch.zeros((), dtype=torch.int64, device=dev), torch.zeros((), dtype=torch.bool, device=dev))
    vmask = valid.unsqueeze(1)  # [c, 1, K]
    ck = scale * (2.0 * _gamma(D) + 4.0 * _U)
    # 1. logits: unordered GEMM; per-row exactness test (step 1), per-element only where needed
    s = torch.bmm(qc, g.transpose(1, 2)).mul_(scale)
    nq = nq * (1.0 + 2.0**-30)  # [c, H]
    big = nk.amax(dim=1, keepdim=True) * (1.0 + 2.0**-30)  # [c, 1]: largest valid row norm (invalid: 0)
    beta = torch.where(nk > 0, torch.log2(nk * (1.0 + 2.0**-30)) - lk, -math.inf).amax(dim=1, keepdim=True)
    nqb = nq * big  # [c, H]: ||q|| max_k ||K_k|| (NaN/inf where a norm is)
    row_ok = nqb <= _BIG  # False for NaN / inf
    row_exact = row_ok & ((nq == 0) | (torch.log2(nq) - lq + beta + 2.0**-20 < 53.0))
    # e_s: upper bound of max e_k; smax: |s~_k| <= scale ||q|| max||K|| (1 + g_D) on a finite row, so
    # the softmax argument spread max|d~| <= smax = 2 scale ||q|| max||K|| (1 + 2**-40): no pass over [c, H, K]
    e_s = ck * nqb
    delta = 2.0 * e_s * (1 + 2 * _U) + 2 * _U * ((2.0 * scale * (1.0 + 2.0**-40)) * nqb + 2.0 * e_s)
    # rows with NaN/Inf/huge products, or whose bound is not small against the softmax: ordered logits
    fast_row = row_ok & (row_exact | (delta <= _DELTA_MAX))
    approx = fast_row & ~row_exact
    e_s = torch.where(approx, e_s, 0.0)
    delta = torch.where(approx, delta, 0.0)
    redo = vmask & ~fast_row.unsqueeze(2)
    needs_redo = redo.any()
    if apply_redo:
        w = redo.nonzero()
        s[w[:, 0], w[:, 1], w[:, 2]] = _ordered_dots(qc, g, w, scale)
    n_exact = (n_valid.unsqueeze(1) * ~approx).sum()
    # 2. softmax steps of the ordered oracle; p = exp(s - m) (torch.exp, one pass, in place)
    s.masked_fill_(~vmask, -math.inf)
    m = s.amax(dim=2) + 0.0
    p = s.sub_(m.unsqueeze(2)).exp_()
    del s
    # 3-5. unordered sums
    L = p.sum(dim=2)
    O = torch.bmm(p, g[:, :, :d_v]).div_(L.unsqueeze(2))
    del p
    return O, m, L, e_s, delta, vrow.amax(dim=1), n_valid, n_exact, needs_redo


def _finish(O, m, L, e_s, delta, vmax, n_valid, sink, K):
    """Steps 4-7 for all tokens at once (``[T, H]`` arithmetic: a fixed number of kernel launches
    per call), with the ordered oracle's lonely-row conventions. ``vmax`` ``[T]`` is ``>=`` every
    finite ``|v_kj|`` of the token (invalid slots: 0). Bound terms may be NaN/inf only where the
    output they bound is non-finite or lonely (masked to 0 at the end): a row with a finite
    ``lse`` has finite ``m``, ``L >= 1`` and ``ln L``. Constant factors are folded (``rho`` as an
    affine function of ``kr``): reassociation changes the bound by a few ``u`` relative, covered by
    ``_SAFE``."""
    T, H = m.shape
    has = (n_valid > 0).unsqueeze(1)  # [T, 1]
    lnL = torch.log(L)
    lse = m + lnL
    gK, u = _gamma(K), _U
    r = torch.expm1(delta).mul_((1 + _EPS_E) / (1 - _EPS_E)).add_(2.0 * _EPS_E / (1 - _EPS_E))
    kr = (r + gK).div_(1.0 - r)
    # rho = (gK + kr)/(1 - gK) + K eta (1 + kr)
    rho = kr.mul_(1.0 / (1 - gK) + K * _ETA).add_(gK / (1 - gK) + K * _ETA)
    # e_lse = e_s + rho/(1 - rho) + 2 eps_l (|ln L| + 1) + 2u (|lse| + e_s + 1)
    e_lse = rho / (1.0 - rho)
    e_lse.add_(e_s, alpha=1 + 2 * u).add_(lnL.abs(), alpha=2 * _EPS_L).add_(lse.abs(), alpha=2 * u)
    e_lse.add_(2 * _EPS_L + 2 * u)
    e_o = rho.mul_(2.0).add_(2 * u)  # [T, H]: e_out / (V_j (1 + 3 g_K))
    lse = lse.masked_fill_(~has, -math.inf)
    if sink is None:
        out = O
        lws = lse
        e_lws = e_lse
    else:
        sk = sink.unsqueeze(0)  # [1, H]
        d = sk - lse
        out = O.mul_(torch.exp(d).add_(1.0).reciprocal_().unsqueeze(2))
        # e_f = e_lse/4 + 2 eps_f, eps_f = eps_e + 3u + u (|sink - lse| + e_lse); 0 for +-inf sinks
        e_f = d.abs_().mul_(2 * u).add_(e_lse, alpha=0.25 + 2 * u).add_(2 * (_EPS_E + 3 * u))
        e_o = torch.where(torch.isinf(sk), e_o + 2 * u, e_o.add_(e_f).add_(2 * u))
        e_o.masked_fill_(sk == math.inf, 0.0)
        lws = torch.logaddexp(lse, sk)
        # e_lws = e_lse + 2 eps_l (1 + |lws|) + 4u (|lws| + e_lse) (a -inf sink: lws = lse, so this
        # is >= e_lse; a +inf sink: lws = +inf, masked below)
        e_lws = lws.abs().mul_(2 * _EPS_L + 4 * u).add_(e_lse, alpha=1 + 4 * u).add_(2 * _EPS_L)
    out = out.masked_fill_(~has.unsqueeze(2), 0.0)
    m = m.masked_fill(~has, -math.inf)
    e_out = (vmax.view(T, 1, 1) * ((1 + 3 * gK) * _SAFE)) * e_o.unsqueeze(2)
    b = {"out": torch.where(has.unsqueeze(2) & torch.isfinite(out), e_out, 0.0),
         "lse": torch.where(torch.isfinite(lse), e_lse * _SAFE, 0.0),
         "lse_with_sink": torch.where(has & torch.isfinite(lws), e_lws * _SAFE, 0.0),
         "max_logits": torch.where(torch.isfinite(m), e_s * _SAFE, 0.0)}
    return (out, lse, lws, m, n_valid), b


def fast_sparse_attention(q: torch.Tensor, segments: list, scale: float, sink: torch.Tensor | None = None,
                          d_v: int | None = None, nan_policy: NanPolicy | str = NanPolicy.PROPAGATE,
                          chunk_tokens: int | None = None) -> FastOracleOut:
    """Fast judging oracle (module docstring: derivation of ``bound``). Arguments, validation
    and conventions as ``attention.sparse_attention`` (mode EXACT only)."""
    fn = "fast_sparse_attention"
    T, H, D, segs, sc, sk, d_v = _check_common(fn, q, segments, scale, sink, d_v, chunk_tokens)
    nan_policy = _enum(fn, "nan_policy", NanPolicy, nan_policy)
    K = sum(s.idx.shape[1] for s in segs)
    if chunk_tokens is None:
        item = max(s.rows.element_size() for s in segs)
        per = peak_bytes_estimate_fast(1, H, K, D, d_v, item)
        chunk_tokens = max(1, FAST_BUDGET_BYTES // per)
        if q.device.type == "cpu":
            chunk_tokens = min(chunk_tokens, max(1, _CPU_LOGIT_BYTES // max(1, 8 * H * K)))
    dev = q.device
    if T == 0:
        e2 = torch.empty(0, H, dtype=torch.float64, device=dev)
        e3 = torch.empty(0, H, d_v, dtype=torch.float64, device=dev)
        return FastOracleOut(e3, e2, e2, e2, torch.empty(0, dtype=torch.int32, device=dev),
                             {"out": e3, "lse": e2, "lse_with_sink": e2, "max_logits": e2}, 1.0)
    # q as the oracle reads it (never scrubbed), then the tables
    st = _stats_many([(q.reshape(T * H, D), NanPolicy.PROPAGATE)] + [(sg.rows, nan_policy) for sg in segs], d_v)
    nqa, lqa, _ = st[0]
    stats, gidx = _stat_tables(segs, st[1:])
    nqa, lqa = nqa.view(T, H), lqa.view(T, H)
    tables = _zero_row_tables(segs, nan_policy)
    valid_all = torch.cat([sg.valid for sg in segs], dim=1)

    def run(t0, t1, apply_redo):
        g, ix = _gather_rows(tables, t0, t1, D), gidx[t0:t1]
        return _chunk(q[t0:t1].to(torch.float64), g, valid_all[t0:t1], sc, d_v, stats[0][ix],
                      stats[1][ix], stats[2][ix], nqa[t0:t1], lqa[t0:t1], apply_redo)

    # no host sync inside the loop: chunks whose rows need the ordered logits (NaN/Inf, extreme
    # magnitudes: rare) are found with one sync at the end and run again with the ordered logits
    spans = [(t0, min(T, t0 + chunk_tokens)) for t0 in range(0, T, chunk_tokens)]
    parts = [run(t0, t1, False) for t0, t1 in spans]
    host = torch.stack([sum(p[6].sum() for p in parts).to(torch.int64).reshape(())]
                       + [p[8].to(torch.int64) for p in parts]).tolist()  # the one host sync
    for i, (t0, t1) in enumerate(spans):
        if host[1 + i]:
            parts[i] = run(t0, t1, True)
    cols = [c[0] if len(parts) == 1 else torch.cat(c, dim=0) for c in zip(*(x[:7] for x in parts))]
    (out, lse, lws, m, n_valid), bound = _finish(*cols, sk, K)
    ne, na = sum(p[7] for p in parts), host[0] * H
    return FastOracleOut(out, lse, lws, m, n_valid.to(torch.int32), bound,
                         (int(ne) / na) if na else 1.0)
