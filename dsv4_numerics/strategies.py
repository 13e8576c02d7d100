"""Public hypothesis strategies for the cache-format inputs (datapath 1.2-1.3, 2.0): the ones
behind this suite's own fuzz tests, for kernel authors' own properties::

    from hypothesis import given
    from dsv4_numerics.strategies import bf16_rows, cache_geometries, slot_mappings

    @given(rows=bf16_rows(max_rows=8), geom=cache_geometries())
    def test_my_writer(rows, geom): ...

Needs hypothesis (``pip install "dsv4-numerics[test]"``); importing this module without it
raises an ``ImportError`` saying so. Index-plumbing strategies (batches with permuted block
tables, top-k rows) are in :mod:`dsv4_numerics.strategies_index`.

Hypothesis has no bfloat16: bf16 tensors are drawn as raw uint16 bit patterns and viewed as
bfloat16, so every bit pattern (subnormals, signed zeros, the largest finite values, and - unless
``finite=True`` - Inf and NaN) is reachable and shrinks towards 0x0000. Large row sets are drawn
as a seed plus per-tile magnitudes and generated with a CPU ``torch.Generator``: deterministic
under the ``ci`` profile and cheap for hundreds of rows.

Magnitudes: :func:`magnitudes` draws a log2 row scale with the ends of what the producers' scale
bytes express (``ROW_LOG2_RANGE``) drawn often, and :func:`scaled_rows` rows at that scale, for
the writer and gather stages; the attention stages' magnitudes (cache, q and sinks together) are
in :mod:`dsv4_numerics.strategies_attention`.

All tensors are CPU tensors; move them to a device in the test.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    from hypothesis import strategies as st
except ImportError as _e:  # hypothesis is an optional dependency (the ``test`` extra)
    raise ImportError(
        "dsv4_numerics.strategies needs hypothesis, an optional dependency: "
        'pip install "dsv4-numerics[test]"') from _e
from hypothesis.extra import numpy as hnp

from dsv4_numerics.reference.constants import (
    HEAD_DIM,
    N_TILES,
    RECORD_BYTES,
    TILE,
    TINY_TILE_AMAX,
    production_page_stride,
)

BF16_EXP_MASK = 0x7F80
BF16_SIGN = 0x8000


def _bits_to_bf16(bits: np.ndarray, finite: bool) -> torch.Tensor:
    b = bits.astype(np.uint16)
    if finite:
        # Inf/NaN have an all-ones exponent; clearing the exponent's top bit makes them finite
        # (a deterministic map, so shrinking still works).
        nonfinite = (b & BF16_EXP_MASK) == BF16_EXP_MASK
        b = np.where(nonfinite, b & np.uint16(~0x4000 & 0xFFFF), b).astype(np.uint16)
    return torch.from_numpy(b.view(np.int16).copy()).view(torch.bfloat16)


@st.composite
def bf16_tensors(draw, shape: tuple[int, ...], finite: bool = True) -> torch.Tensor:
    """bfloat16 tensor of ``shape`` from arbitrary uint16 bit patterns (keep shapes small)."""
    bits = draw(hnp.arrays(np.uint16, shape, elements=st.integers(0, 0xFFFF)))
    return _bits_to_bf16(bits, finite)


def bf16_from_float(x: torch.Tensor) -> torch.Tensor:
    """RNE to bfloat16 (torch's cast is RNE)."""
    return x.to(torch.bfloat16)


@st.composite
def tiles(draw, amax: float | None = None, finite: bool = True) -> torch.Tensor:
    """One bf16 tile ``[64]``: arbitrary bit patterns, or - with ``amax`` - scaled so that
    ``max |x| == bf16(amax)`` exactly (placed at a drawn position with a drawn sign)."""
    t = draw(bf16_tensors((TILE,), finite=finite)).to(torch.float32)
    if amax is None:
        return t.to(torch.bfloat16)
    a = float(torch.tensor(amax).to(torch.bfloat16))
    peak = t.abs().max()
    t = t / peak * a if float(peak) > 0 else torch.zeros_like(t)
    t = bf16_from_float(t).to(torch.float32).clamp(-a, a)
    i = draw(st.integers(0, TILE - 1))
    t[i] = a if draw(st.booleans()) else -a
    return t.to(torch.bfloat16)


@st.composite
def boundary_amax(draw) -> float:
    """A bf16 amax within +-8 bf16 ulps of the Q_A/Q_S boundary 448*2**-14 (datapath 2.0), or 0."""
    base = torch.tensor(TINY_TILE_AMAX, dtype=torch.bfloat16).view(torch.int16).item()
    if draw(st.integers(0, 9)) == 0:
        return 0.0
    bits = base + draw(st.integers(-8, 8))
    return float(torch.tensor(bits, dtype=torch.int16).view(torch.bfloat16))


@st.composite
def tie_amax(draw, m_range: tuple[int, int] = (-40, 40)) -> float:
    """An exact tie amax ``1.75 * 2**m`` (``amax / 448 = 2**(m-8)``, H16)."""
    m = draw(st.integers(*m_range))
    return 1.75 * 2.0**m


@st.composite
def boundary_tiles(draw) -> torch.Tensor:
    """A bf16 tile whose amax sits at the scale-rule boundary (0.02734375) or is an exact tie."""
    a = draw(st.one_of(boundary_amax(), tie_amax(), tie_amax((-26, -20))))
    return draw(tiles(amax=a))


@st.composite
def bf16_rows(draw, n: int | None = None, max_rows: int = 16, exp_range: tuple[int, int] = (-24, 11)) -> torch.Tensor:
    """bf16 rows ``[n, 512]``: per 64-wide tile ``N(0,1) * 2**u`` with a drawn ``u``, from a seed.

    The tile exponents span ``exp_range`` so that tiny tiles (Q_A != Q_S), ordinary tiles and
    large ones occur; some tiles are zeroed or negated zero to exercise signed zeros.
    """
    if n is None:
        n = draw(st.integers(1, max_rows))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HEAD_DIM, generator=g)
    u = torch.randint(exp_range[0], exp_range[1] + 1, (n, HEAD_DIM // TILE), generator=g)
    x = x * torch.exp2(u.to(torch.float32)).repeat_interleave(TILE, dim=1)
    special = torch.randint(0, 16, (n, N_TILES), generator=g)
    nope = x[:, : N_TILES * TILE].reshape(n, N_TILES, TILE)
    nope[special == 0] = 0.0
    nope[special == 1] = -0.0
    return x.to(torch.bfloat16)


# Row magnitudes (log2 of a whole-row factor) the producers' scale bytes can express for finite bf16
# input: 2**-20 puts every tile at the Q_A / Q_S scale floors (bytes 105 / 114, datapath 2.0),
# 2**120 near the top (byte ~240; 247 is reached only by values near the bf16 maximum).
ROW_LOG2_RANGE = (-20, 120)


@st.composite
def magnitudes(draw, lo: int = ROW_LOG2_RANGE[0], hi: int = ROW_LOG2_RANGE[1]) -> int:
    """A log2 magnitude in ``[lo, hi]``: the two ends, 0 (the simulated scale) and their
    neighbours are drawn often, any value in between too (shrinks towards 0)."""
    if lo > hi:
        raise ValueError(f"magnitudes: lo={lo} > hi={hi}")
    ends = sorted({v for v in (0, lo, lo + 1, hi - 1, hi) if lo <= v <= hi}, key=abs)
    return draw(st.one_of(st.sampled_from(ends), st.integers(lo, hi)))


@st.composite
def scaled_rows(draw, n: int | None = None, max_rows: int = 16,
                log2_range: tuple[int, int] = ROW_LOG2_RANGE) -> tuple[torch.Tensor, int]:
    """``(rows, m)``: bf16 rows ``[n, 512]`` ``N(0, 0.3) * 2**u * 2**m`` (``u`` per 64-wide tile
    uniform in [-2, 2], the RoPE dims scaled alike) with one drawn row magnitude ``m``
    (:func:`magnitudes` over ``log2_range``): caches far below and far above the simulated ones,
    for the writer, gather and attention stages. Values are clamped to the bf16 finite range."""
    if n is None:
        n = draw(st.integers(1, max_rows))
    m = draw(magnitudes(*log2_range))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    u = torch.rand(n, HEAD_DIM // TILE, generator=g) * 4 - 2
    x = torch.randn(n, HEAD_DIM, generator=g, dtype=torch.float64) * 0.3
    x = x * torch.exp2(u.to(torch.float64)).repeat_interleave(TILE, dim=1) * 2.0**m
    big = float(torch.finfo(torch.bfloat16).max)
    return x.clamp(-big, big).to(torch.bfloat16), m


@st.composite
def page_strides(draw, block_size: int) -> int:
    """A legal page stride for ``block_size``: unpadded ``bs*584``, vLLM's ``round_up(bs*584, 576)``,
    or any larger value (H12)."""
    base = block_size * RECORD_BYTES
    return draw(st.one_of(st.just(base), st.just(production_page_stride(block_size)),
                          st.integers(base, base + 4096)))


@st.composite
def slot_mappings(draw, num_blocks: int, block_size: int, n_tokens: int | None = None,
                  pad: bool = True) -> torch.Tensor:
    """int64 ``[n]``: distinct slots in ``[0, num_blocks*bs)`` in a drawn permutation, with ``-1``
    padding entries mixed in when ``pad``."""
    cap = num_blocks * block_size
    if n_tokens is None:
        n_tokens = draw(st.integers(1, min(cap, 64)))
    perm = draw(st.permutations(range(cap)))
    slots = list(perm[:n_tokens])
    if pad:
        k = draw(st.integers(0, max(1, n_tokens // 4)))
        for _ in range(k):
            slots.insert(draw(st.integers(0, len(slots))), -1)
    return torch.tensor(slots, dtype=torch.int64)


@st.composite
def block_tables(draw, num_blocks: int, num_reqs: int, blocks_per_req: int) -> torch.Tensor:
    """int32 ``[num_reqs, blocks_per_req]`` of distinct pages (a drawn permutation); needs
    ``num_reqs * blocks_per_req <= num_blocks``."""
    assert num_reqs * blocks_per_req <= num_blocks
    perm = draw(st.permutations(range(num_blocks)))
    return torch.tensor(perm[: num_reqs * blocks_per_req], dtype=torch.int32).reshape(num_reqs, blocks_per_req)


@st.composite
def cache_geometries(draw, max_blocks: int = 6, block_sizes=(1, 2, 3, 5, 16, 53, 64)) -> tuple[int, int, int]:
    """``(num_blocks, block_size, page_stride)`` with a legal stride."""
    bs = draw(st.sampled_from(block_sizes))
    nb = draw(st.integers(1, max_blocks))
    return nb, bs, draw(page_strides(bs))
