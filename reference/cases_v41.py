"""Default cases of the DeepSeek-V4.1 cache writer stage ``v41_write`` (datapath 1.6, H13).

Inputs (CPU tensors / plain values), as ``cases_cache`` writes them for ``swa_write`` plus the record:
    ``k``             bfloat16 ``[N, 512]`` (all dims quantised, RoPE included)
    ``slot_mapping``  int64 ``[N]``: distinct global slots in a permuted order, ``-1`` padding
    ``block_size``, ``num_blocks``, ``page_stride``: ints
    ``record``        ``"mxfp8_528"`` | ``"nvfp4_288"`` (``reference.policies.V41Record``)
    ``cache``         uint8 ``[num_blocks, page_stride]``: stale garbage before the write
The byte order and the quantisation rules are the writer's policies (``v41_layout``,
``scale_rule``, ``nvfp4_rule``), not case inputs.

Row kinds: those of ``cases_cache.make_rows`` (realistic, tiny, boundary, ties, zeros,
subnormal, huge: their 64-wide tile constructions hold for the 32- and 16-wide V4.1 groups in
amax range), plus ``e2m1_ties``: every 16-group with amax ``6 * s`` for an E4M3 scale ``s``
(normal or subnormal) and the other elements on E2M1 ties ``t * s`` (t = 0.25 .. 5), signs mixed.
"""

from __future__ import annotations

import torch

from .cache_v41 import record_bytes
from .cases import Case, register_cases
from .cases_cache import _garbage, _kinds, _shuffle, _slots_with_padding, make_rows
from .constants import E2M1_MAX, HEAD_DIM, V41_NVFP4_GROUP
from .fp4 import E2M1_MAGNITUDES
from .fp8 import decode_e4m3fn
from .policies import V41Record

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
    kinds = _shuffle(g, _kinds({k: v for k, v in rows.items() if k != "e2m1_ties"}))
    parts = [make_rows(g, kinds)] if kinds else []
    if n_ties:
        parts.append(e2m1_tie_rows(g, n_ties))
    k = torch.cat(parts)
    k = k[torch.randperm(k.shape[0], generator=g)]
    stride = bs * record_bytes(record) + tail
    slot_mapping = _slots_with_padding(g, nb * bs, k.shape[0], n_pad)
    if slot_mapping.shape[0] > k.shape[0]:
        k = torch.cat([k, make_rows(g, ["realistic"] * (slot_mapping.shape[0] - k.shape[0]))])
    params = {"seed": seed, "block_size": bs, "page_stride": stride, "num_blocks": nb, "record": record.value,
              "n_tokens": int(slot_mapping.shape[0]), "n_written": int((slot_mapping >= 0).sum()), "rows": rows}
    inputs = {"k": k, "slot_mapping": slot_mapping, "block_size": bs, "num_blocks": nb, "page_stride": stride,
              "record": record.value, "cache": _garbage(g, (nb, stride))}
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
