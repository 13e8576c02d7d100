"""Public hypothesis strategies for the DeepSeek-V4.1 records (528-byte MXFP8, 288-byte NVFP4;
datapath 1.6): NVFP4 groups built to hit the E2M1 encoder's edges, and V4.1 cache geometries::

    from hypothesis import given
    from dsv4_numerics.strategies.v41 import e2m1_tie_groups, v41_geometries

    @given(group=e2m1_tie_groups(), geom=v41_geometries())
    def test_my_nvfp4_writer(group, geom): ...

Every group is a bfloat16 ``[16]`` tensor (one NVFP4 scale group) whose scale byte is known by
construction, returned as ``(group, scale_byte)``:

- ``e2m1_tie_groups``: ``amax = 6 * s`` exactly (so the E4M3 scale is ``s`` with no rounding) and
  the other elements at ``t * s`` for E2M1 ties ``t`` (0.25, 0.75, ..., 5), signs drawn.
- ``e2m1_saturation_groups``: ``amax`` the next bf16 above ``6 * s``: ``amax / 6`` rounds down to
  ``s`` (it is within 2**-7 of ``s``, E4M3 steps are 2**-3), so ``amax / s > 6`` saturates to 6.
- ``subnormal_scale_groups``: ``amax = 6 * m * 2**-9`` with ``m`` in 1..7: the scale is the E4M3
  subnormal ``m * 2**-9`` (byte ``m``).
- ``zero_groups``: all +-0 elements (scale byte 0x01, the clamp floor ``2**-9``).

``v41_mixed_caches`` draws the FlashMLA V4.1 pairing: an MXFP8 main cache (528 B) with an NVFP4
extra cache (288 B, valid only as ``extra_k_cache`` next to a V4.1 main cache), one byte order.
``v41_decode_cases`` draws whole ``v41_sparse_decode`` cases (``reference.cases.v41_attention``):
MXFP8 main cache, no / MXFP8 / NVFP4 extra cache (NVFP4 rows half on E2M1 ties), page sizes,
page tails, the producer (vLLM interleaved or FlashInfer page-footer), lonely tokens, empty
extra segments and stale valid ids past the lengths. ``v41_write_cases`` draws whole
``v41_write`` cases (record, page size and tail, padded slot lists, magnitudes, E2M1 ties).

Needs hypothesis (``pip install "dsv4-numerics[test]"``). All tensors are CPU tensors.
"""

from __future__ import annotations

try:
    from hypothesis import strategies as st
except ImportError as _e:  # hypothesis is an optional dependency (the ``test`` extra)
    raise ImportError(
        "dsv4_numerics.strategies.v41 needs hypothesis, an optional dependency: "
        'pip install "dsv4-numerics[test]"') from _e
import torch

from dsv4_numerics.reference.constants import E2M1_MAX, V41_NVFP4_GROUP
from dsv4_numerics.reference.caches.v41 import record_bytes
from dsv4_numerics.reference.formats.fp4 import E2M1_MAGNITUDES
from dsv4_numerics.reference.formats.fp8 import decode_e4m3fn
from dsv4_numerics.reference.policies import V41Layout, V41Record

__all__ = [
    "E2M1_TIES",
    "e2m1_tie_groups",
    "e2m1_saturation_groups",
    "subnormal_scale_groups",
    "zero_groups",
    "v41_geometries",
    "v41_mixed_caches",
    "v41_decode_cases",
    "v41_write_cases",
]

# Midpoints between neighbouring E2M1 magnitudes (0.25 .. 5).
E2M1_TIES = tuple((a + b) / 2 for a, b in zip(E2M1_MAGNITUDES, E2M1_MAGNITUDES[1:]))
# E4M3 normal scale bytes whose 6x is a finite bf16 and whose tie multiples stay normal bf16.
_NORMAL_SCALE_BYTES = st.integers(0x08, 0x7E)


def _scale(byte: int) -> float:
    return float(decode_e4m3fn(torch.tensor([byte], dtype=torch.uint8))[0])


def _group(draw, amax: float, others: list[float]) -> torch.Tensor:
    """A bf16 group with ``amax`` (signed) at a drawn position and ``others`` elsewhere."""
    pos = draw(st.integers(0, V41_NVFP4_GROUP - 1))
    vals = list(others)
    vals.insert(pos, amax * draw(st.sampled_from((1.0, -1.0))))
    return torch.tensor(vals, dtype=torch.float64).to(torch.bfloat16)


@st.composite
def e2m1_tie_groups(draw) -> tuple[torch.Tensor, int]:
    """``(group bf16 [16], scale_byte)``: every non-amax element sits exactly on an E2M1 tie."""
    byte = draw(_NORMAL_SCALE_BYTES)
    s = _scale(byte)
    ties = draw(st.lists(st.sampled_from(E2M1_TIES), min_size=V41_NVFP4_GROUP - 1, max_size=V41_NVFP4_GROUP - 1))
    signs = draw(st.lists(st.sampled_from((1.0, -1.0)), min_size=len(ties), max_size=len(ties)))
    return _group(draw, E2M1_MAX * s, [t * s * g for t, g in zip(ties, signs)]), byte


@st.composite
def e2m1_saturation_groups(draw) -> tuple[torch.Tensor, int]:
    """``(group, scale_byte)`` whose amax element encodes above 6 before saturation."""
    byte = draw(_NORMAL_SCALE_BYTES)
    s = _scale(byte)
    six_s = torch.tensor(E2M1_MAX * s, dtype=torch.bfloat16)
    amax = float(torch.nextafter(six_s, torch.tensor(float("inf"), dtype=torch.bfloat16)))
    others = draw(st.lists(st.floats(-E2M1_MAX * s, E2M1_MAX * s, width=32),
                           min_size=V41_NVFP4_GROUP - 1, max_size=V41_NVFP4_GROUP - 1))
    return _group(draw, amax, others), byte


@st.composite
def subnormal_scale_groups(draw) -> tuple[torch.Tensor, int]:
    """``(group, scale_byte)`` with an E4M3 subnormal scale ``m * 2**-9`` (byte ``m`` in 1..7)."""
    m = draw(st.integers(1, 7))
    s = m * 2.0**-9
    others = draw(st.lists(st.floats(-E2M1_MAX * s, E2M1_MAX * s, width=32),
                           min_size=V41_NVFP4_GROUP - 1, max_size=V41_NVFP4_GROUP - 1))
    return _group(draw, E2M1_MAX * s, others), m


@st.composite
def zero_groups(draw) -> tuple[torch.Tensor, int]:
    """``(group of +-0, 0x01)``: an all-zero group gets the clamp floor ``2**-9`` as its scale."""
    signs = draw(st.lists(st.booleans(), min_size=V41_NVFP4_GROUP, max_size=V41_NVFP4_GROUP))
    return torch.tensor([-0.0 if n else 0.0 for n in signs], dtype=torch.bfloat16), 0x01


@st.composite
def v41_geometries(draw, max_blocks: int = 4, block_sizes=(1, 2, 3, 16, 64)) -> tuple[int, int, int, V41Record, V41Layout]:
    """``(num_blocks, block_size, page_stride, record, layout)``; the stride has a drawn tail of 0-40 bytes."""
    record = draw(st.sampled_from(list(V41Record)))
    layout = draw(st.sampled_from(list(V41Layout)))
    nb = draw(st.integers(1, max_blocks))
    bs = draw(st.sampled_from(block_sizes))
    return nb, bs, bs * record_bytes(record) + draw(st.integers(0, 40)), record, layout


@st.composite
def v41_mixed_caches(draw, max_blocks: int = 4) -> dict:
    """``{"layout", "main": (num_blocks, bs, page_stride), "extra": (...)}``: an MXFP8 main cache
    (SWA-like, 64-entry pages) and an NVFP4 extra cache (compressed, 2- or 64-entry pages) in one
    drawn ``V41Layout``; strides have drawn tails of 0-40 bytes."""
    layout = draw(st.sampled_from(list(V41Layout)))
    geoms = {}
    for part, record, sizes in (("main", V41Record.MXFP8, (64, 16)), ("extra", V41Record.NVFP4, (2, 64))):
        bs = draw(st.sampled_from(sizes))
        geoms[part] = (draw(st.integers(1, max_blocks)), bs, bs * record_bytes(record) + draw(st.integers(0, 40)))
    return {"layout": layout, **geoms}


@st.composite
def v41_decode_cases(draw, max_tokens: int = 4):
    """A ``v41_sparse_decode`` ``Case`` (CPU tensors) built by ``cases_v41_attention.v41_decode_case``
    from drawn geometry and edges (module docstring); ``case.params`` records what was drawn."""
    from dsv4_numerics.reference.cases.v41_attention import v41_decode_case

    t = draw(st.integers(1, max_tokens))
    extra_kind = draw(st.sampled_from((None, V41Record.MXFP8, V41Record.NVFP4)))
    extra = None
    if extra_kind is not None:
        bs = draw(st.sampled_from((2, 16, 64)))
        extra = (extra_kind, bs, max(1, 64 // bs), draw(st.sampled_from((64, 128))))
    lonely = tuple(i for i in range(t) if draw(st.booleans()) and draw(st.booleans()))
    empty_extra = tuple(i for i in range(t) if extra is not None and draw(st.booleans()) and draw(st.booleans()))
    return v41_decode_case(
        "hypothesis", draw(st.integers(0, 2**31 - 1)), t=t, heads=draw(st.sampled_from((3, 8))),
        main_bs=draw(st.sampled_from((16, 64))), main_nb=draw(st.integers(1, 3)), main_k=draw(st.sampled_from((64, 128))),
        extra=extra, producer=draw(st.sampled_from(("vllm_0.33.0", "flashinfer_0.7.2"))), lonely=lonely,
        empty_extra=empty_extra, stale_past_len=draw(st.booleans()), tail=draw(st.sampled_from((0, 8, 40))),
        edge="drawn")


@st.composite
def v41_write_cases(draw, records=(V41Record.MXFP8, V41Record.NVFP4), block_sizes=(2, 16, 64), max_blocks: int = 4,
                    max_tokens: int = 48, log2_range: tuple[int, int] = (-20, 100)):
    """A ``v41_write`` Case (the V4.1 writers' canonical inputs, ``reference.cases.v41``): a drawn
    record type, page size, page tail (0, or a drawn number of spare bytes after the records),
    distinct slots in a drawn order with ``-1`` padding, rows of one drawn magnitude
    (``strategies.scaled_rows``; the range stops below where NVFP4's E4M3 scale saturates), half of
    the NVFP4 rows' groups on E2M1 ties, and a stale cache."""
    from dsv4_numerics.reference.cases import Case

    from dsv4_numerics.strategies.cache import garbage_cache, scaled_rows, slot_mappings

    record = V41Record(draw(st.sampled_from(tuple(records))))
    bs = draw(st.sampled_from(tuple(block_sizes)))
    nb = draw(st.integers(1, max_blocks))
    tail = draw(st.one_of(st.just(0), st.integers(1, 64)))
    stride = bs * record_bytes(record) + tail
    slots = draw(slot_mappings(nb, bs, n_tokens=draw(st.integers(1, max(1, min(nb * bs, max_tokens))))))
    n = int(slots.shape[0])
    rows, m = draw(scaled_rows(n=n, log2_range=log2_range))
    if record is V41Record.NVFP4:
        for i in range(0, n, 2):  # every other row: one group of E2M1 ties at a known scale
            group, _ = draw(e2m1_tie_groups())
            j = draw(st.integers(0, 512 // V41_NVFP4_GROUP - 1)) * V41_NVFP4_GROUP
            rows[i, j:j + V41_NVFP4_GROUP] = group
    cache = garbage_cache(draw(st.integers(0, 2**31 - 1)), nb, stride)
    inputs = {"k": rows, "slot_mapping": slots, "block_size": bs, "num_blocks": nb, "page_stride": stride,
              "record": record.value, "cache": cache}
    params = {"block_size": bs, "page_stride": stride, "num_blocks": nb, "record": record.value, "n_tokens": n,
              "n_written": int((slots >= 0).sum()), "log2_magnitude": m, "drawn": True}
    return Case(f"drawn-v41-{record.value}-bs{bs}-t{tail}-m{m}", "v41_write", inputs, params)
