"""The ordered oracle's fixed-order loops in one GPU launch each, with the same bits.

``reference.attention.ordered`` accumulates its three loops one step at a time with PyTorch
operations: the logits over ``d = 0 .. D-1`` (``scaled_logits``), the row sum and ``P @ V`` over
the slots ``k = 0 .. K-1`` (``seq_sum_last``, ``seq_pv``). Each step is one or two device
operations on the whole chunk, so on a GPU a call costs thousands of launches: 1.0-1.75 s of host
time for one batch-128, top-2048 decode case of the same-precision (BF16_P) oracle on one H200.

The Triton kernels here compute the same per-element recurrences in one launch per loop (one
kernel for the two sums of products, one for the row sum): every
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

from dsv4_numerics.reference.attention.fast_passes import block

ENV = "DSV4_ORDERED_LOOPS"
_MAX_GRID_Z = 65535  # CUDA's limit on the third grid dimension (tokens of a chunk)


@functools.lru_cache(maxsize=1)
def _kernels():
    """The two Triton kernels (compiled on first use); raises ImportError without Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def products(a_ptr, b_ptr, o_ptr, I, J, R, sac, sai, sar, sbc, sbr, sbj, soc, soi, soj,
                 BI: tl.constexpr, BJ: tl.constexpr):
        # o[c, i, j] = sum_{r = 0 .. R-1} a[c, i, r] * b[c, r, j], from +0, in order (the logits:
        # a = q, b = the rows transposed, r = d; P @ V: a = p, b = v, r = k)
        c = tl.program_id(2).to(tl.int64)
        i_s = tl.program_id(0) * BI + tl.arange(0, BI)
        j_s = tl.program_id(1) * BJ + tl.arange(0, BJ)
        im = i_s < I
        jm = j_s < J
        ap = a_ptr + c * sac + i_s.to(tl.int64) * sai
        bp = b_ptr + c * sbc + j_s.to(tl.int64) * sbj
        acc = tl.zeros([BI, BJ], dtype=tl.float64)
        for r in tl.range(0, R):
            ar = tl.load(ap + r * sar, mask=im, other=0.0)
            br = tl.load(bp + r * sbr, mask=jm, other=0.0)
            acc = acc + ar[:, None] * br[None, :]
        op = o_ptr + c * soc + i_s[:, None].to(tl.int64) * soi + j_s[None, :].to(tl.int64) * soj
        tl.store(op, acc, mask=im[:, None] & jm[None, :])

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

    return triton, products, row_sum


def _products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_r a[c, i, r] b[c, r, j]`` over ``r`` in order: ``[c, I, J]`` float64 (any strides)."""
    triton, products, _ = _kernels()
    c, I, R = a.shape
    J = b.shape[2]
    out = torch.empty(c, I, J, dtype=torch.float64, device=a.device)
    BI, BJ = block(I, 32), block(J, 64)
    grid = (triton.cdiv(I, BI), triton.cdiv(J, BJ), c)
    products[grid](a, b, out, I, J, R, *a.stride(), *b.stride(), *out.stride(), BI=BI, BJ=BJ,
                   enable_fp_fusion=False)
    return out


def scaled_logits_unscaled(qc: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``sum_d qc[c, h, d] g[c, k, d]`` over ``d`` in order: ``[c, H, K]`` float64 (the ordered
    ``scaled_logits`` before its ``* scale``)."""
    return _products(qc, g.transpose(1, 2))


def seq_sum_last(x: torch.Tensor) -> torch.Tensor:
    """``sum_k x[c, h, k]`` over ``k`` in order: ``[c, H]`` float64."""
    triton, _, row_sum = _kernels()
    c, H, K = x.shape
    out = torch.empty(c, H, dtype=torch.float64, device=x.device)
    BH = block(H, 128)
    row_sum[(triton.cdiv(H, BH), c)](x, out, H, K, *x.stride(), *out.stride(), BH=BH, enable_fp_fusion=False)
    return out


def seq_pv(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``sum_k p[c, h, k] v[c, k, j]`` over ``k`` in order: ``[c, H, dv]`` float64."""
    return _products(p, v)


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
