"""An optional Triton backend of the fast oracle's heavy steps: two fused float64 kernels per chunk in
place of the gather, the bfloat16-to-float64 conversion, the two GEMMs and the softmax passes of
``fast._softmax_pv`` (and of the slot-statistics gather of ``fast._row_tests``).

Why here: these kernels compute the fast oracle's own steps 1-3 and 5 (``fast_bound``) and their
bound is ``fast_bound``'s, so they live beside it, and every caller of ``fast_sparse_attention``
(the judge, the bench, the V4.1 wrappers) gets them without registering anything. ``reference``
stays pure PyTorch on every path that does not ask for them: Triton is imported only inside
``kernels()``, on the first fused call (a CUDA device, or ``TRITON_INTERPRET=1`` for the CPU tests);
nothing imports Triton at import time, and without Triton the fast oracle runs its PyTorch path.

Kernels, per chunk of ``c`` tokens (``softmax_pv``):

0. The table (segment rows, the zero row, q's rows) as float64, one exact conversion pass
   (``table64``; Triton 3.6 cannot compile a float64 dot of operands converted in registers from
   16-bit loads).
1. ``logits``: per (token, block of heads) the slots' float64 rows are read straight from the
   table by their table-row indices (invalid slots read the zero row), ``s = fl(scale * dot(q, k))`` with a float64 ``tl.dot`` (DMMA / FMA, blocks of ``BD``
   dims accumulated in a fixed loop, the order inside a block the hardware's), invalid slots set to
   ``-inf``, the row max ``m`` (a zero max made ``+0``, as the ordered oracle's accumulation from
   ``+0`` gives) and the logits written to a float64 ``[c, H, K]`` buffer; the first block of heads
   also writes the per-token maxima over the slots of the table rows' statistics (norm, ``log2 n -
   lsb``, ``max |v|``; ``fast_rows.row_stats``), the inputs of ``fast._row_tests``.
2. ``pv``: per (token, block of heads, block of ``d_v``) a second pass over the stored logits:
   ``p = exp(s - m)`` (``m`` replaced by 0 on lonely rows, whose logits are all ``-inf``: ``p = 0``),
   ``L = sum p`` and ``N = dot(p, V)`` in float64 (``want_abs``: ``sum p |v|``, as a bfloat16 dot
   of ``bf16(p)`` and ``|v|`` accumulated in float32 from a bfloat16 table, times
   ``bf16_abs_factor(K)``; else a float64 dot).

No online-softmax rescaling: the max is final before any ``exp``, as in the PyTorch path.

The bound for this order (``fast_bound``'s steps, what changes and why the coefficients do not):

- Step 1 (logits): each logit is a float64 dot product of the same ``D`` exact products (bf16 or
  float64 values converted exactly), accumulated in another order (blocks of ``BD`` dims in
  sequence, DMMA's fused multiply-adds inside a block) and multiplied by ``scale`` once. The step's
  error bound ``g_D A`` holds for any order of the ``D - 1`` additions, fused or not, and its
  exactness argument (every product and partial sum an exact multiple of ``2**(lq + lk)`` below
  ``2**(53 + lq + lk)``) for any order too: rows proven exact give the ordered oracle's logits bit
  for bit (and their ``max_logits``: the max is exact; a ``-0`` max is made ``+0`` here, as the
  PyTorch path's ``+0`` mask addition does). One rounding for ``scale``: the ``u`` the step allows.
- Step 2 (``p = exp(s - m)``): one float64 subtraction and ``exp`` (libdevice's ``__nv_exp``, within
  2 ulps, the function torch's CUDA ``exp`` calls; NumPy's under the interpreter): within ``eps_e``.
- Step 3 (``L``): ``K`` non-negative terms summed in float64 in blocks of ``BK`` (a tree inside a
  block, the blocks in sequence): one of the orders the step's ``g_K`` covers ("any order").
- Step 5 (``N = sum p v``): per output element ``K`` products accumulated by float64 ``tl.dot``
  in blocks of ``BK`` slots: again ``g_K`` for any order, fused or not.
- ``pv_abs`` (bfloat16 table): ``p`` rounded to bfloat16 (from float64 through float32, RNE twice:
  ``>= p (1 - 2**-24)(1 - 2**-8)``), ``|v|`` exact, the non-negative products accumulated in
  float32 in any order (``>= 1 - K 2**-22`` of their exact sum) and, unlike the bfloat16 GEMM of
  the PyTorch path, not rounded to bfloat16 afterwards: the product of these factors is at least
  ``(1 - 2**-8)**2 (1 - K 2**-22)``, so ``bf16_abs_factor(K)`` still makes it an upper bound.
  Other tables: a float64 dot of ``p`` and ``|v|``, within the ``out`` bound (step 5 as for ``V``).
- Steps 4, 6, 7 and the bounds' evaluation run unchanged (``fast._finish``).

So ``fast_bound.bound_coefficients`` applies as it stands: nothing is widened. The rows that need
the ordered logits (NaN/Inf, extreme magnitudes) are found by the same row tests and their chunk is
recomputed by ``fast._chunk_ordered`` (PyTorch, the ordered d-loop), as before: a chunk's fused
results are used only where every row keeps the fast logits, so every logit the kernels' results
stand on is finite.

3. ``finish``: steps 4-7 and the bounds for every token (``fast._finish``'s arithmetic and
   conventions in one kernel launch; its rounding analysis holds for any fused multiply-adds),
   ``N`` and ``Na`` divided in place.

Speed (one H200, 16 cores, ``host_launch_us`` 8.7, ``python -m dsv4_numerics.bench.gpu --quick``;
FlashMLA 0.069 / 0.150 ms at batch 128, h64 top-512 / h128 top-1024): the fused path is correct
(every output within its bound of the ordered oracle, ``max_logits`` bit-identical on exact rows)
but slower than the PyTorch path at batch 128 -- eager 1.59 / 2.83 ms (23.0x / 18.8x FlashMLA)
against 1.24 / 2.18 ms (18.0x / 14.5x), the judge's eager call 1.92 / 3.71 ms against 1.41 / 2.48
ms, replayed 1.35 / 2.88 ms against 1.10 / 2.14 ms -- and faster eagerly at batch 2, where the
host's launches dominate (0.79 / 0.91 ms against 1.14 / 1.17 ms). The kernels alone at batch 128:
logits 0.22 / 0.72 ms, exp/sum/PV 0.41 / 1.40 ms (0.69 / 2.21 ms with ``pv_abs``), the float64
table 0.09 / 0.14 ms, against 0.50 / 1.28 ms for two cuBLAS float64 ``bmm`` of gathered rows
(``bmm_fp64_ms``): Triton's float64 MMA reads float64 rows (four times the bytes of bfloat16) and
runs well below cuBLAS's. Hence ``fused=None`` leaves them off unless ``DSV4_FUSED_JUDGE=1``.

Memory: the ``[c, H, K]`` float64 logits and the ``[c, H, d_v]`` outputs (``want_abs``: one more),
within ``fast.peak_bytes_estimate_fast``, which also counts the gathered rows (``c K D (b + 8)``
bytes) this path never holds; in their place the float64 table, ``R D 8`` bytes, which the default
path accepts up to ``TABLE64_BYTES`` (512 MiB; production decode at batch 128: 84 MiB at h64
top-512, 134 MiB at h128 top-1024), else it runs the PyTorch path.
"""
from __future__ import annotations

import functools
import os

import torch

from .fast_bound import bf16_abs_gemm

__all__ = ["available", "default_on", "kernels", "softmax_pv", "finish", "table64", "ENV", "BLOCKS", "TABLE64_BYTES",
           "interpreting", "kernel_mode", "triton_importable", "interpreter_index_shim"]

TABLE64_BYTES = 2**29  # the default path takes the fused kernels only where the float64 table fits this
ENV = "DSV4_FUSED_JUDGE"  # "1": the fast oracle's default (fused=None) takes the fused kernels
# (BH heads, BK slots, BD dims) of the logits kernel; (BH, BK, BV d_v columns) of the PV kernel;
# warps of each; (BH, BV) of the finishing kernel and its warps
BLOCKS = {"logits": (32, 64, 32, 4), "pv": (64, 16, 128, 8), "finish": (8, 64, 8)}


def interpreting() -> bool:
    """Triton's CPU interpreter is on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=1)
def kernel_mode() -> bool:
    """Whether the kernels run under Triton's CPU interpreter: ``interpreting()`` when they were
    first loaded (``kernels()``), which is when Triton decided it (at their decoration); the value
    their ``INTERP`` argument takes, read once instead of from the environment at every launch."""
    return interpreting()


@functools.lru_cache(maxsize=1)
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: no fused backend
        return False
    return True


def available(device: torch.device) -> tuple[bool, str]:
    """``(usable, reason)`` of the fused kernels on ``device``: Triton importable, and a CUDA device
    (or the CPU under ``TRITON_INTERPRET=1``)."""
    if device.type not in ("cuda", "cpu"):
        return False, f"the Triton kernels run on CUDA devices (got {device.type})"
    if device.type == "cpu" and not interpreting():
        return False, "the Triton kernels run on the CPU only under TRITON_INTERPRET=1"
    if not triton_importable():
        return False, "Triton is not importable"
    return True, ""


def default_on(device: torch.device) -> bool:
    """Whether ``fast_sparse_attention(fused=None)`` takes the fused kernels: only where
    ``DSV4_FUSED_JUDGE=1`` asks for them, on a CUDA device with Triton importable. Off by default:
    on one H200 they are slower than the PyTorch path at production decode batch 128 (module
    docstring, "Speed")."""
    return device.type == "cuda" and os.environ.get(ENV, "0") == "1" and triton_importable()


def interpreter_index_shim() -> None:
    """Triton's CPU interpreter holds a scalar argument as a one-element 1-D NumPy array, and NumPy 2
    refuses ``int()`` of such an array, so a loop bounded by a runtime argument (``range(0, K, BK)``)
    fails there. Make the interpreter's ``__index__`` read the one element (the compiled kernels are
    not affected: this patches the interpreter module only)."""
    from triton.runtime import interpreter as ti

    if getattr(ti._patch_lang_tensor, "dsv4_index_shim", False):
        return
    orig = ti._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.dsv4_index_shim = True
    ti._patch_lang_tensor = patched


@functools.lru_cache(maxsize=1)
def kernels():
    """``(triton, logits_kernel, pv_kernel, finish_kernel)`` (``fast_fused_kernels``, compiled per signature on
    first launch). Imports Triton."""
    if kernel_mode():
        interpreter_index_shim()
    import triton

    from . import fast_fused_kernels as fk

    return triton, fk.logits_kernel, fk.pv_kernel, fk.finish_kernel


def softmax_pv(table: torch.Tensor, gidx: torch.Tensor, zrow: int, q0: int, H: int, fconst: torch.Tensor, d_v: int,
               stats: torch.Tensor, lim4: torch.Tensor, want_abs: bool = False, blocks: dict | None = None,
               table16: torch.Tensor | None = None):
    """Steps 1-3, ``N = sum p v`` and the row tests for one chunk of ``c`` tokens (module
    docstring), two kernel launches. ``table`` ``[R, D]`` (the fast oracle's table: segment rows,
    the zero row ``zrow``, q's rows from ``q0``: token ``t``, head ``h`` at row ``q0 + t H + h``),
    ``table`` is float64 (``table64``: the kernels read float64 rows), ``table16``: the bfloat16
    table it was converted from, or None (``pv_abs`` then takes the bfloat16 dot of its rows, when
    ``K < BF16_ABS_MAX_K``); ``fconst``: float64 ``[2]`` ``(scale, bf16_abs_factor(K))``
    (``fast._constants``).
    ``gidx`` ``[c, K]`` int64 table rows of the chunk's slots (invalid: ``zrow``), ``stats``:
    ``fast_rows.row_stats`` of the table (``[3, R]``), ``lim4``: ``fast._constants``' ``(la, le, 0,
    exact_bits)`` in the statistics' dtype. Returns ``(N [c, H, d_v], m [c, H, 1], L [c, H, 1], Na,
    tests)``: float64; ``Na`` (``want_abs``) ``sum_k p_k |v_k|`` as ``fast._softmax_tail`` defines
    it, else None; ``tests`` as ``fast._row_tests`` returns them, ``(x, vmax, both)`` (``x`` ``[c, H,
    1]`` and ``vmax`` ``[c, 1, 1]`` in the statistics' dtype, ``both`` ``[2, c, H, 1]`` uint8, 1:
    true: exact, fast). ``table``, ``gidx`` and ``stats`` contiguous."""
    triton, logits_kernel, pv_kernel, _ = kernels()
    c, K = gidx.shape
    R, D = table.shape
    dev = table.device
    bl = dict(BLOCKS, **(blocks or {}))
    bh, bk, bd, w1 = bl["logits"]
    s = torch.empty(c, H, K, dtype=torch.float64, device=dev)
    m = torch.empty(c, H, 1, dtype=torch.float64, device=dev)
    ks = torch.empty(3, c, 1, 1, dtype=stats.dtype, device=dev)
    x = torch.empty(c, H, 1, dtype=stats.dtype, device=dev)
    both = torch.empty(2, c, H, 1, dtype=torch.uint8, device=dev)
    logits_kernel[(c, triton.cdiv(H, bh))](table, gidx, stats, s, m, ks, lim4, x, both, q0, zrow, fconst,
                                           c, H, K, D, R, HAS_STATS=True, BH=bh, BK=bk, BD=bd, num_warps=w1)
    bh, bk, bv, w2 = bl["pv"]
    n = torch.empty(c, H, d_v, dtype=torch.float64, device=dev)
    L = torch.empty(c, H, 1, dtype=torch.float64, device=dev)
    abs_bf16 = want_abs and table16 is not None and bf16_abs_gemm(table16.dtype, K)
    na = torch.empty_like(n) if want_abs else n
    bv = min(bv, triton.next_power_of_2(d_v))
    pv_kernel[(c, triton.cdiv(H, bh), triton.cdiv(d_v, bv))](
        table, table16 if abs_bf16 else table, gidx, s, m, n, L, na, zrow, fconst, H, K, D, d_v,
        WANT_ABS=want_abs, ABS_BF16=abs_bf16, INTERP=kernel_mode(), BH=bh, BK=bk, BV=bv, num_warps=w2)
    return n, m, L, (na if want_abs else None), (x, ks[2], both)


def table64(table: torch.Tensor) -> torch.Tensor:
    """The table as float64 (exact; the table itself if it is float64): the kernels' operand. Triton
    3.6 cannot compile a float64 ``tl.dot`` whose operands are converted from 16-bit loads (its MMA
    lowering asserts "fp64 don't support largeK MMA"), so the conversion is one pass over the table
    (``R * D * 8`` bytes; ``TABLE64_BYTES`` bounds what the default path converts) instead of a
    conversion in registers."""
    return table if table.dtype == torch.float64 else table.to(torch.float64)


def finish(parts: list, n_valid: torch.Tensor, sink: torch.Tensor | None, coef20: torch.Tensor,
           fconst: torch.Tensor, blocks: dict | None = None):
    """``fast._finish_parts`` as one kernel launch (``fast_fused_kernels.finish_kernel``): steps 4-7,
    the bounds and the division of ``N`` (and ``Na``) in place, with ``fast._finish``'s conventions
    and return value. ``parts``: per chunk ``(N, m, L, x, vmax, Na)`` (several: concatenated first,
    as ``fast._finish_parts`` does), ``n_valid`` ``[T]``, ``coef20``: ``fast._constants``' float64
    ``[20]`` coefficients, ``fconst``: its float64 ``(scale, bf16_abs_factor(K))``. A bfloat16
    ``Na`` (``fast_passes``: the bfloat16 ``bmm`` of ``bf16(p)`` and ``|V|``) is converted to float64
    and multiplied by ``bf16_abs_factor(K)`` before its division, as the PyTorch path does (in the
    kernel where every chunk's is bfloat16; a chunk redone with the ordered logits brings a float64
    one, and then the bfloat16 ones are converted first)."""
    triton, _, _, finish_kernel = kernels()
    nas = {p[5].dtype for p in parts if p[5] is not None}
    if len(nas) > 1:  # mixed: every Na as the PyTorch path's float64 value
        parts = [(*p[:5], p[5].to(torch.float64).mul_(fconst[1]) if p[5].dtype == torch.bfloat16 else p[5])
                 for p in parts]
    if len(parts) == 1:
        N, m, L, x, vmax, Na = parts[0]
    else:
        N, m, L, x, vmax, Na = [c[0] if c[0] is None else torch.cat(c, dim=0) for c in zip(*parts)]
    T, H, DV = N.shape
    dev = N.device
    res = torch.empty(6, T, H, dtype=torch.float64, device=dev)  # lse, lse_with_sink, the four bounds
    na16 = Na is not None and Na.dtype == torch.bfloat16
    pv = torch.empty(N.shape, dtype=torch.float64, device=dev) if na16 else Na
    bh, bv, w = dict(BLOCKS, **(blocks or {}))["finish"]
    finish_kernel[(T, triton.cdiv(H, bh))](
        N, Na if Na is not None else N, pv if na16 else N, fconst, m, L, x.contiguous(), vmax.contiguous(), n_valid,
        sink.contiguous() if sink is not None else m, coef20, res, T, H, DV, HAS_SINK=sink is not None,
        WANT_ABS=Na is not None, NA_BF16=na16, INTERP=kernel_mode(), BH=bh, BV=bv, num_warps=w)
    lse, lws, b_lse, b_lws, b_max, b_out = res.unbind(0)
    return (N, lse, lws, m.view(T, H), pv), (b_lse, b_lws, b_max, b_out.view(T, H, 1))
