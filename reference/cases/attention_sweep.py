"""Sweep cases of the ``decode`` and ``prefill`` stages: the dimensions production kernels' own
tests vary (FlashMLA's sparse decode test: page sizes, top-k, batch, per-token lengths, all-invalid
rows, zero-length sequences, sink on/off) and magnitudes far from the layer simulation's
(attention 7 "Input domain"; datapath 2.0 scale-byte ranges).

Unlike ``cases_attention`` (which runs the layer simulation), these cases are drawn directly and
vectorised, so a case of batch 321 and top-k 2048 builds in well under a second and the peak case
(top-k 16384 over 32768 slots) in a few. Inputs are the canonical ones of ``cases_attention``
(same keys, units and conventions):

decode   ``q`` bf16 ``[T, H, 512]``; ``scale``; ``sink`` fp32 ``[H]`` (head 1 ``+inf``, head 2
         ``-inf``) or absent (sink off); ``positions`` int64 ``[T]`` and ``cos_sin`` fp32
         ``[max(positions)+1, 64]`` (for inverse-roping consumers); ``swa_cache`` /
         ``extra_cache`` uint8 ``[nb, page_stride]`` (vLLM's page stride for the block size),
         written by the reference writer (``cache_model1.insert``: Q_A for the main cache, Q_S for
         the extra cache, as the SWA and compressed producers do); every byte of a slot no index
         references is 0xFF (NaN-poisoned); ``swa_indices`` / ``extra_indices`` int32 ``[T, K]``
         global slots (``-1`` empty); ``swa_lens`` / ``extra_lens`` int32 ``[T]`` when the case
         has per-token lengths for that segment, absent otherwise (then ``-1`` alone ends a row).
prefill  ``q``; ``kv`` bf16 ``[S, 512]`` (rows no index references are NaN); ``indices`` int32
         ``[T, K]``; ``topk_length`` int32 ``[T]`` or absent; ``scale``; ``sink``; ``positions``.

Row kinds inside one case (``params["rows"]``): ordinary rows (a random prefix length when the
segment has lengths, ``-1`` holes and a ``-1`` tail otherwise); ``all_invalid`` rows (every index
``-1``; lengths, when present, are ``K``: lengths alone do not make a row empty); ``zero_length``
rows (length 0 in every segment; their columns keep stale VALID ids of written rows, vLLM#36616,
so only the length excludes them; without lengths the row is all ``-1``); ``empty_main`` rows
(decode: the main segment empty, the extra segment not).

Magnitudes (``params["kv_log2"]``, ``["q_log2"]``, ``["sink_log2"]``): the K/V rows (NoPE and
the bf16 RoPE part alike) are scaled by ``2**kv_log2``, ``q`` by ``2**q_log2`` and the finite
sinks by ``2**sink_log2``. ``kv_log2 = -20`` puts every main-cache scale byte at the Q_A floor
(105) and every extra-cache byte at the Q_S floor (114), with the extra cache's codes in the FP8
subnormal range (about the same factor for prefill's bf16 rows; the comparators' ``degenerate_reference`` floor is
relative to the case's scale, so smaller rows can be judged, ``tests/oracles/test_row_scale.py``);
``kv_log2 = +120`` puts the bytes near 240 (the top written byte is 247, for
values near the bf16 maximum, which no float32 accumulation of more than one such value can
hold). ``params["dimension"]``: the sweep dimensions a case exercises (the mutation suite
matches its mutants to them).
"""

from __future__ import annotations

import math

import torch

from ..caches.model1 import empty_cache, insert
from ..cases import Case, register_cases
from ..constants import HEAD_DIM, production_page_stride
from ..errors import check_int, fail
from ..policies import IndexRule, ScaleRule
from ..pipeline.rope import cos_sin_cache

__all__ = ["DIMENSIONS", "SegmentSpec", "full_decode_specs", "full_prefill_specs", "sweep_decode_case",
           "sweep_prefill_case"]

CASE_SCALE = 512**-0.55  # the scale of the default attention cases (cases_attention.CASE_SCALE)
POISON = 0xFF  # unwritten cache bytes: every such slot decodes to NaN
ROW_STD = 0.3  # K/V rows ~ N(0, 0.3) per element before the magnitude scaling (layer simulation's kv)
HOLE_RATE = 1 / 16  # fraction of in-prefix entries turned into -1 holes
ROPE_THETA = 10000.0
# the sweep dimensions (params["dimension"]); tests/mutants/ names its mutants' dimension by these
DIMENSIONS = ("odd_page_size", "long_topk", "empty_main", "kv_magnitude", "q_magnitude", "batch", "lengths",
              "sink_off")


class SegmentSpec:
    """One decode segment's geometry: ``block_size`` entries per page, ``topk`` index columns,
    ``lengths`` (per-token lengths present), ``pool`` slots the indices are drawn from (default
    ``max(2*topk, 256)``; the peak case uses s_k = 32768)."""

    __slots__ = ("block_size", "topk", "lengths", "pool")

    def __init__(self, block_size: int, topk: int, lengths: bool = True, pool: int | None = None):
        fn = "SegmentSpec"
        self.block_size = check_int(fn, "block_size", block_size, minimum=1)
        self.topk = check_int(fn, "topk", topk, minimum=1)
        self.lengths = bool(lengths)
        self.pool = max(2 * self.topk, 256) if pool is None else check_int(fn, "pool", pool, minimum=self.topk)

    def describe(self) -> dict:
        return {"block_size": self.block_size, "topk": self.topk, "lengths": self.lengths, "pool": self.pool}


def _rows_kinds(fn: str, T: int, all_invalid: int, zero_length: int, empty_main: int) -> dict[str, list[int]]:
    """Token rows of each special kind, spread over the batch (first, middle, last ...)."""
    check_int(fn, "batch", T, minimum=1)
    kinds: dict[str, list[int]] = {"all_invalid": [], "zero_length": [], "empty_main": []}
    want = [("all_invalid", all_invalid), ("zero_length", zero_length), ("empty_main", empty_main)]
    for arg, c in want:
        check_int(fn, arg, c, minimum=0)
    n = sum(c for _, c in want)
    if n > T:
        fail(fn, "batch", f"must hold the {n} special rows (all_invalid + zero_length + empty_main)", T)
    spots = torch.linspace(0, T - 1, n).round().to(torch.int64).tolist() if n else []
    used: set[int] = set()
    it = iter(spots)
    for kind, c in want:
        for _ in range(c):
            t = next(it)
            while t in used:  # linspace rounding may repeat on small batches
                t = (t + 1) % T
            used.add(t)
            kinds[kind].append(t)
    return kinds


def _draw_segment(g: torch.Generator, T: int, K: int, pool: int, lengths: bool, kinds: dict[str, list[int]],
                  empty: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[T, K]`` int32 ids in ``[0, pool)`` (distinct per row) and ``[T]`` lengths (or None).
    ``empty``: the rows whose segment has no valid entry (zero-length: length 0 with stale valid
    ids past it when ``lengths``, else all ``-1``)."""
    ids = torch.rand(T, pool, generator=g).argsort(dim=1)[:, :K].to(torch.int32)
    col = torch.arange(K)
    # ordinary rows: a prefix of random length >= 1 (full for about a quarter of the rows) whose
    # first entry is never a hole, so only the special rows are empty
    n = torch.randint(1, K + 1, (T,), generator=g)
    full = torch.rand(T, generator=g) < 0.25
    n = torch.where(full, torch.full_like(n, K), n)
    holes = torch.rand(T, K, generator=g) < HOLE_RATE
    holes[:, 0] = False
    idx = torch.where(holes, torch.full_like(ids, -1), ids)
    stale = ids.clone()  # what past-length columns of zero-length rows hold
    past = col[None, :] >= n[:, None]
    idx = torch.where(past, torch.full_like(idx, -1), idx)
    ln = n.to(torch.int32)
    for t in kinds["all_invalid"]:
        idx[t] = -1
        ln[t] = K
    for t in empty:
        if lengths:
            idx[t] = stale[t]
            ln[t] = 0
        else:
            idx[t] = -1
    return idx, (ln if lengths else None)


def _cache(g: torch.Generator, idx_list: list[torch.Tensor], pool: int, bs: int, rule: ScaleRule,
           kv_log2: int) -> torch.Tensor:
    """A 584-byte paged cache of ``ceil(pool / bs) + 1`` pages (vLLM's page stride), 0xFF except
    the slots some entry of ``idx_list`` references (in or past a prefix), written by the
    reference writer with rows ``N(0, ROW_STD) * 2**u * 2**kv_log2`` (``u`` uniform in [-2, 2] per
    row), rounded to bf16. The spare last page stays poisoned."""
    nb = -(-pool // bs) + 1
    cache = empty_cache(nb, bs, production_page_stride(bs), fill=POISON)
    ids = torch.cat([i.reshape(-1) for i in idx_list]).to(torch.int64)
    slots = torch.unique(ids[ids >= 0], sorted=True)
    n = int(slots.numel())
    if n == 0:
        return cache
    rows = _rows(g, n, kv_log2)
    return insert(cache, rows, slots, bs, rule, inplace=True)


def _rows(g: torch.Generator, n: int, kv_log2: int) -> torch.Tensor:
    """``n`` bf16 rows ``N(0, ROW_STD) * 2**u * 2**kv_log2`` (``u`` uniform in [-2, 2] per row;
    RoPE dims scaled with the rest), computed in float32 (bf16's exponent range: |kv_log2| <= 120
    neither overflows nor leaves the normal range for the bulk of the values)."""
    x = torch.randn(n, HEAD_DIM, generator=g) * ROW_STD
    u = torch.rand(n, 1, generator=g) * 4 - 2
    return (x * torch.exp2(u) * 2.0**kv_log2).to(torch.bfloat16)


def _q_sink(g: torch.Generator, T: int, H: int, q_log2: int, sink: bool, sink_log2: int):
    q = (torch.randn(T, H, HEAD_DIM, generator=g).clamp_(-1, 1).mul_(2.0**q_log2)).to(torch.bfloat16)
    if not sink:
        return q, None
    s = torch.randn(H, generator=g, dtype=torch.float64) * 2.0**sink_log2
    if H >= 4:
        s[1], s[2] = math.inf, -math.inf
    return q, s.to(torch.float32)


def _positions(g: torch.Generator, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.randint(0, 4096, (T,), generator=g)
    return pos, cos_sin_cache(int(pos.max()) + 1, theta=ROPE_THETA)


def _params(kind: str, *, T: int, H: int, seed: int, kinds: dict, sink: bool, kv_log2: int, q_log2: int,
            sink_log2: int, dimension: tuple[str, ...], edge: str) -> dict:
    return {"layer": "sweep", "form": kind, "num_heads": H, "batch": T, "scale": CASE_SCALE,
            "rows": {k: list(v) for k, v in kinds.items()}, "sink": sink, "sink_infs": [1, 2] if sink and H >= 4 else [],
            "kv_log2": kv_log2, "q_log2": q_log2, "sink_log2": sink_log2, "dimension": list(dimension),
            "index_rule": IndexRule.MINUS1_ONLY.value, "edge": edge, "seed": seed}


def sweep_decode_case(name: str, *, batch: int, main: SegmentSpec, extra: SegmentSpec | None = None,
                      heads: int = 64, all_invalid: int = 1, zero_length: int = 1, empty_main: int = 0,
                      sink: bool = True, kv_log2: int = 0, q_log2: int = 0, sink_log2: int = 0, seed: int = 0,
                      dimension: tuple[str, ...] = (), edge: str = "") -> Case:
    """A decode case drawn directly (module docstring): ``batch`` tokens (``s_q = 1`` each, as
    vLLM flattens them), a main segment and an optional extra segment. ``empty_main`` rows need
    an extra segment (their extra entries stay valid)."""
    fn = "sweep_decode_case"
    if empty_main and extra is None:
        fail(fn, "empty_main", "needs an extra segment (its rows attend only the extra segment)", empty_main)
    g = torch.Generator().manual_seed(seed)
    kinds = _rows_kinds(fn, batch, all_invalid, zero_length, empty_main)
    q, s = _q_sink(g, batch, heads, q_log2, sink, sink_log2)
    pos, cs = _positions(g, batch)
    m_idx, m_len = _draw_segment(g, batch, main.topk, main.pool, main.lengths, kinds,
                                 kinds["zero_length"] + kinds["empty_main"])
    inputs = {"q": q, "scale": CASE_SCALE, "positions": pos, "cos_sin": cs,
              "swa_cache": _cache(g, [m_idx], main.pool, main.block_size, ScaleRule.AMAX_CLAMP, kv_log2),
              "swa_block_size": main.block_size, "swa_indices": m_idx}
    if m_len is not None:
        inputs["swa_lens"] = m_len
    if s is not None:
        inputs["sink"] = s
    if extra is not None:
        e_idx, e_len = _draw_segment(g, batch, extra.topk, extra.pool, extra.lengths, kinds, kinds["zero_length"])
        for t in kinds["empty_main"]:  # the extra segment of an empty-main row keeps valid entries
            e_idx[t, 0] = 0 if int(e_idx[t, 0]) < 0 else e_idx[t, 0]
            if e_len is not None:
                e_len[t] = max(int(e_len[t]), 1)
        inputs.update(extra_cache=_cache(g, [e_idx], extra.pool, extra.block_size, ScaleRule.SCALE_CLAMP, kv_log2),
                      extra_block_size=extra.block_size, extra_indices=e_idx)
        if e_len is not None:
            inputs["extra_lens"] = e_len
    params = _params("decode", T=batch, H=heads, seed=seed, kinds=kinds, sink=sink, kv_log2=kv_log2, q_log2=q_log2,
                     sink_log2=sink_log2, dimension=dimension, edge=edge)
    params.update(swa_block_size=main.block_size, extra_block_size=extra.block_size if extra else None,
                  main=main.describe(), extra=extra.describe() if extra else None,
                  topk=extra.topk if extra else main.topk, cos_sin_rows=int(cs.shape[0]))
    return Case(name, "decode", inputs, params)


def sweep_prefill_case(name: str, *, batch: int, topk: int, lengths: bool = True, pool: int | None = None,
                       heads: int = 64, all_invalid: int = 1, zero_length: int = 1, sink: bool = True,
                       kv_log2: int = 0, q_log2: int = 0, sink_log2: int = 0, seed: int = 0,
                       dimension: tuple[str, ...] = (), edge: str = "") -> Case:
    """A prefill case drawn directly: ``batch`` query tokens over one combined index table of
    ``topk`` columns into ``kv`` (bf16 rows, NaN where no index refers)."""
    fn = "sweep_prefill_case"
    check_int(fn, "topk", topk, minimum=1)
    pool = max(2 * topk, 256) if pool is None else check_int(fn, "pool", pool, minimum=topk)
    g = torch.Generator().manual_seed(seed)
    kinds = _rows_kinds(fn, batch, all_invalid, zero_length, 0)
    q, s = _q_sink(g, batch, heads, q_log2, sink, sink_log2)
    pos, _ = _positions(g, batch)
    idx, ln = _draw_segment(g, batch, topk, pool, lengths, kinds, kinds["zero_length"])
    kv = torch.full((pool, HEAD_DIM), math.nan, dtype=torch.bfloat16)
    ref = torch.unique(idx[idx >= 0].to(torch.int64), sorted=True)
    kv[ref] = _rows(g, int(ref.numel()), kv_log2)
    inputs = {"q": q, "kv": kv, "indices": idx, "scale": CASE_SCALE, "positions": pos}
    if ln is not None:
        inputs["topk_length"] = ln
    if s is not None:
        inputs["sink"] = s
    params = _params("prefill", T=batch, H=heads, seed=seed, kinds=kinds, sink=sink, kv_log2=kv_log2, q_log2=q_log2,
                     sink_log2=sink_log2, dimension=dimension, edge=edge)
    params.update(width=topk, lengths=lengths, pool=pool, topk=topk)
    return Case(name, "prefill", inputs, params)


# --------------------------------------------------------------------------- the case sets
# Default subset (appended to the stages' default cases by cases_attention): one small case per new
# dimension, so the CPU suite and `check` stay fast and each dimension's mutant is caught.

def default_sweep_decode() -> list[Case]:
    return [
        sweep_decode_case("sweep-odd-pages-53-69", batch=5, main=SegmentSpec(53, 64), extra=SegmentSpec(69, 128, False),
                          seed=101, dimension=("odd_page_size", "lengths"),
                          edge="odd page sizes 53 (main) and 69 (extra); extra without per-token lengths; an "
                               "all-invalid row (lengths K) and a zero-length row (stale valid ids)"),
        sweep_decode_case("sweep-odd-pages-61-576-no-sink", batch=4, main=SegmentSpec(61, 128, False),
                          extra=SegmentSpec(576, 64, pool=1152), sink=False, seed=102,
                          dimension=("odd_page_size", "lengths", "sink_off"),
                          edge="odd page sizes 61 (main) and 576 (extra, FlashMLA's largest); main without lengths; "
                               "no sink"),
        sweep_decode_case("sweep-long-topk-2048", batch=3, main=SegmentSpec(64, 128), extra=SegmentSpec(64, 2048),
                          all_invalid=0, seed=103, dimension=("long_topk",),
                          edge="extra top-k 2048 on power-of-two pages (columns past 512 matter)"),
        sweep_decode_case("sweep-empty-main", batch=5, main=SegmentSpec(64, 64), extra=SegmentSpec(2, 128),
                          all_invalid=0, zero_length=1, empty_main=2, seed=104, dimension=("empty_main",),
                          edge="rows whose main segment is empty (length 0) while the extra segment is not"),
        sweep_decode_case("sweep-tiny-kv", batch=4, main=SegmentSpec(64, 64), extra=SegmentSpec(64, 128),
                          kv_log2=-20, seed=105, dimension=("kv_magnitude",),
                          edge="caches 2**-20 below the simulated rows: scale bytes at the Q_A (105) and Q_S (114) "
                               "floors, extra codes FP8 subnormal, RoPE part scaled alike"),
        sweep_decode_case("sweep-huge-kv-tiny-q", batch=4, main=SegmentSpec(64, 64), extra=SegmentSpec(64, 128),
                          kv_log2=120, q_log2=-118, seed=106, dimension=("kv_magnitude", "q_magnitude"),
                          edge="caches 2**120 above the simulated rows (scale bytes ~240), q 2**-118 (bf16 "
                               "subnormals among it): moderate logits"),
        sweep_decode_case("sweep-huge-q-sinks", batch=4, main=SegmentSpec(64, 64), extra=SegmentSpec(64, 128),
                          q_log2=12, sink_log2=10, seed=107, dimension=("q_magnitude",),
                          edge="q 2**12 above the simulated one: logits in the hundreds to thousands, sinks of "
                               "the same magnitude (2**10)"),
    ]


def default_sweep_prefill() -> list[Case]:
    return [
        sweep_prefill_case("sweep-long-topk-2048", batch=3, topk=2048, seed=111, dimension=("long_topk",),
                           edge="top-k 2048 with per-token lengths; an all-invalid and a zero-length row"),
        sweep_prefill_case("sweep-tiny-kv-no-lengths", batch=4, topk=128, lengths=False, kv_log2=-18, sink=False,
                           seed=112, dimension=("kv_magnitude", "lengths", "sink_off"),
                           edge="rows 2**-18 below the simulated ones; no topk_length, no sink"),
        sweep_prefill_case("sweep-huge-kv-tiny-q", batch=4, topk=128, kv_log2=120, q_log2=-118, seed=113,
                           dimension=("kv_magnitude", "q_magnitude"), edge="rows 2**120 above, q 2**-118 below"),
        sweep_prefill_case("sweep-huge-q-sinks", batch=4, topk=128, q_log2=12, sink_log2=10, seed=114,
                           dimension=("q_magnitude",), edge="q 2**12 above: logits in the thousands, sinks 2**10"),
    ]


# Full sets: the default cases plus the grid (a GPU runner's; `DSV4_CASES=full`, `check --cases full`).
PAGE_PAIRS = ((2, 53), (53, 61), (61, 64), (64, 69), (69, 576), (576, 2))  # (main, extra) block sizes
TOPKS = (64, 576, 2048)
BATCHES = (4, 74, 321)
LENGTHS = ((True, True), (True, False), (False, True), (False, False))  # (main, extra) lengths present
PEAK_TOPK, PEAK_SK = 16384, 32768
MAGNITUDES = (("tiny-kv", -20, 0, 0), ("huge-kv-tiny-q", 120, -118, 0), ("huge-q-sinks", 0, 12, 10))


def full_decode_specs() -> list[tuple[str, dict]]:
    """``(name, sweep_decode_case keyword arguments)`` of the full decode grid (cheap: nothing is
    built; :func:`full_sweep_decode` builds them)."""
    out = []
    for i, (mbs, ebs) in enumerate(PAGE_PAIRS):
        for j, k in enumerate(TOPKS):
            b = BATCHES[(i + j) % 3]
            ml, el = LENGTHS[(i + 2 * j) % 4]
            ek = TOPKS[(j + 1) % 3]
            sink = (i + j) % 2 == 0
            heads = 128 if (i + j) % 3 == 1 else 64
            out.append((f"full-b{b}-h{heads}-pages{mbs}-{ebs}-top{k}-{ek}-len{int(ml)}{int(el)}-sink{int(sink)}",
                        dict(batch=b, heads=heads, main=SegmentSpec(mbs, k, ml), extra=SegmentSpec(ebs, ek, el),
                             sink=sink, all_invalid=2 if b > 4 else 1, zero_length=2 if b > 4 else 1,
                             empty_main=1 if b > 4 else 0, seed=1000 + 10 * i + j,
                             dimension=("odd_page_size", "long_topk", "batch", "lengths", "empty_main"),
                             edge="FlashMLA sparse-decode grid point (gen_testcase dimensions)")))
    out.append((f"full-peak-top{PEAK_TOPK}-sk{PEAK_SK}",
                 dict(batch=4, main=SegmentSpec(64, PEAK_TOPK, pool=PEAK_SK), extra=SegmentSpec(2, 512), seed=1100,
                      dimension=("long_topk",), edge="FlashMLA's peak case: top-k 16384, s_k 32768")))
    for n, (name, kv, q, s) in enumerate(MAGNITUDES):
        for mbs, ebs, k in ((61, 576, 576), (64, 2, 2048)):
            out.append((f"full-{name}-pages{mbs}-{ebs}-top{k}",
                        dict(batch=74, main=SegmentSpec(mbs, 128), extra=SegmentSpec(ebs, k), kv_log2=kv, q_log2=q,
                             sink_log2=s, empty_main=1, seed=1200 + 10 * n + k % 7,
                             dimension=("kv_magnitude" if kv else "q_magnitude", "batch"),
                             edge=f"magnitude sweep {name} at batch 74")))
    return out


def full_prefill_specs() -> list[tuple[str, dict]]:
    """``(name, sweep_prefill_case keyword arguments)`` of the full prefill grid."""
    out = []
    for j, k in enumerate((128, 640, 2048)):
        for n, b in enumerate(BATCHES):
            lengths = (j + n) % 2 == 0
            sink = (j + 2 * n) % 3 != 1
            out.append((f"full-b{b}-top{k}-len{int(lengths)}-sink{int(sink)}",
                        dict(batch=b, topk=k, lengths=lengths, sink=sink, heads=128 if n == 1 else 64,
                             all_invalid=2 if b > 4 else 1, zero_length=2 if b > 4 else 1, seed=2000 + 10 * j + n,
                             dimension=("long_topk", "batch", "lengths"), edge="FlashMLA sparse-prefill grid point")))
    out.append((f"full-peak-top{PEAK_TOPK}-sk{PEAK_SK}",
                 dict(batch=4, topk=PEAK_TOPK, pool=PEAK_SK, seed=2100, dimension=("long_topk",),
                      edge="top-k 16384 over 32768 rows")))
    for n, (name, kv, q, s) in enumerate(MAGNITUDES):
        out.append((f"full-{name}-top2048",
                    dict(batch=74, topk=2048, kv_log2=kv, q_log2=q, sink_log2=s, seed=2200 + n,
                         dimension=("kv_magnitude" if kv else "q_magnitude", "batch"),
                         edge=f"magnitude sweep {name} at batch 74")))
    return out


def full_sweep_decode() -> list[Case]:
    return [sweep_decode_case(name, **kw) for name, kw in full_decode_specs()]


def full_sweep_prefill() -> list[Case]:
    return [sweep_prefill_case(name, **kw) for name, kw in full_prefill_specs()]


@register_cases("decode", size="full")
def decode_full_cases() -> list[Case]:
    from .attention import decode_cases

    return decode_cases() + full_sweep_decode()


@register_cases("prefill", size="full")
def prefill_full_cases() -> list[Case]:
    from .attention import prefill_cases

    return prefill_cases() + full_sweep_prefill()
