"""The wide-tensor byte-level reference (``reference.caches.model1`` / ``quant`` / ``fp8``) equals a
slow, obviously-correct path bit for bit, and raises exactly where it raises.

The slow path (``tests/reference/bytes_slow.py``) is the byte-level reference as it was before
it was vectorised, driven one token at a time: each token is encoded on its own and its 584 bytes
are written with Python slices. Random geometries and page strides, slot patterns with -1,
other negatives, duplicates and out-of-range slots under both skip policies, NaN/Inf inputs,
tiny tiles and exact ties, both scale rules, both FP8 flavours and every non-finite policy.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_numerics.reference.caches import model1 as fast
from dsv4_numerics.reference.formats import quant
from dsv4_numerics.reference.constants import FNUZ_GFX942_CLAMP, HEAD_DIM, N_TILES, TILE
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.policies import Fp8Flavour, NonFinite, ScaleRule, SlotSkip, Ue8m0Consumer
from dsv4_numerics.strategies.cache import bf16_rows, bf16_tensors, boundary_tiles, cache_geometries

from . import bytes_slow as slow

_FLAVOURS = st.sampled_from([(Fp8Flavour.E4M3FN, None), (Fp8Flavour.E4M3FNUZ, None),
                             (Fp8Flavour.E4M3FNUZ, FNUZ_GFX942_CLAMP)])


@st.composite
def _rows(draw, n: int) -> torch.Tensor:
    """bf16 ``[n, 512]``: realistic rows, with some tiles replaced by arbitrary bit patterns
    (NaN/Inf included when drawn), tiny-amax / tie tiles, and the RoPE part possibly non-finite."""
    x = draw(bf16_rows(n=n)).clone()
    for _ in range(draw(st.integers(0, 3))):
        r, t = draw(st.integers(0, n - 1)), draw(st.integers(0, N_TILES))
        finite = draw(st.booleans())
        tile = draw(st.one_of(bf16_tensors((TILE,), finite=finite), boundary_tiles()))
        x[r, t * TILE:(t + 1) * TILE] = tile
    for _ in range(draw(st.integers(0, 3))):  # single NaN (either sign, any payload) / Inf elements
        r, c = draw(st.integers(0, n - 1)), draw(st.integers(0, HEAD_DIM - 1))
        bits = draw(st.sampled_from([0x7FC0, 0xFFC0, 0x7F81, 0xFFA3, 0x7F80, 0xFF80]))
        x[r, c] = torch.tensor(bits - 0x10000 if bits >= 0x8000 else bits, dtype=torch.int16).view(torch.bfloat16)
    return x


# The frozen per-token path (bytes_slow.py) predates NonFinite.VLLM_CPU, which is checked against
# the CPU writer itself (tests/kernels/test_vllm_cpu.py) and its definition (test_cpu_policies.py),
# and NonFinite.SGLANG_JIT, checked against a re-derivation of SGLang's store arithmetic
# (tests/kernels/test_sglang_jit_adapters.py) and its definition (test_sglang_policies.py).
_FROZEN_NONFINITE = [p for p in NonFinite if p not in (NonFinite.VLLM_CPU, NonFinite.SGLANG_JIT)]


def _slow_insert(cache, k, slots, bs, rule, flavour, nonfinite, slot_skip, clamp):
    """Per-token insert on the pre-vectorisation reference: same validation (the old vectorised
    ``insert`` decides whether the call is legal), then one token at a time."""
    slow.insert(cache, k, slots, bs, rule, flavour, nonfinite, slot_skip, clamp)  # raises like before
    nb, _, p = slow.cache_geometry("insert", cache, bs)
    out = slow.clone_storage(cache)
    flat = slow.flat_bytes(out, nb, p)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        data, scales = slow.encode_records(k[t:t + 1], rule, flavour, nonfinite, clamp)
        page, e = divmod(s, bs)
        d0 = page * p + e * 576
        s0 = page * p + bs * 576 + e * 8
        flat[d0:d0 + 576] = data[0]
        flat[s0:s0 + 8] = scales[0]
    return out


def _outcome(fn):
    try:
        return fn()
    except InputError as exc:
        return InputError, str(exc).split(" (got")[0].split(":", 1)[1]


def _same(a, b) -> bool:
    if isinstance(a, tuple) and a and a[0] is InputError:
        return a == b
    if isinstance(b, tuple) and b and b[0] is InputError:
        return False
    if isinstance(a, tuple):
        return all(_same(x, y) for x, y in zip(a, b))
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(
        a.view(torch.uint8) if a.dtype != torch.bool else a, b.view(torch.uint8) if b.dtype != torch.bool else b)


@given(cache_geometries(max_blocks=4, block_sizes=(1, 2, 3, 5, 16)), st.data())
def test_insert_equals_per_token_path(geom, data):
    nb, bs, stride = geom
    cap = nb * bs
    n = data.draw(st.integers(1, 10))
    L = data.draw(st.integers(0, n))
    # mostly distinct valid slots; sometimes -1, another negative, a duplicate or out of range
    pool = st.one_of(st.integers(0, cap - 1), st.just(-1), st.integers(-3, cap + 1))
    slot_list = data.draw(st.lists(pool, min_size=L, max_size=L,
                                   unique=data.draw(st.integers(0, 3)) > 0))
    slots = torch.tensor(slot_list, dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))
    k = data.draw(_rows(n))
    rule = data.draw(st.sampled_from(list(ScaleRule)))
    flavour, clamp = data.draw(_FLAVOURS)
    nonfinite = data.draw(st.sampled_from(_FROZEN_NONFINITE))
    skip = data.draw(st.sampled_from([SlotSkip.MINUS1_ONLY, SlotSkip.ALL_NEGATIVE]))  # the 584-byte rules
    seed = data.draw(st.integers(0, 2**16))
    before = torch.randint(0, 256, (nb, stride), generator=torch.Generator().manual_seed(seed),
                           dtype=torch.int64).to(torch.uint8)
    want = _outcome(lambda: _slow_insert(before, k, slots, bs, rule, flavour, nonfinite, skip, clamp))
    got = _outcome(lambda: fast.insert(before, k, slots, bs, rule, flavour, nonfinite, skip, clamp))
    assert _same(want, got), (want if isinstance(want, tuple) else "bytes", got if isinstance(got, tuple) else "bytes")


@given(st.data())
def test_encode_and_quantize_equal_old_path(data):
    n = data.draw(st.integers(1, 6))
    k = data.draw(_rows(n))
    rule = data.draw(st.sampled_from(list(ScaleRule)))
    flavour, clamp = data.draw(_FLAVOURS)
    nonfinite = data.draw(st.sampled_from(_FROZEN_NONFINITE))
    x = k[:, :448]
    if data.draw(st.booleans()):
        x = x.to(torch.float32)
    assert _same(_outcome(lambda: slow.encode_records(k, rule, flavour, nonfinite, clamp)),
                 _outcome(lambda: fast.encode_records(k, rule, flavour, nonfinite, clamp)))
    assert _same(_outcome(lambda: slow.quantize_tiles(x, rule, flavour, nonfinite, clamp)),
                 _outcome(lambda: quant.quantize_tiles(x, rule, flavour, nonfinite, clamp)))


@given(cache_geometries(max_blocks=5, block_sizes=(1, 2, 3, 16)), st.data())
def test_gather_and_reads_equal_old_path(geom, data):
    nb, bs, stride = geom
    seed = data.draw(st.integers(0, 2**16))
    cache = torch.randint(0, 256, (nb, stride), generator=torch.Generator().manual_seed(seed),
                          dtype=torch.int64).to(torch.uint8)
    r = data.draw(st.integers(0, 3))
    cols = data.draw(st.integers(0, 3))
    table = torch.tensor(data.draw(st.lists(st.lists(st.integers(-1, nb), min_size=cols, max_size=cols),
                                            min_size=r, max_size=r)), dtype=torch.int32).reshape(r, cols)
    seq = data.draw(st.lists(st.integers(0, cols * bs + 1), min_size=r, max_size=r))
    g = [data.draw(st.integers(0, L)) for L in seq]
    offset = data.draw(st.integers(0, 2))
    consumer = data.draw(st.sampled_from(list(Ue8m0Consumer)))
    args = (cache, table, torch.tensor(seq, dtype=torch.int64), bs)
    kw = dict(gather_lens=torch.tensor(g, dtype=torch.int64) if data.draw(st.booleans()) else None,
              consumer=consumer, offset=offset)
    assert _same(_outcome(lambda: slow.gather(*args, **kw)), _outcome(lambda: fast.gather(*args, **kw)))
    slots = torch.tensor(data.draw(st.lists(st.integers(-1, nb * bs), max_size=6)), dtype=torch.int64)
    assert _same(_outcome(lambda: slow.read_records(cache, slots, bs)),
                 _outcome(lambda: fast.read_records(cache, slots, bs)))
    assert _same(_outcome(lambda: slow.dequantize_all(cache, bs, consumer=consumer)),
                 _outcome(lambda: fast.dequantize_all(cache, bs, consumer=consumer)))


def test_strategy_reaches_the_interesting_inputs():
    """Guard against a vacuous property: the drawn rows include NaN/Inf tiles and ties."""
    from hypothesis import find

    find(_rows(2), lambda x: bool(torch.isnan(x[:, :448]).any()))
    find(_rows(2), lambda x: bool(torch.isinf(x[:, :448]).any()))


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_insert_at_scale_equals_old_path(device):
    """A production-size insert (bs 64, vLLM page stride, 2 000 tokens in a random order with -1
    padding) equals the old vectorised reference (which moved everything to the CPU)."""
    g = torch.Generator().manual_seed(7)
    n = 2000
    k = (torch.randn(n, HEAD_DIM, generator=g) * torch.exp2(torch.randint(-20, 10, (n, 1), generator=g).float())).to(torch.bfloat16)
    nb = -(-n // 64) + 1
    slots = torch.randperm(nb * 64, generator=g)[:n]
    slots[::97] = -1
    cache = fast.empty_cache(nb, 64, fill=0xA5)
    want = slow.insert(cache, k, slots, 64, ScaleRule.AMAX_CLAMP, slot_skip=SlotSkip.MINUS1_ONLY)
    got = fast.insert(cache.to(device), k.to(device), slots.to(device), 64, ScaleRule.AMAX_CLAMP,
                      slot_skip=SlotSkip.MINUS1_ONLY)
    assert torch.equal(got.cpu(), want)


_ALL_BF16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("flavour,clamp", [(Fp8Flavour.E4M3FN, None), (Fp8Flavour.E4M3FNUZ, None),
                                           (Fp8Flavour.E4M3FNUZ, FNUZ_GFX942_CLAMP)])
def test_code_table_equals_float64_encoder_for_every_scaled_bf16(flavour, clamp):
    """The bf16 fast path's element step, exhaustively: for every bf16 ``x`` (NaN/Inf included)
    and every tile exponent ``e`` the fast path can produce (``[-22, 126]``), the table code of the
    bf16 product ``x * 2**-e`` equals the float64 encoder of the exact product (NaN canonical)."""
    m = quant.fp8_max(flavour) if clamp is None else clamp
    x64 = _ALL_BF16.to(torch.float64)
    for nonfinite in NonFinite:
        table = quant.code_table(flavour, nonfinite, m, torch.device("cpu"))
        for e in range(-22, 127):
            scale = torch.tensor(2.0 ** -e, dtype=torch.bfloat16)
            got = table[(_ALL_BF16 * scale).view(torch.int16).to(torch.int32)]
            y = x64 * 2.0 ** -e
            y = torch.where(torch.isnan(y), float("nan"), y)
            want = quant.encode_fp8_trusted(y, flavour, nonfinite,
                                             None if nonfinite in quant.TORCH_POLICIES else m)
            assert torch.equal(got, want), (nonfinite, e, int((got != want).sum()))


@pytest.mark.parametrize("nonfinite", list(NonFinite))
def test_fast_rows_equal_float64_rows_on_every_bf16_pattern(nonfinite):
    """``quantize_rows`` (bf16 fast path) equals ``quantize_rows_f64`` on tiles made of every bf16
    bit pattern (in order and shuffled, scaled into many tile magnitudes), both rules, all flavours."""
    g = torch.Generator().manual_seed(13)
    pats = torch.cat((_ALL_BF16, _ALL_BF16[torch.randperm(1 << 16, generator=g)]))
    if nonfinite is NonFinite.FINITE:
        pats = pats[torch.isfinite(pats)]
    pats = pats[: pats.numel() // 448 * 448].reshape(-1, 448)
    for rule in ScaleRule:
        for flavour, clamp in [(Fp8Flavour.E4M3FN, None), (Fp8Flavour.E4M3FNUZ, None),
                               (Fp8Flavour.E4M3FNUZ, FNUZ_GFX942_CLAMP)]:
            m = quant.fp8_max(flavour) if clamp is None else clamp
            got = quant.quantize_rows(pats, rule, flavour, nonfinite, m)
            want = quant.quantize_rows_f64(pats, rule, flavour, nonfinite, m)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (rule, flavour, clamp)


def test_small_clamp_takes_the_float64_path():
    """A clamp below the fast path's minimum divisor (8) still gives the float64 path's bytes."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 448, generator=g) * 1e30).to(torch.bfloat16)
    got = quant.quantize_tiles(x, ScaleRule.AMAX_CLAMP, Fp8Flavour.E4M3FN, clamp=0.5)
    want = slow.quantize_tiles(x, ScaleRule.AMAX_CLAMP, Fp8Flavour.E4M3FN, clamp=0.5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
