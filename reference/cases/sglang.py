"""Default cases of the ``kv_norm_rope_store`` stage (SGLang 0.5.23's KV RMSNorm + RoPE + unit-scale
E4M3 store into the plain FP8 pool; ``reference.pipeline.norm_rope_store``).

Inputs (CPU tensors / plain values):
    ``kv``         bfloat16 (one case float32) ``[T, 512]``: exact-norm rows (``v41_attention.
                   exact_norm_rows``; the kernel's tree-ordered sum and approximate ``rsqrt`` are then
                   exact, ``rrms = 1``) so the stored bytes are a bit-exact contract
    ``weight``     bfloat16 ``[512]``: one kind per 64-column tile (``_WEIGHT_KINDS``)
    ``eps``        0.0 (the exact-norm contract)
    ``cos_sin``    fp32 ``[max_pos, 64]`` (``rope.cos_sin_cache``, theta 1e4)
    ``positions``  int64 ``[T]`` in ``[0, max_pos)``
    ``slots``      int64 ``[T]``: distinct pool rows in a permuted order; the ``negative`` case adds
                   ``-1``, ``-rows`` and another negative value (rows ``rows - 1``, ``0``, ...)
    ``cache``      uint8 ``[rows, 512]``: stale garbage before the write (rows not written are compared too)
"""

from __future__ import annotations

import torch

from ..cases import Case, register_cases
from ..constants import HEAD_DIM
from ..pipeline.rope import cos_sin_cache
from .v41_attention import exact_norm_rows

__all__ = ["WEIGHT_KINDS", "norm_rope_store_case", "norm_rope_store_cases"]

_TILE = 64
_MAX_POS = 1024  # a [1024, 64] fp32 table: 256 KiB, so each case fits a fixture
# realistic: N(1, 0.25) (kv_norm weights near 1); ties: 5 significant bits, so the E4M3 rounding of
# x*w (x in {0, +-1/2, +-1, +-2}) meets ties; saturate: |w| in [230, 1000), |x*w| beyond 448 and the
# 464 midpoint (Triton's satfinite store: +-448; torch 2.11's cast: NaN); tiny: E4M3 subnormals
WEIGHT_KINDS = ("realistic", "ties", "saturate", "tiny")


def _weight(g: torch.Generator) -> torch.Tensor:
    w = torch.empty(HEAD_DIM, dtype=torch.float64)
    n = _TILE
    for j in range(HEAD_DIM // n):
        kind = WEIGHT_KINDS[j % len(WEIGHT_KINDS)]
        sl = slice(j * n, (j + 1) * n)
        sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
        if kind == "realistic":
            w[sl] = 1.0 + 0.25 * torch.randn(n, generator=g, dtype=torch.float64)
        elif kind == "ties":
            m = torch.randint(16, 32, (n,), generator=g).to(torch.float64)
            w[sl] = sign * m * torch.pow(2.0, torch.randint(-8, 2, (n,), generator=g).to(torch.float64))
        elif kind == "saturate":
            w[sl] = sign * (230.0 + 770.0 * torch.rand(n, generator=g, dtype=torch.float64))
        else:  # tiny: |x*w| around 2**-12 .. 2**-7
            w[sl] = sign * (1 + torch.rand(n, generator=g, dtype=torch.float64)) * torch.pow(
                2.0, torch.randint(-12, -7, (n,), generator=g).to(torch.float64))
    return w.to(torch.bfloat16)


def norm_rope_store_case(name: str, seed: int, t: int, rows: int, *, negative: bool = False,
                         dtype: torch.dtype = torch.bfloat16, edge: str = "") -> Case:
    """A ``kv_norm_rope_store`` case of ``t`` tokens into a pool of ``rows`` rows (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    kv = exact_norm_rows(g, t, HEAD_DIM).to(dtype)
    slots = torch.randperm(rows, generator=g)[:t].to(torch.int64)
    if negative:  # -1 -> row rows-1, -rows -> row 0, -3 -> row rows-3; none of them written otherwise
        slots = torch.randperm(rows - 6, generator=g)[:t].to(torch.int64) + 3
        slots[:3] = torch.tensor([-1, -rows, -3])
        slots = slots[torch.randperm(t, generator=g)]
    inputs = {"kv": kv, "weight": _weight(g), "eps": 0.0, "cos_sin": cos_sin_cache(_MAX_POS),
              "positions": torch.randint(0, _MAX_POS, (t,), generator=g, dtype=torch.int64), "slots": slots,
              "cache": torch.randint(0, 256, (rows, HEAD_DIM), generator=g, dtype=torch.int64).to(torch.uint8)}
    params = {"seed": seed, "tokens": t, "rows": rows, "dtype": str(dtype).replace("torch.", ""), "eps": 0.0,
              "max_pos": _MAX_POS, "weight_kinds": list(WEIGHT_KINDS), "negative_slots": negative, "edge": edge}
    return Case(name, "kv_norm_rope_store", inputs, params)


@register_cases("kv_norm_rope_store")
def norm_rope_store_cases() -> list[Case]:
    return [
        norm_rope_store_case("t8-bf16-rows64", 601, 8, 64,
                             edge="realistic, E4M3-tie, saturating and subnormal weight tiles; stale pool rows"),
        norm_rope_store_case("t6-negative-slots-rows32", 602, 6, 32, negative=True,
                             edge="slots -1, -rows and -3: written at rows-1, 0 and rows-3 (PyTorch's index)"),
        norm_rope_store_case("t4-fp32-kv-rows16", 603, 4, 16, dtype=torch.float32,
                             edge="fp32 kv: the roped fp32 dims go to E4M3 without the bf16 rounding"),
    ]
