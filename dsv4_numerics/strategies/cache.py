"""Public hypothesis strategies for the cache-format inputs (datapath 1.2-1.3, 2.0): the ones
behind this suite's own fuzz tests, for kernel authors' own properties::

    from hypothesis import given
    from dsv4_numerics.strategies.cache import bf16_rows, cache_geometries, slot_mappings

    @given(rows=bf16_rows(max_rows=8), geom=cache_geometries())
    def test_my_writer(rows, geom): ...

Needs hypothesis (``pip install "dsv4-numerics[test]"``); importing this module without it
raises an ``ImportError`` saying so. Index-plumbing strategies (batches with permuted block
tables, top-k rows) are in :mod:`dsv4_numerics.strategies.index`.

Hypothesis has no bfloat16: bf16 tensors are drawn as raw uint16 bit patterns and viewed as
bfloat16, so every bit pattern (subnormals, signed zeros, the largest finite values, and - unless
``finite=True`` - Inf and NaN) is reachable and shrinks towards 0x0000. Large row sets are drawn
as a seed plus per-tile magnitudes and generated with a CPU ``torch.Generator``: deterministic
under the ``ci`` profile and cheap for hundreds of rows.

Magnitudes: :func:`magnitudes` draws a log2 row scale with the ends of what the producers' scale
bytes express (``ROW_LOG2_RANGE``) drawn often, and :func:`scaled_rows` rows at that scale, for
the writer and gather stages; the attention stages' magnitudes (cache, q and sinks together) are
in :mod:`dsv4_numerics.strategies.attention`.

Whole cases: :func:`swa_write_cases`, :func:`gather_cases`, :func:`rope_cases` and
:func:`kv_norm_rope_store_cases` draw complete canonical ``Case`` objects of their stages
(geometry, slot lists or request windows, tables and positions, magnitudes), ready for
``run_entry`` or ``dsv4_numerics.judge`` (V4.1 writers: ``strategies_v41.v41_write_cases``).

All tensors are CPU tensors; move them to a device in the test.
"""

from __future__ import annotations

import numpy as np
import torch

try:
    from hypothesis import strategies as st
except ImportError as _e:  # hypothesis is an optional dependency (the ``test`` extra)
    raise ImportError(
        "dsv4_numerics.strategies.cache needs hypothesis, an optional dependency: "
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


# --------------------------------------------------------------------------- whole cases


def garbage_cache(seed: int, num_blocks: int, page_stride: int) -> torch.Tensor:
    """uint8 ``[num_blocks, page_stride]`` of seeded random bytes (the default cases' stale pages,
    ``reference.cases.cache``): what a writer writes into (every byte it must not touch is checked)."""
    from dsv4_numerics.reference.cases.cache import garbage_bytes

    return garbage_bytes(torch.Generator().manual_seed(seed), (num_blocks, page_stride))


@st.composite
def swa_write_cases(draw, block_sizes=(1, 2, 16, 53, 64), max_blocks: int = 4, max_tokens: int = 48,
                    log2_range: tuple[int, int] = ROW_LOG2_RANGE):
    """A ``swa_write`` :class:`~dsv4_numerics.reference.cases.Case` (the canonical inputs of the
    584-byte writers): :func:`scaled_rows` of one drawn magnitude written to distinct slots in a
    drawn order with ``-1`` padding (:func:`slot_mappings`) of ``1..max_blocks`` stale pages of a
    drawn ``block_size`` and legal stride (:func:`page_strides`). ``block_sizes``: the page sizes
    to draw (a writer compiled per page size wants a few)."""
    from dsv4_numerics.reference.cases import Case

    bs = draw(st.sampled_from(tuple(block_sizes)))
    nb = draw(st.integers(1, max_blocks))
    stride = draw(page_strides(bs))
    slots = draw(slot_mappings(nb, bs, n_tokens=draw(st.integers(1, max(1, min(nb * bs, max_tokens))))))
    rows, m = draw(scaled_rows(n=int(slots.shape[0]), log2_range=log2_range))
    cache = garbage_cache(draw(st.integers(0, 2**31 - 1)), nb, stride)
    inputs = {"k": rows, "slot_mapping": slots, "block_size": bs, "num_blocks": nb, "page_stride": stride,
              "cache": cache}
    params = {"block_size": bs, "page_stride": stride, "num_blocks": nb, "n_tokens": int(slots.shape[0]),
              "n_written": int((slots >= 0).sum()), "log2_magnitude": m, "drawn": True}
    return Case(f"drawn-swa-write-bs{bs}-s{stride}-m{m}", "swa_write", inputs, params)


@st.composite
def gather_cases(draw, block_sizes=(1, 2, 16, 53, 64), max_requests: int = 3, max_len: int = 150,
                 log2_range: tuple[int, int] = ROW_LOG2_RANGE):
    """A ``gather`` Case (the dequantise-gathers' canonical inputs): ``1..max_requests`` requests
    of drawn lengths over permuted pages of a drawn ``block_size`` and stride, the whole context
    or a drawn tail of each gathered (``gather_lens``; a request may gather nothing, one gathers
    at least a row), spare garbage pages, and the gathered slots written by the reference's
    ``amax_clamp`` writer from :func:`scaled_rows` of one drawn magnitude."""
    from dsv4_numerics.reference.caches.model1 import insert
    from dsv4_numerics.reference.cases import Case
    from dsv4_numerics.reference.cases.cache import gather_tables
    from dsv4_numerics.reference.policies import ScaleRule

    bs = draw(st.sampled_from(tuple(block_sizes)))
    r = draw(st.integers(1, max_requests))
    seq_lens = draw(st.lists(st.integers(1, max_len), min_size=r, max_size=r))
    gather_lens = None
    if draw(st.booleans()):
        gather_lens = [draw(st.integers(0, n)) for n in seq_lens]
        gather_lens[0] = max(1, gather_lens[0])
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    table, slots, nb = gather_tables(g, bs, seq_lens, gather_lens, draw(st.integers(0, 2)))
    stride = draw(page_strides(bs))
    rows, m = draw(scaled_rows(n=len(slots), log2_range=log2_range))
    order = torch.randperm(len(slots), generator=g)
    slot_t = torch.tensor(slots, dtype=torch.int64)[order]
    cache = insert(garbage_cache(seed + 1, nb, stride), rows, slot_t, bs, ScaleRule.AMAX_CLAMP)
    inputs = {"cache": cache, "block_table": table.to(torch.int32),
              "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
              "gather_lens": None if gather_lens is None else torch.tensor(gather_lens, dtype=torch.int32),
              "block_size": bs, "num_blocks": nb, "page_stride": stride, "written_slots": slot_t}
    params = {"block_size": bs, "page_stride": stride, "num_blocks": nb, "seq_lens": seq_lens,
              "gather_lens": gather_lens, "written_by": "cache_model1.insert(rule=amax_clamp)",
              "n_written": len(slots), "log2_magnitude": m, "drawn": True}
    return Case(f"drawn-gather-bs{bs}-r{r}-m{m}", "gather", inputs, params)


@st.composite
def rope_cases(draw, inverse: bool | None = None, max_rows: int = 64, log2_range: tuple[int, int] = (-20, 100)):
    """A ``rope`` Case (the RoPE stage's canonical inputs, ``reference.cases.attention``): rows of
    one drawn magnitude as ``[T, 512]`` or ``[T, H, 512]``, positions in a plain (theta 1e4, 4096
    positions) or YaRN (theta 1.6e5, factor 16, 70000 positions) table with the table's first and
    last position drawn often, forward or inverse (``inverse`` fixes it: a kernel of one direction)."""
    from dsv4_numerics.reference.cases import Case

    yarn = draw(st.booleans())
    table = _rope_table(yarn)
    max_pos = table.shape[0]
    t = draw(st.integers(1, max_rows))
    heads = draw(st.sampled_from([None, 1, 4]))
    rows, m = draw(scaled_rows(n=t * (heads or 1), log2_range=log2_range))
    x = rows if heads is None else rows.reshape(t, heads, HEAD_DIM)
    ends = st.sampled_from([0, 1, max_pos - 1])
    pos = torch.tensor(draw(st.lists(st.one_of(ends, st.integers(0, max_pos - 1)), min_size=t, max_size=t)),
                       dtype=torch.int64)
    inv = draw(st.booleans()) if inverse is None else bool(inverse)
    params = {"theta": 160000.0 if yarn else 10000.0, "yarn": [16.0, 65536] if yarn else None, "rows": t,
              "heads": heads, "inverse": inv, "log2_magnitude": m, "drawn": True}
    return Case(f"drawn-rope-{'yarn' if yarn else 'plain'}-t{t}-h{heads}-m{m}{'-inv' if inv else ''}", "rope",
                {"x": x, "positions": pos, "cos_sin": table, "inverse": inv}, params)


_ROPE_TABLES: dict[bool, torch.Tensor] = {}


def _rope_table(yarn: bool) -> torch.Tensor:
    """The two tables :func:`rope_cases` draws from, built once per process."""
    if yarn not in _ROPE_TABLES:
        from dsv4_numerics.reference.pipeline.rope import YarnConfig, cos_sin_cache

        _ROPE_TABLES[yarn] = (cos_sin_cache(70000, theta=160000.0, yarn=YarnConfig(16.0, 65536)) if yarn
                              else cos_sin_cache(4096, theta=10000.0))
    return _ROPE_TABLES[yarn]


@st.composite
def kv_norm_rope_store_cases(draw, max_tokens: int = 24, max_rows: int = 96):
    """A ``kv_norm_rope_store`` Case (``reference.cases.sglang.norm_rope_store_case``): a drawn
    seed, token count, pool size, kv dtype (bf16 or fp32), and negative slots (``-1``, ``-rows``,
    ``-3``) or not. The rows are exact-norm (the bytes are a bit-exact contract) and the weight
    tiles realistic, E4M3-tie, saturating and subnormal, so the magnitudes are the weights'."""
    from dsv4_numerics.reference.cases.sglang import norm_rope_store_case

    negative = draw(st.booleans())
    t = draw(st.integers(3 if negative else 1, max_tokens))
    rows = draw(st.integers(t + 6 if negative else t, max(max_rows, t + 6)))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float32]))
    seed = draw(st.integers(0, 2**31 - 1))
    return norm_rope_store_case(f"drawn-norm-rope-store-t{t}-r{rows}{'-neg' if negative else ''}", seed, t, rows,
                                negative=negative, dtype=dtype)


__all__ = ["BF16_EXP_MASK", "BF16_SIGN", "ROW_LOG2_RANGE", "bf16_from_float", "bf16_rows", "bf16_tensors",
           "block_tables", "boundary_amax", "boundary_tiles", "cache_geometries", "garbage_cache",
           "gather_cases", "kv_norm_rope_store_cases", "magnitudes", "page_strides", "rope_cases",
           "scaled_rows", "slot_mappings", "swa_write_cases", "tie_amax", "tiles"]
