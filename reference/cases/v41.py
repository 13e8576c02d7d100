"""Default cases of the DeepSeek-V4.1 cache stages ``v41_write`` and ``v41_gather`` (datapath 1.6,
4.5, H13).

Inputs (CPU tensors / plain values), as ``cases_cache`` writes them for ``swa_write`` plus the record:
    ``k``             bfloat16 ``[N, 512]`` (all dims quantised, RoPE included)
    ``slot_mapping``  int64 ``[N]``: distinct global slots in a permuted order, ``-1`` padding
    ``block_size``, ``num_blocks``, ``page_stride``: ints
    ``record``        ``"mxfp8_528"`` | ``"nvfp4_288"`` (``reference.policies.V41Record``)
    ``cache``         uint8 ``[num_blocks, page_stride]``: stale garbage before the write
The byte order and the quantisation rules are the writer's policies (``v41_layout``,
``scale_rule``, ``nvfp4_rule``), not case inputs.

``v41_gather`` inputs: ``cache`` uint8 ``[num_blocks, page_stride]`` written by ``cache_v41.insert``
(the vLLM 0.33.0 producer: interleaved, AMAX_CLAMP / RECIP_MUL) over stale garbage, ``record``,
``block_table`` int32 (permuted pages, a spare column of garbage ids), ``seq_lens`` / ``gather_lens``
int32 ``[R]`` (or None), ``offset``, ``block_size``, ``num_blocks``, ``page_stride``,
``written_slots`` (every gathered position's slot is among them; other slots hold stale bytes).

Row kinds: those of ``cases_cache.make_rows`` (realistic, tiny, boundary, ties, zeros,
subnormal, huge: their 64-wide tile constructions hold for the 32- and 16-wide V4.1 groups in
amax range), plus ``e2m1_ties``: every 16-group with amax ``6 * s`` for an E4M3 scale ``s``
(normal or subnormal) and the other elements on E2M1 ties ``t * s`` (t = 0.25 .. 5), signs mixed.
"""

from __future__ import annotations

import torch

from ..caches.v41 import PRODUCERS, insert, record_bytes
from ..cases import Case, register_cases
from .cache import garbage_bytes, slot_kinds, shuffled, slots_with_padding, gather_rows, gather_tables, make_rows
from ..constants import E2M1_MAX, HEAD_DIM, V41_NVFP4_GROUP
from ..formats.fp4 import E2M1_MAGNITUDES
from ..formats.fp8 import decode_e4m3fn
from ..policies import V41Record

__all__ = ["e2m1_tie_rows"]

_TIES = [(a + b) / 2 for a, b in zip(E2M1_MAGNITUDES, E2M1_MAGNITUDES[1:])]


def e2m1_tie_rows(g: torch.Generator, n: int) -> torch.Tensor:
    """bf16 ``[n, 512]``: per 16-group a drawn E4M3 scale byte ``b`` in [0x01, 0x6E], element 0 at
    ``6 * s`` and the others at ``+-t * s`` for E2M1 ties ``t`` (exact in bf16: <= 7 significant bits)."""
    groups = HEAD_DIM // V41_NVFP4_GROUP
    byte = torch.randint(0x01, 0x6F, (n, groups), generator=g, dtype=torch.int64).to(torch.uint8)
    s = decode_e4m3fn(byte).to(torch.float64).unsqueeze(-1)
    t = torch.tensor(_TIES, dtype=torch.float64)[torch.randint(0, len(_TIES), (n, groups, V41_NVFP4_GROUP), generator=g)]
    sign = torch.where(torch.rand((n, groups, V41_NVFP4_GROUP), generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    vals = t * sign * s
    vals[..., 0] = E2M1_MAX * s[..., 0]
    out = vals.reshape(n, HEAD_DIM)
    bf = out.to(torch.bfloat16)
    if not torch.equal(bf.to(torch.float64), out):
        raise AssertionError("e2m1_tie_rows: a tie value is not bf16-exact")
    return bf


def _v41_case(name: str, seed: int, record: V41Record, bs: int, nb: int, rows: dict[str, int], n_pad: int,
              tail: int = 0) -> Case:
    g = torch.Generator().manual_seed(seed)
    n_ties = rows.get("e2m1_ties", 0)
    kinds = shuffled(g, slot_kinds({k: v for k, v in rows.items() if k != "e2m1_ties"}))
    parts = [make_rows(g, kinds)] if kinds else []
    if n_ties:
        parts.append(e2m1_tie_rows(g, n_ties))
    k = torch.cat(parts)
    k = k[torch.randperm(k.shape[0], generator=g)]
    stride = bs * record_bytes(record) + tail
    slot_mapping = slots_with_padding(g, nb * bs, k.shape[0], n_pad)
    if slot_mapping.shape[0] > k.shape[0]:
        k = torch.cat([k, make_rows(g, ["realistic"] * (slot_mapping.shape[0] - k.shape[0]))])
    params = {"seed": seed, "block_size": bs, "page_stride": stride, "num_blocks": nb, "record": record.value,
              "n_tokens": int(slot_mapping.shape[0]), "n_written": int((slot_mapping >= 0).sum()), "rows": rows}
    inputs = {"k": k, "slot_mapping": slot_mapping, "block_size": bs, "num_blocks": nb, "page_stride": stride,
              "record": record.value, "cache": garbage_bytes(g, (nb, stride))}
    return Case(name, "v41_write", inputs, params)


@register_cases("v41_write")
def v41_write_cases() -> list[Case]:
    mx, nv = V41Record.MXFP8, V41Record.NVFP4
    return [
        _v41_case("mxfp8-bs64-realistic-tiny", 401, mx, 64, 2,
                  {"realistic": 40, "tiny": 12, "boundary": 8, "ties": 8, "zeros": 2}, 4),
        _v41_case("mxfp8-bs2-edge-tail40", 402, mx, 2, 12, {"subnormal": 6, "huge": 4, "realistic": 6}, 2, tail=40),
        _v41_case("nvfp4-bs64-ties-realistic", 403, nv, 64, 2, {"e2m1_ties": 24, "realistic": 24, "zeros": 2}, 3),
        _v41_case("nvfp4-bs2-tiny-tail8", 404, nv, 2, 12, {"e2m1_ties": 8, "tiny": 8, "realistic": 4}, 2, tail=8),
    ]


def _v41_gather_case(name: str, seed: int, record: V41Record, bs: int, seq_lens: list[int],
                     gather_lens: list[int] | None, offset: int, extra_pages: int, rows_mix: dict[str, float],
                     tail: int = 0) -> Case:
    g = torch.Generator().manual_seed(seed)
    table, slots, nb = gather_tables(g, bs, seq_lens, gather_lens, extra_pages)
    k, slot_t = gather_rows(g, slots, rows_mix)
    vllm = PRODUCERS["vllm_0.33.0"]
    stride = bs * record_bytes(record) + tail
    cache = insert(garbage_bytes(g, (nb, stride)), k, slot_t, bs, record, vllm.layout, vllm.mxfp8_rule,
                   vllm.mxfp8_nonfinite if record is V41Record.MXFP8 else vllm.nvfp4_nonfinite, vllm.nvfp4_rule)
    params = {"seed": seed, "block_size": bs, "page_stride": stride, "num_blocks": nb, "record": record.value,
              "seq_lens": seq_lens, "gather_lens": gather_lens, "offset": offset, "rows": rows_mix,
              "written_by": "cache_v41.insert(producer=vllm_0.33.0)", "n_written": len(slots)}
    inputs = {"cache": cache, "record": record.value, "block_table": table.to(torch.int32),
              "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
              "gather_lens": None if gather_lens is None else torch.tensor(gather_lens, dtype=torch.int32),
              "offset": offset, "block_size": bs, "num_blocks": nb, "page_stride": stride, "written_slots": slot_t}
    return Case(name, "v41_gather", inputs, params)


@register_cases("v41_gather")
def v41_gather_cases() -> list[Case]:
    mx, nv = V41Record.MXFP8, V41Record.NVFP4
    return [
        _v41_gather_case("mxfp8-bs64-2req-full", 411, mx, 64, [90, 20], None, 0, 1, {"tiny": 0.1, "zeros": 0.05}),
        _v41_gather_case("mxfp8-bs2-window-offset3-tail40", 412, mx, 2, [9, 4, 1], [6, 4, 0], 3, 2,
                         {"subnormal": 0.2, "huge": 0.1}, tail=40),
        _v41_gather_case("nvfp4-bs64-window", 413, nv, 64, [70, 30], [64, 30], 0, 0, {"ties": 0.1, "zeros": 0.05}),
        _v41_gather_case("nvfp4-bs2-offset1-tail8", 414, nv, 2, [7, 3], None, 1, 3, {"tiny": 0.3}, tail=8),
    ]
