"""Default cases of the ``v41_compress_insert`` stage: vLLM 0.33.0's DeepSeek-V4.1
``fused_save_compress_norm`` then ``rope_quant_insert`` (``reference.pipeline.compressor_v41``).

Inputs (CPU tensors / plain values; ``T`` packed tokens, the last ``n_pad`` of them CUDA-graph
padding with every slot ``-1``):
    ``kv_score``              fp32 ``[T, 512 * r]`` (``[kv | score]`` for r = 2, ``kv`` for r = 1)
    ``positions``             int64 ``[T]``
    ``state_cache``           fp32 ``[blocks, capacity, 1024]`` ring (r = 2; random prior rows) or None
    ``state_slots``           int64 ``[T]``: ring slots ``block * capacity + p % capacity`` (r = 2,
                              one permuted block per request, ``-1`` for a request without state)
                              or the main-cache slots (r = 1)
    ``query_start_loc``       int32 ``[R + 1]``, ``token_to_req_indices`` int32 ``[T]`` (r = 2) or None
    ``norm_weight``           bf16 ``[512]``; ``eps`` float; ``compress_ratio`` 1 | 2
    ``cos_sin``               fp32 ``[max_pos, 64]`` (``rope.cos_sin_cache``)
    ``cache_slots``           int64 ``[T]``: the compressed-cache slots ``rope_quant_insert`` reads
                              (distinct for the group ends, ``-1`` elsewhere; r = 1: ``state_slots``)
    ``record``                one of ``compressor_v41.V41_INSERT_RECORDS``
    ``cache``                 uint8 ``[num_blocks, page_stride]`` stale garbage (records), bf16 /
                              uint8 ``[num_blocks, bs, 512]`` (plain bf16 / FP8)
    ``block_size``, ``num_blocks``; ``fp8_scale`` float (plain_fp8: a power of two) or None
Chunks exercise: a chunk whose first token closes a group with its ring predecessor, chunks
starting on a group start, a one-token chunk, a request without state, padding tokens, ring
capacities 2 and 4 (the tail store keeps the last ``min(len, capacity)`` rows).
"""

from __future__ import annotations

import torch

from ..caches.v41 import record_bytes
from ..constants import HEAD_DIM, RECORD_BYTES
from ..pipeline.rope import cos_sin_cache
from . import Case, register_cases
from .cache import garbage_bytes

__all__ = ["v41_compress_case"]


def v41_compress_case(name: str, seed: int, record: str, ratio: int, chunks: list[tuple[int, int, bool]],
                      capacity: int, bs: int, nb: int, n_pad: int, fp8_scale: float | None = None,
                      tail: int = 0) -> Case:
    """One case; ``chunks``: ``(first position, length, has_state)`` per request."""
    g = torch.Generator().manual_seed(seed)
    n_real = sum(n for _, n, _ in chunks)
    T = n_real + n_pad
    pos = torch.zeros(T, dtype=torch.int64)
    req = torch.zeros(T, dtype=torch.int32)
    qsl = [0]
    state_slots = torch.full((T,), -1, dtype=torch.int64)
    blocks = torch.randperm(len(chunks) + 1, generator=g)
    t = 0
    for r, (p0, n, has_state) in enumerate(chunks):
        pos[t:t + n] = torch.arange(p0, p0 + n)
        req[t:t + n] = r
        if has_state:
            state_slots[t:t + n] = blocks[r] * capacity + pos[t:t + n] % capacity if ratio == 2 else 0
        t += n
        qsl.append(t)
    kv = torch.randn(T, HEAD_DIM, generator=g) * torch.exp2(torch.randint(-3, 4, (T, 1), generator=g).float())
    parts = [kv]
    if ratio == 2:
        parts.append(torch.randn(T, HEAD_DIM, generator=g) * 3.0)
    kv_score = torch.cat(parts, dim=1).contiguous()
    ends = ((pos + 1) % ratio == 0) & (state_slots >= 0)
    cache_slots = torch.full((T,), -1, dtype=torch.int64)
    picked = torch.randperm(nb * bs, generator=g)[:int(ends.sum())]
    cache_slots[ends] = picked
    if ratio == 1:
        state_slots = cache_slots.clone()
    if record in ("plain_bf16", "plain_fp8"):
        cache = (torch.randn(nb, bs, HEAD_DIM, generator=g).to(torch.bfloat16) if record == "plain_bf16"
                 else garbage_bytes(g, (nb, bs, HEAD_DIM)))
        stride = None
    else:
        rb = RECORD_BYTES if record == "model1_584" else record_bytes(record)
        stride = bs * rb + tail
        cache = garbage_bytes(g, (nb, stride))
    norm_weight = (1.0 + 0.25 * torch.randn(HEAD_DIM, generator=g)).to(torch.bfloat16)
    state = torch.randn(len(chunks) + 1, capacity, 2 * HEAD_DIM, generator=g) if ratio == 2 else None
    inputs = {
        "kv_score": kv_score, "positions": pos, "state_cache": state, "state_slots": state_slots,
        "query_start_loc": torch.tensor(qsl, dtype=torch.int32) if ratio == 2 else None,
        "token_to_req_indices": req if ratio == 2 else None, "norm_weight": norm_weight, "eps": 1e-6,
        "compress_ratio": ratio, "cos_sin": cos_sin_cache(int(pos.max()) + 1),
        "cache_slots": cache_slots, "record": record, "cache": cache, "block_size": bs, "num_blocks": nb,
        "fp8_scale": fp8_scale,
    }
    params = {"seed": seed, "record": record, "compress_ratio": ratio, "chunks": [list(c) for c in chunks],
              "capacity": capacity, "block_size": bs, "num_blocks": nb, "page_stride": stride, "n_pad": n_pad,
              "n_tokens": T, "n_latents": int(ends.sum()), "fp8_scale": fp8_scale}
    return Case(name, "v41_compress_insert", inputs, params)


@register_cases("v41_compress_insert")
def v41_compress_insert_cases() -> list[Case]:
    return [
        v41_compress_case("cr2-mxfp8-cap2-ring-first-one-token", 441, "mxfp8_528", 2,
                          [(5, 6, True), (0, 4, True), (9, 1, True)], capacity=2, bs=4, nb=4, n_pad=2, tail=16),
        v41_compress_case("cr2-nvfp4-cap4-no-state-request", 442, "nvfp4_288", 2,
                          [(2, 5, True), (7, 3, True), (0, 2, False)], capacity=4, bs=4, nb=3, n_pad=1),
        v41_compress_case("cr1-fp8-584-padding", 443, "model1_584", 1, [(0, 5, True), (12, 3, True)],
                          capacity=1, bs=4, nb=3, n_pad=1),
        v41_compress_case("cr1-plain-bf16", 444, "plain_bf16", 1, [(3, 4, True)], capacity=1, bs=2, nb=4, n_pad=1),
        v41_compress_case("cr2-plain-fp8-scale-quarter", 445, "plain_fp8", 2, [(1, 4, True), (6, 3, True)],
                          capacity=2, bs=2, nb=4, n_pad=0, fp8_scale=0.25),
    ]
