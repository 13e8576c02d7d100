"""Default cases of the ``v41_indexer_k_store`` stage (vLLM 0.33.0 DeepSeek-V4.1
``indexer_k_norm_rope_store``; reference ``caches.indexer_v41``).

Inputs: ``k_pre`` bf16 ``[T, 128]`` exact-norm rows (``query_quant.is_exact_norm_row``: the
kernel's RMS norm is exact on them, so the stage is bit-exact), ``positions`` int64 ``[T]``,
``cos_sin`` fp32 ``[max_pos, 64]``, ``weight`` bf16 ``[128]`` (realistic, E2M1 / E4M3 boundary
and tiny groups), ``eps`` 0.0, ``slots`` int64 ``[T]`` (distinct, permuted, ``-1`` padding and
non-boundary tokens), ``compress_ratio`` 1 | 2, ``record`` ``fp8`` | ``mxfp4``, ``cache`` uint8
``[num_blocks, block_size, row_bytes]`` stale garbage, ``block_size``.
"""

from __future__ import annotations

import torch

from ..caches.indexer_v41 import indexer_row_bytes
from ..constants import INDEXER_HEAD_DIM
from ..pipeline.rope import cos_sin_cache
from . import Case, register_cases
from .cache import garbage_bytes
from .v41_attention import exact_norm_rows

__all__ = ["v41_indexer_case"]


def _weight(g: torch.Generator, kind: str) -> torch.Tensor:
    w = 1.0 + 0.3 * torch.randn(INDEXER_HEAD_DIM, generator=g)
    if kind == "tiny":  # groups down to the MXFP4 amax floor region and the FP8 1e-4 floor
        w[:32] = w[:32] * 2.0**-120
        w[32:64] = w[32:64] * 2.0**-16
    elif kind == "ties":  # w in {0.75, 1.25, 1.5, 2.5}: values land on E2M1 / E4M3 ties after the norm
        w = torch.tensor([0.75, 1.25, 1.5, 2.5])[torch.randint(0, 4, (INDEXER_HEAD_DIM,), generator=g)]
    return w.to(torch.bfloat16)


def v41_indexer_case(name: str, seed: int, record: str, ratio: int, p0: int, t: int, bs: int, nb: int,
                     n_pad: int, weight: str) -> Case:
    g = torch.Generator().manual_seed(seed)
    T = t + n_pad
    pos = torch.cat((torch.arange(p0, p0 + t), torch.zeros(n_pad, dtype=torch.int64)))
    slots = torch.full((T,), -1, dtype=torch.int64)
    slots[:t] = torch.randperm(nb * bs, generator=g)[:t]
    skip = torch.rand(t, generator=g) < 0.15
    slots[:t][skip] = -1
    rb = indexer_row_bytes(record)
    inputs = {"k_pre": exact_norm_rows(g, T, INDEXER_HEAD_DIM), "positions": pos,
              "cos_sin": cos_sin_cache(p0 + t), "weight": _weight(g, weight), "eps": 0.0, "slots": slots,
              "compress_ratio": ratio, "record": record, "cache": garbage_bytes(g, (nb, bs, rb)), "block_size": bs}
    params = {"seed": seed, "record": record, "compress_ratio": ratio, "first_position": p0, "tokens": T,
              "n_pad": n_pad, "block_size": bs, "num_blocks": nb, "weight": weight}
    return Case(name, "v41_indexer_k_store", inputs, params)


@register_cases("v41_indexer_k_store")
def v41_indexer_cases() -> list[Case]:
    return [
        v41_indexer_case("fp8-cr2-bs4-realistic", 451, "fp8", 2, 3, 10, 4, 4, 2, "realistic"),
        v41_indexer_case("fp8-cr1-bs64-tiny", 452, "fp8", 1, 20, 8, 64, 1, 1, "tiny"),
        v41_indexer_case("mxfp4-cr2-bs4-ties", 453, "mxfp4", 2, 0, 9, 4, 4, 1, "ties"),
        v41_indexer_case("mxfp4-cr1-bs2-tiny", 454, "mxfp4", 1, 7, 6, 2, 4, 0, "tiny"),
    ]
