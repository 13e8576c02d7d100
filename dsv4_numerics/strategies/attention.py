"""Public hypothesis strategies for the attention stages (``decode``, ``prefill``; attention 1-2,
7 "Input domain"): whole canonical cases drawn over the dimensions production kernels' own tests
vary -- page sizes (2, 53, 61, 64, 69, 576), top-k, batch, per-token lengths present or absent
per segment, all-invalid and zero-length rows, empty main segments, sink on/off -- and over
magnitudes far from the simulated ones (caches, q and sinks). Needs hypothesis
(``pip install "dsv4-numerics[test]"``)::

    from hypothesis import given
    import dsv4_numerics as dn
    from dsv4_numerics.strategies.attention import decode_cases

    @given(decode_cases(max_batch=4))
    def test_my_decode(case):
        dn.assert_matches_reference(my_decode, "decode", cases=[case])

Cases come from ``reference.cases.attention_sweep`` (the builder of the ``size="full"`` case set),
so they are deterministic given the drawn parameters and shrink towards small, plain cases
(page size 64, top-k 64, magnitude 0, sink on).

Magnitudes (:func:`attention_magnitudes`): ``kv_log2`` scales every K/V row (NoPE and bf16 RoPE
part: the cache's scale bytes follow), ``q_log2`` the query and ``sink_log2`` the finite sinks.
The logits scale as ``2**(kv_log2 + q_log2)``; the strategy keeps that sum in
``[LOGIT_LOG2_MIN, LOGIT_LOG2_MAX]``: at most 12 (logits up to the thousands, where an fp32 kernel
still holds ``exp(logit - max)``; far beyond it any fp32 kernel's logits overflow, which no case of
this suite claims to be the kernel's fault), at least -8 (smaller logits: the comparators' ``degenerate_reference``
floor is relative to the row's logit scale, but the ``lse`` / ``max_logits`` ``atol``, 1e-5, is
absolute and would judge nothing below it).
"""

from __future__ import annotations

try:
    from hypothesis import strategies as st
except ImportError as _e:  # hypothesis is an optional dependency (the ``test`` extra)
    raise ImportError(
        "dsv4_numerics.strategies.attention needs hypothesis, an optional dependency: "
        'pip install "dsv4-numerics[test]"') from _e

from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.cases.attention_sweep import SegmentSpec, sweep_decode_case, sweep_prefill_case

from dsv4_numerics.strategies.cache import ROW_LOG2_RANGE, magnitudes

PAGE_SIZES = (64, 2, 53, 61, 69, 576)  # FlashMLA's sparse decode test (64 first: shrinks to it)
TOPKS = (64, 128, 576, 2048)
Q_LOG2_RANGE = (-118, 12)
SINK_LOG2_RANGE = (-4, 10)
LOGIT_LOG2_MIN, LOGIT_LOG2_MAX = -8, 12


@st.composite
def attention_magnitudes(draw) -> dict:
    """``{"kv_log2", "q_log2", "sink_log2"}``: a cache magnitude over ``ROW_LOG2_RANGE``, a q
    magnitude over ``Q_LOG2_RANGE`` with ``LOGIT_LOG2_MIN <= kv_log2 + q_log2 <= LOGIT_LOG2_MAX``
    and a sink magnitude over ``SINK_LOG2_RANGE`` (module docstring)."""
    kv = draw(magnitudes(*ROW_LOG2_RANGE))
    q = draw(magnitudes(max(Q_LOG2_RANGE[0], LOGIT_LOG2_MIN - kv), min(Q_LOG2_RANGE[1], LOGIT_LOG2_MAX - kv)))
    return {"kv_log2": kv, "q_log2": q, "sink_log2": draw(magnitudes(*SINK_LOG2_RANGE))}


@st.composite
def _segment(draw, topks=TOPKS, page_sizes=PAGE_SIZES) -> SegmentSpec:
    return SegmentSpec(draw(st.sampled_from(page_sizes)), draw(st.sampled_from(topks)), draw(st.booleans()))


def _rows(draw, batch: int) -> dict:
    free = batch - 1  # at least one ordinary row
    a = draw(st.integers(0, min(1, free)))
    z = draw(st.integers(0, min(1, free - a)))
    return {"all_invalid": a, "zero_length": z, "free": free - a - z}


@st.composite
def decode_cases(draw, max_batch: int = 8, heads=(64, 128), topks=TOPKS, page_sizes=PAGE_SIZES,
                 magnitude: bool = True) -> Case:
    """A ``decode`` case: 1..``max_batch`` tokens, a main segment and (mostly) an extra segment,
    each with a drawn page size, top-k and lengths present/absent; all-invalid, zero-length and
    empty-main rows; sink on/off; magnitudes (:func:`attention_magnitudes`) unless
    ``magnitude=False``."""
    batch = draw(st.integers(1, max_batch))
    main = draw(_segment(topks, page_sizes))
    extra = None if draw(st.integers(0, 3)) == 3 else draw(_segment(topks, page_sizes))  # shrinks to present
    rows = _rows(draw, batch)
    empty_main = draw(st.integers(0, min(1, rows["free"]))) if extra is not None else 0
    mags = draw(attention_magnitudes()) if magnitude else {}
    return sweep_decode_case("drawn-decode", batch=batch, main=main, extra=extra, heads=draw(st.sampled_from(heads)),
                             all_invalid=rows["all_invalid"], zero_length=rows["zero_length"], empty_main=empty_main,
                             sink=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)), **mags)


@st.composite
def prefill_cases(draw, max_batch: int = 8, heads=(64, 128), topks=(128, 256, 640, 2048),
                  magnitude: bool = True) -> Case:
    """A ``prefill`` case: 1..``max_batch`` query tokens over one combined index table (top-k a
    multiple of 128, as vLLM pads it), lengths present/absent, all-invalid and zero-length rows,
    sink on/off, magnitudes unless ``magnitude=False``."""
    batch = draw(st.integers(1, max_batch))
    rows = _rows(draw, batch)
    mags = draw(attention_magnitudes()) if magnitude else {}
    return sweep_prefill_case("drawn-prefill", batch=batch, topk=draw(st.sampled_from(topks)),
                              lengths=draw(st.booleans()), heads=draw(st.sampled_from(heads)),
                              all_invalid=rows["all_invalid"], zero_length=rows["zero_length"],
                              sink=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)), **mags)


__all__ = ["LOGIT_LOG2_MAX", "LOGIT_LOG2_MIN", "PAGE_SIZES", "Q_LOG2_RANGE", "SINK_LOG2_RANGE", "TOPKS", "attention_magnitudes",
           "decode_cases", "prefill_cases"]
