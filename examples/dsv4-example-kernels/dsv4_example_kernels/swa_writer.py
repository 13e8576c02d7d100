"""A 584-byte SWA KV-cache writer in plain PyTorch, written from the DSv4 datapath spec (not from
the dsv4-numerics reference).

Page layout (planar, page stride = ``cache.stride(0)`` bytes): ``block_size`` data rows of 576
bytes (448 FP8 E4M3FN NoPE codes, then the 64 RoPE dims as little-endian bf16), then
``block_size`` scale rows of 8 bytes (7 UE8M0 tile exponents, byte = e + 127, and a zero pad).
A token with ``slot >= 0`` goes to page ``slot // block_size``, entry ``slot % block_size``;
negative slots are skipped.

Tile scale: **Q_S** (``scale_rule=scale_clamp``): ``e = ceil(log2(max(fl32(amax / 448), 1e-4f)))``,
the rule of the CuTe-DSL compressor -- deliberately not the SWA stage's default Q_A
(``e = ceil(log2(fl32(max(amax, 1e-4f) / 448)))``). The two differ only for tiles with
``amax <= 0.02734375``, so this writer must declare ``policies={"scale_rule": "scale_clamp"}``.
"""

from __future__ import annotations

import torch

NOPE, ROPE, TILE = 448, 64, 64
DATA_ROW, SCALE_ROW = NOPE + 2 * ROPE, 8
E4M3_MAX = 448.0
SCALE_FLOOR = torch.tensor(1e-4, dtype=torch.float32)  # the 1e-4f floor


def _ceil_log2_f32(r: torch.Tensor) -> torch.Tensor:
    """Exact ``ceil(log2(r))`` of positive float32 values (frexp: r = m * 2**ex, m in [0.5, 1))."""
    m, ex = torch.frexp(r)
    return torch.where(m == 0.5, ex - 1, ex).to(torch.int64)


def tile_exponents(nope: torch.Tensor) -> torch.Tensor:
    """Q_S exponents ``[N, 7]`` of bf16 NoPE rows ``[N, 448]``."""
    amax = nope.to(torch.float32).abs().reshape(-1, NOPE // TILE, TILE).amax(-1)
    ratio = amax / torch.tensor(E4M3_MAX, dtype=torch.float32)  # fl32(amax / 448)
    return _ceil_log2_f32(torch.maximum(ratio, SCALE_FLOOR))


def encode_rows(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 rows ``[N, 512]`` -> (data rows uint8 ``[N, 576]``, scale rows uint8 ``[N, 8]``)."""
    n = k.shape[0]
    nope = k[:, :NOPE]
    e = tile_exponents(nope)
    scaled = nope.to(torch.float64).reshape(n, -1, TILE) * torch.pow(2.0, -e.to(torch.float64)).unsqueeze(-1)
    codes = scaled.clamp(-E4M3_MAX, E4M3_MAX).reshape(n, NOPE).to(torch.float8_e4m3fn).view(torch.uint8)
    rope = k[:, NOPE:].contiguous().view(torch.uint8).reshape(n, 2 * ROPE)  # little-endian bf16 bytes
    scales = torch.zeros(n, SCALE_ROW, dtype=torch.uint8)
    scales[:, : NOPE // TILE] = (e + 127).to(torch.uint8)
    return torch.cat([codes, rope], dim=1), scales


def write_swa_cache(k: torch.Tensor, slot_mapping: torch.Tensor, cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """Quantise ``k`` (bf16 ``[N, 512]``) into ``cache`` (uint8 ``[num_blocks, page_stride]``) in place."""
    if cache.dtype != torch.uint8 or cache.dim() != 2 or not cache.is_contiguous():
        raise ValueError("write_swa_cache: cache must be a contiguous uint8 [num_blocks, page_stride] tensor")
    slots = slot_mapping.to(torch.int64)[: k.shape[0]]
    keep = slots >= 0
    data, scales = encode_rows(k[: slots.shape[0]][keep].cpu())
    s = slots[keep].cpu()
    page, entry = s // block_size, s % block_size
    stride = cache.stride(0)
    flat = cache.view(-1)
    d0 = page * stride + entry * DATA_ROW
    s0 = page * stride + block_size * DATA_ROW + entry * SCALE_ROW
    flat[(d0.unsqueeze(1) + torch.arange(DATA_ROW)).reshape(-1).to(cache.device)] = data.reshape(-1).to(cache.device)
    flat[(s0.unsqueeze(1) + torch.arange(SCALE_ROW)).reshape(-1).to(cache.device)] = scales.reshape(-1).to(cache.device)
    return cache


def swa_write(inputs: dict) -> dict:
    """The canonical call of the ``swa_write`` stage (dsv4-numerics public API convention)."""
    return {"cache": write_swa_cache(inputs["k"], inputs["slot_mapping"], inputs["cache"], inputs["block_size"])}
