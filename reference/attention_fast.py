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
   exponents of the table rows are computed once per call, then gathered). Elsewhere both the
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
   Both exps are within ``eps_e = 2**-48`` relative of ``exp`` (a few ulps: ``detmath``; CUDA and
   CPU float64 ``exp`` are within 1-2 ulps), plus ``eta = 2**-1022`` absolute in the subnormal
   range. The arguments agree to ``delta = 2 e_s (1 + 2u) + 2u (max|d~| + 2 e_s)`` (0 where
   ``e_s = 0``: the same logits give the same difference), with ``max|d~| <= 2 scale ||q||
   max_k ||K_k|| (1 + 2**-40)`` (Cauchy-Schwarz again; no pass over the logits). So ``|p~_k - p_k| <= r p_k + eta`` with
   ``r = e^delta (1 + eps_e)/(1 - eps_e) - 1 + 2 eps_e/(1 - eps_e)``.
3. ``L = sum p`` (ordered: sequential; fast: ``torch.sum``): both within ``g_K`` of their exact
   sums ``S~``, ``S``; ``S <= (S~ + K eta)/(1 - r)``, ``S~ <= L~/(1 - g_K)``:
   ``|L~ - L| <= rho L~``, ``rho = [g_K + (g_K + r)/(1 - r)]/(1 - g_K) + K eta (1 + (g_K+r)/(1-r))``
   (``L~ >= 1``: the arg-max slot contributes ``exp(0) = 1`` exactly).
4. ``lse = m + det_log(L)``: ``e_lse = e_s + rho/(1 - rho) + 2 eps_l (|ln L~| + 1) + 2u (|lse~| +
   e_s + 1)`` with ``eps_l = 2**-48`` (det_log, a few ulps).
5. ``O = bmm(p, V) / L``: with ``V_j = max |v_kj|`` over the token's valid slots k and all dims
   (finite values only: a non-finite value reaches only outputs that are non-finite in both
   modes) the same argument as 3 bounds ``|N~ - N| <= rho L~ V_j`` and ``|O| <= V_j (1 + 3 g_K)``,
   so ``e_O = V_j (2 rho + 2u) (1 + 3 g_K)``.
6. Sink factor ``f = 1/(1 + det_exp(sink - lse))``: ``|df/dlse| <= 1/4``; each side's rounding is
   ``<= eps_f f``, ``eps_f = eps_e + u (|sink - lse~| + e_lse) + 3u``: ``e_f = e_lse / 4 + 2
   eps_f`` (0 for +-inf sinks: ``f`` is exactly 0 or 1 on both sides). ``out = O f``:
   ``e_out = e_O + V_j (1 + 3 g_K) (e_f + 2u)``.
7. ``lse_with_sink = logaddexp(lse, sink)`` is 1-Lipschitz in ``lse``; each side rounds ``<= eps_l
   (1 + |lws|) + 2u |lws|``: ``e_lws = e_lse + 2 eps_l (1 + |lws~|) + 4u (|lws~| + e_lse)``
   (= ``e_lse`` without a sink or with a ``-inf`` sink, 0 with a ``+inf`` sink).
Every bound is multiplied by ``1 + 2**-20`` (second-order terms). Magnitude at DSv4 shapes
(K = 640..1152, D = 512, random FP8 caches): ``e_out <= 2e-10 V`` and ``e_lse <= 1.1e-10`` on rows
whose logits are not proven exact, ``~1e-13 V`` and ``~1e-13`` on rows that are (the default
cases: ``<= 3e-11``), against bf16 output tolerances ~4e-3 relative and LSE tolerances ~1e-5
absolute: at least 1e5 times smaller.

Assumes IEEE float64 GEMMs (every product and sum correctly rounded or fused; no reduced-precision
float64 emulation) and denormals not flushed.

Memory: ``peak_bytes_estimate_fast`` per chunk; ``chunk_tokens=None`` fits ``FAST_BUDGET_BYTES``
(1 GiB) on a GPU, and on the CPU keeps one ``[chunk, H, K]`` logit tensor near 8 MiB (speed).
Results do not depend on the chunk size beyond the bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .attention import _check_common, _enum, logaddexp
from .detmath import det_exp, det_log
from .errors import check_int
from .policies import NanPolicy

__all__ = ["FastOracleOut", "fast_sparse_attention", "peak_bytes_estimate_fast", "FAST_BUDGET_BYTES",
           "BOUND_OUTPUTS"]

FAST_BUDGET_BYTES = 2**30
_CPU_LOGIT_BYTES = 8 * 2**20
_U = 2.0**-53
_EPS_E = 2.0**-48  # det_exp relative accuracy allowance ("a few ulps", detmath)
_EPS_L = 2.0**-48  # det_log accuracy allowance (relative to |ln x| + 1)
_ETA = 2.0**-1022  # subnormal rounding of one exp value
_SAFE = 1.0 + 2.0**-20
_BIG = 2.0**1000
_DELTA_MAX = 2.0**-30  # larger logit-difference bounds: those rows take the ordered logits
_NO_LSB = 1 << 20
_STAT_ROWS = 4096  # lsb exponent of an all-zero vector: no constraint
BOUND_OUTPUTS = ("out", "lse", "lse_with_sink", "max_logits")


def _gamma(n: int) -> float:
    return n * _U / (1.0 - n * _U)


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
    computed 4096 rows at a time (``<= 4096 * D * 56`` bytes of temporaries).
    Production decode (H=128, K=1152, D=d_v=512): 21.7 MiB per token, so the default 1 GiB
    budget gives 47-token chunks."""
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
    """Per table row (float64, ``[N]`` each): L2 norm, least-significant-bit exponent (min over
    dims) and ``max_j |v_j|`` over the finite values of the first ``d_v`` dims (a non-finite
    value only reaches outputs that are non-finite in both modes), of the row as the oracle reads it
    (NaN scrubbed under ``SCRUB``). Computed in pieces of ``_STAT_ROWS`` rows (bounded memory)."""
    N = rows.shape[0]
    outs = ([], [], [])
    for r0 in range(0, N, _STAT_ROWS):
        x = rows[r0:r0 + _STAT_ROWS].to(torch.float64)
        if nan_policy == NanPolicy.SCRUB:
            x = x.nan_to_num(nan=0.0, posinf=math.inf, neginf=-math.inf)
        outs[0].append(torch.linalg.vector_norm(x, dim=1))
        outs[1].append(_lsb_exp(x).amin(dim=1))
        xv = x[:, :d_v].abs()
        outs[2].append(torch.where(torch.isfinite(xv), xv, 0.0).amax(dim=1))  # finite outputs see only these
    dev = rows.device
    if N == 0:
        return (torch.zeros(0, dtype=torch.float64, device=dev), torch.zeros(0, dtype=torch.int64, device=dev),
                torch.zeros(0, dtype=torch.float64, device=dev))
    return tuple(torch.cat(o) for o in outs)


def _gather_stats(segs, stats, t0: int, t1: int) -> tuple[torch.Tensor, ...]:
    """``[c, K]`` norms, lsb exponents and ``max |v|`` of the gathered slots (invalid: 0 / none / 0)."""
    nks, lks, vms = [], [], []
    for seg, (nk, lk, vm) in zip(segs, stats):
        idx, valid = seg.idx[t0:t1], seg.valid[t0:t1]
        N = nk.shape[0]
        if N == 0 or idx.shape[1] == 0:
            z = torch.zeros(idx.shape, dtype=torch.float64, device=idx.device)
            nks.append(z)
            lks.append(torch.full(idx.shape, _NO_LSB, dtype=torch.int64, device=idx.device))
            vms.append(z)
            continue
        safe = idx.clamp(0, N - 1)
        nks.append(torch.where(valid, nk[safe], 0.0))
        lks.append(torch.where(valid, lk[safe], _NO_LSB))
        vms.append(torch.where(valid, vm[safe], 0.0))
    return torch.cat(nks, dim=1), torch.cat(lks, dim=1), torch.cat(vms, dim=1)


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


def _chunk(qc, g, valid, scale, sink, d_v, nk, lk, vrow):
    c, H, D = qc.shape
    K = g.shape[1]
    dev = qc.device
    n_valid = valid.sum(dim=1)
    has = (n_valid > 0).unsqueeze(1)
    ninf = torch.full((c, H), -math.inf, dtype=torch.float64, device=dev)
    zero2 = torch.zeros(c, H, dtype=torch.float64, device=dev)
    if K == 0:
        zero = torch.zeros(c, H, d_v, dtype=torch.float64, device=dev)
        lws = ninf if sink is None else sink.unsqueeze(0).expand(c, H).clone()
        b = {"out": zero.clone(), "lse": zero2, "lse_with_sink": zero2.clone(), "max_logits": zero2.clone()}
        return (zero, ninf, lws, ninf.clone(), n_valid), b, (0, 0)
    vmask = valid.unsqueeze(1)  # [c, 1, K]
    ck = scale * (2.0 * _gamma(D) + 4.0 * _U)
    # 1. logits: unordered GEMM; per-row exactness test (step 1), per-element only where needed
    s = torch.bmm(qc, g.transpose(1, 2)).mul_(scale)
    nq = torch.linalg.vector_norm(qc, dim=2) * (1.0 + 2.0**-30)  # [c, H]
    lq = _lsb_exp(qc).amin(dim=2)  # [c, H]
    nk = nk * (1.0 + 2.0**-30)
    big = torch.where(valid, nk, 0.0).amax(dim=1)  # [c]: largest valid row norm
    alpha = torch.log2(nq) - lq.to(torch.float64)  # [c, H]
    beta = torch.where(valid & (nk > 0), torch.log2(nk) - lk.to(torch.float64), -math.inf)  # [c, K]
    row_ok = torch.isfinite(nq) & torch.isfinite(big).unsqueeze(1) & (nq * big.unsqueeze(1) <= _BIG)
    row_exact = row_ok & ((nq == 0) | (alpha + beta.amax(dim=1, keepdim=True) + 2.0**-20 < 53.0))
    e_s = torch.where(row_exact, 0.0, ck * nq * big.unsqueeze(1))  # [c, H] (an upper bound of max e_k)
    redo = None
    if not bool(row_ok.all()):  # NaN/Inf or huge products in a row: that row's logits the ordered way
        redo = vmask & ~row_ok.unsqueeze(2)
        e_s = torch.where(row_ok, e_s, 0.0)
    # |s~_k| <= scale ||q|| max_k ||K_k|| (1 + g_D) on a finite row, so the softmax argument spread
    # max|d~| <= smax = 2 scale ||q|| max||K|| (1 + 2**-40): a [c, H] quantity, no pass over [c, H, K]
    smax = torch.where(e_s > 0, (2.0 * scale * (1.0 + 2.0**-40)) * nq * big.unsqueeze(1), 0.0)
    delta = torch.where(e_s > 0, 2.0 * e_s * (1 + 2 * _U) + 2 * _U * (smax + 2.0 * e_s), 0.0)
    coarse = delta > _DELTA_MAX  # rows whose bound is not small against the softmax: ordered logits
    if bool(coarse.any()):
        cm = vmask & coarse.unsqueeze(2)
        redo = cm if redo is None else redo | cm
        e_s = torch.where(coarse, 0.0, e_s)
        delta = torch.where(coarse, 0.0, delta)
    if redo is not None and bool(redo.any()):
        w = redo.nonzero()
        s[w[:, 0], w[:, 1], w[:, 2]] = _ordered_dots(qc, g, w, scale)
    n_all = n_valid.sum() * H  # tensors: no device sync per chunk
    n_exact = (n_valid.unsqueeze(1) * (e_s == 0)).sum()
    # 2. softmax steps of the ordered oracle; p = exp(s - m) (torch.exp, one pass, in place)
    s.masked_fill_(~vmask, -math.inf)
    m = s.amax(dim=2) + 0.0
    p = s.sub_(m.unsqueeze(2)).exp_()
    del s
    v = g[:, :, :d_v]
    # 3-5. unordered sums
    L = p.sum(dim=2)
    O = torch.bmm(p, v) / L.unsqueeze(2)
    del p
    lse = m + det_log(L)
    if sink is None:
        out = O
    else:
        f = 1.0 / (1.0 + det_exp(sink.unsqueeze(0) - lse))
        out = O * f.unsqueeze(2)
    vmax = torch.where(valid, vrow, 0.0).amax(dim=1).view(c, 1, 1)  # >= every |v_kj| of the token
    # bounds (module docstring, steps 2-7)
    gK, u = _gamma(K), _U
    r = torch.expm1(delta) * ((1 + _EPS_E) / (1 - _EPS_E)) + 2.0 * _EPS_E / (1 - _EPS_E)
    kr = (gK + r) / (1 - r)
    rho = (gK + kr) / (1 - gK) + K * _ETA * (1 + kr)
    lse_abs = torch.where(torch.isfinite(lse), lse.abs(), 0.0)
    lnL = torch.where(torch.isfinite(L), det_log(L).abs(), 0.0)
    e_lse = e_s + rho / (1 - rho) + 2 * _EPS_L * (lnL + 1) + 2 * u * (lse_abs + e_s + 1)
    vb = vmax * (1 + 3 * gK)
    e_out = vb * (2 * rho + 2 * u).unsqueeze(2)
    if sink is not None:
        sk = sink.unsqueeze(0).expand(c, H)
        inf_sink = torch.isinf(sk)
        gap = torch.where(torch.isfinite(sk - lse), (sk - lse).abs(), 0.0)
        eps_f = _EPS_E + u * (gap + e_lse) + 3 * u
        e_f = torch.where(inf_sink, 0.0, e_lse / 4 + 2 * eps_f)
        e_out = torch.where((inf_sink & (sk > 0)).unsqueeze(2), 0.0, e_out + vb * (e_f + 2 * u).unsqueeze(2))
    # outputs with the ordered oracle's lonely-row conventions
    zero3 = torch.zeros_like(out)
    out = torch.where(has.unsqueeze(2), out, zero3)
    lse = torch.where(has, lse, ninf)
    m = torch.where(has, m, ninf)
    lws = lse if sink is None else logaddexp(lse, sink.unsqueeze(0).expand(c, H))
    if sink is None:
        e_lws = e_lse
    else:
        lws_abs = torch.where(torch.isfinite(lws), lws.abs(), 0.0)
        e_lws = torch.where(sk == -math.inf, e_lse,
                            e_lse + 2 * _EPS_L * (1 + lws_abs) + 4 * u * (lws_abs + e_lse))
        e_lws = torch.where(sk == math.inf, 0.0, e_lws)
    b = {"out": torch.where(has.unsqueeze(2) & torch.isfinite(out), e_out * _SAFE, 0.0),
         "lse": torch.where(has & torch.isfinite(lse), e_lse * _SAFE, 0.0),
         "lse_with_sink": torch.where(has & torch.isfinite(lws), e_lws * _SAFE, 0.0),
         "max_logits": torch.where(has & torch.isfinite(m), e_s * _SAFE, 0.0)}
    return (out, lse, lws, m, n_valid), b, (n_exact, n_all)


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
    parts, bounds, ne, na = [], [], 0, 0
    stats = [_row_stats(sg.rows, nan_policy, d_v) for sg in segs] if T else []
    tables = _zero_row_tables(segs, nan_policy) if T else []
    valid_all = torch.cat([sg.valid for sg in segs], dim=1)
    for t0 in range(0, T, chunk_tokens):
        t1 = min(T, t0 + chunk_tokens)
        g, valid = _gather_rows(tables, t0, t1, D), valid_all[t0:t1]
        nk, lk, vrow = _gather_stats(segs, stats, t0, t1)
        res, b, (a1, a2) = _chunk(q[t0:t1].to(torch.float64), g, valid, sc, sk, d_v, nk, lk, vrow)
        parts.append(res)
        bounds.append(b)
        ne, na = ne + a1, na + a2
        del g, valid
    ne, na = int(ne), int(na)
    dev = q.device
    if not parts:
        e2 = torch.empty(0, H, dtype=torch.float64, device=dev)
        e3 = torch.empty(0, H, d_v, dtype=torch.float64, device=dev)
        parts = [(e3, e2, e2, e2, torch.empty(0, dtype=torch.int64, device=dev))]
        bounds = [{"out": e3, "lse": e2, "lse_with_sink": e2, "max_logits": e2}]
    cols = [torch.cat([p[i] for p in parts], dim=0) for i in range(5)]
    bound = {k: torch.cat([b[k] for b in bounds], dim=0) for k in BOUND_OUTPUTS}
    return FastOracleOut(cols[0], cols[1], cols[2], cols[3], cols[4].to(torch.int32), bound,
                         (ne / na) if na else 1.0)
