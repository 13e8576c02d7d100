"""The ordered oracle's fixed-order loops in one GPU launch each, with the same bits.

``reference.attention.ordered`` accumulates its three loops one step at a time with PyTorch
operations: the logits over ``d = 0 .. D-1`` (``scaled_logits``), the row sum and ``P @ V`` over
the slots ``k = 0 .. K-1`` (``seq_sum_last``, ``seq_pv``). Each step is one or two device
operations on the whole chunk, so on a GPU a call costs thousands of launches: 1.0-1.75 s of host
time for one batch-128, top-2048 decode case of the same-precision (BF16_P) oracle on one H200.

The Triton kernels here compute the same per-element recurrences in one launch per loop: every
output element is owned by one lane, which starts from ``+0`` and applies, in the same order, the
same IEEE float64 operations as the PyTorch loop (a multiply rounded to float64, then an add
rounded to float64; compiled with ``enable_fp_fusion=False`` so no multiply-add is contracted into
an FMA, and float64 arithmetic on NVIDIA GPUs never flushes subnormals). Each element's result is
therefore the PyTorch loop's, bit for bit, whatever the values (signed zeros, subnormals, Inf, NaN);
``tests/oracles/test_ordered_loops.py`` compares them on adversarial values (on a GPU, and with
Triton's interpreter on a CPU).

``install()`` makes the ordered oracle use them for CUDA float64 tensors (the judge calls it when
its reference runs on a CUDA device); anything else (a CPU tensor, float32 chains, an empty or
oversized grid) stays with the PyTorch loop. ``DSV4_ORDERED_LOOPS=torch`` keeps every loop in
PyTorch. Triton is imported only when a CUDA tensor first reaches a loop.
"""

from __future__ import annotations

import functools
import os

import torch

ENV = "DSV4_ORDERED_LOOPS"
_MAX_GRID_Z = 65535  # CUDA's limit on the third grid dimension (tokens of a chunk)


@functools.lru_cache(maxsize=1)
def _kernels():
    """The three Triton kernels (compiled on first use); raises ImportError without Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def dots(q_ptr, g_ptr, o_ptr, H, K, D, sqc, sqh, sqd, sgc, sgk, sgd, soc, soh, sok,
             BH: tl.constexpr, BK: tl.constexpr):
        # o[c, h, k] = sum_{d = 0 .. D-1} q[c, h, d] * g[c, k, d], from +0, in order
        c = tl.program_id(2).to(tl.int64)
        hs = tl.program_id(0) * BH + tl.arange(0, BH)
        ks = tl.program_id(1) * BK + tl.arange(0, BK)
        hm = hs < H
        km = ks < K
        qp = q_ptr + c * sqc + hs.to(tl.int64) * sqh
        gp = g_ptr + c * sgc + ks.to(tl.int64) * sgk
        acc = tl.zeros([BH, BK], dtype=tl.float64)
        for d in tl.range(0, D):
            qd = tl.load(qp + d * sqd, mask=hm, other=0.0)
            gd = tl.load(gp + d * sgd, mask=km, other=0.0)
            acc = acc + qd[:, None] * gd[None, :]
        op = o_ptr + c * soc + hs[:, None].to(tl.int64) * soh + ks[None, :].to(tl.int64) * sok
        tl.store(op, acc, mask=hm[:, None] & km[None, :])

    @triton.jit
    def row_sum(x_ptr, o_ptr, H, K, sxc, sxh, sxk, soc, soh, BH: tl.constexpr):
        # o[c, h] = sum_{k = 0 .. K-1} x[c, h, k], from +0, in order
        c = tl.program_id(1).to(tl.int64)
        hs = tl.program_id(0) * BH + tl.arange(0, BH)
        hm = hs < H
        xp = x_ptr + c * sxc + hs.to(tl.int64) * sxh
        acc = tl.zeros([BH], dtype=tl.float64)
        for k in tl.range(0, K):
            acc = acc + tl.load(xp + k * sxk, mask=hm, other=0.0)
        tl.store(o_ptr + c * soc + hs.to(tl.int64) * soh, acc, mask=hm)

    @triton.jit
    def pv(p_ptr, v_ptr, o_ptr, H, K, DV, spc, sph, spk, svc, svk, svj, soc, soh, soj,
           BH: tl.constexpr, BJ: tl.constexpr):
        # o[c, h, j] = sum_{k = 0 .. K-1} p[c, h, k] * v[c, k, j], from +0, in order
        c = tl.program_id(2).to(tl.int64)
        hs = tl.program_id(0) * BH + tl.arange(0, BH)
        js = tl.program_id(1) * BJ + tl.arange(0, BJ)
        hm = hs < H
        jm = js < DV
        pp = p_ptr + c * spc + hs.to(tl.int64) * sph
        vp = v_ptr + c * svc + js.to(tl.int64) * svj
        acc = tl.zeros([BH, BJ], dtype=tl.float64)
        for k in tl.range(0, K):
            pk = tl.load(pp + k * spk, mask=hm, other=0.0)
            vk = tl.load(vp + k * svk, mask=jm, other=0.0)
            acc = acc + pk[:, None] * vk[None, :]
        op = o_ptr + c * soc + hs[:, None].to(tl.int64) * soh + js[None, :].to(tl.int64) * soj
        tl.store(op, acc, mask=hm[:, None] & jm[None, :])

    return triton, dots, row_sum, pv


def _block(n: int, cap: int) -> int:
    """The power of two covering ``n`` (at least 16, at most ``cap``)."""
    b = 16
    while b < n and b < cap:
        b *= 2
    return b


def scaled_logits_unscaled(qc: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``sum_d qc[c, h, d] g[c, k, d]`` over ``d`` in order: ``[c, H, K]`` float64 (the ordered
    ``scaled_logits`` before its ``* scale``)."""
    triton, dots, _, _ = _kernels()
    c, H, D = qc.shape
    K = g.shape[1]
    out = torch.empty(c, H, K, dtype=torch.float64, device=qc.device)
    BH, BK = _block(H, 32), _block(K, 64)
    grid = (triton.cdiv(H, BH), triton.cdiv(K, BK), c)
    dots[grid](qc, g, out, H, K, D, *qc.stride(), *g.stride(), *out.stride(), BH=BH, BK=BK,
               enable_fp_fusion=False)
    return out


def seq_sum_last(x: torch.Tensor) -> torch.Tensor:
    """``sum_k x[c, h, k]`` over ``k`` in order: ``[c, H]`` float64."""
    triton, _, row_sum, _ = _kernels()
    c, H, K = x.shape
    out = torch.empty(c, H, dtype=torch.float64, device=x.device)
    BH = _block(H, 128)
    row_sum[(triton.cdiv(H, BH), c)](x, out, H, K, *x.stride(), *out.stride(), BH=BH, enable_fp_fusion=False)
    return out


def seq_pv(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``sum_k p[c, h, k] v[c, k, j]`` over ``k`` in order: ``[c, H, dv]`` float64."""
    triton, _, _, pv = _kernels()
    c, H, K = p.shape
    dv = v.shape[2]
    out = torch.empty(c, H, dv, dtype=torch.float64, device=p.device)
    BH, BJ = _block(H, 32), _block(dv, 64)
    grid = (triton.cdiv(H, BH), triton.cdiv(dv, BJ), c)
    pv[grid](p, v, out, H, K, dv, *p.stride(), *v.stride(), *out.stride(), BH=BH, BJ=BJ, enable_fp_fusion=False)
    return out


def backend(name: str, *args):
    """The loop backend ``reference.attention.ordered.set_loop_backend`` takes: the Triton loop for
    CUDA float64 operands of a non-empty grid, else None (the PyTorch loop runs). The
    ``exact_products`` flag of ``scaled_logits`` / ``seq_pv`` needs no branch here: with every
    multiply rounded before its add, an exact product gives the FMA's bits too."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not all(t.is_cuda and t.dtype == torch.float64 for t in tensors):
        return None
    if any(t.numel() == 0 for t in tensors) or tensors[0].shape[0] > _MAX_GRID_Z:
        return None
    if name == "scaled_logits":
        return scaled_logits_unscaled(args[0], args[1])
    if name == "seq_sum_last":
        return seq_sum_last(args[0])
    if name == "seq_pv":
        return seq_pv(args[0], args[1])
    return None


def available() -> tuple[bool, str]:
    """Whether the Triton loops can serve this process, and why not."""
    if os.environ.get(ENV, "").strip().lower() == "torch":
        return False, f"{ENV}=torch"
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "triton is not installed"
    return True, ""


def install() -> bool:
    """Make the ordered oracle run its loops here for CUDA tensors (idempotent). False, with the
    PyTorch loops left in place, where ``available()`` says no."""
    from dsv4_numerics.reference.attention import ordered

    ok, _ = available()
    if ok:
        ordered.set_loop_backend(backend)
    elif ordered.loop_backend() is backend:
        ordered.set_loop_backend(None)
    return ok


__all__ = ["ENV", "available", "backend", "install", "scaled_logits_unscaled", "seq_pv", "seq_sum_last"]
