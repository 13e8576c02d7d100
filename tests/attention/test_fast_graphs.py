"""CUDA-graph replay of the fast oracle (``reference.attention.fast_graphs``): a replayed call is within the
bound of the ordered oracle like an eager one, returns tensors that no later call changes,
raises the same deferred validation errors, and still recomputes the rows that need ordered
logits; the default captures a signature on its second call only. GPU tests skip on a machine
without CUDA; the argument rules and the cache's refusals are checked everywhere."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4_numerics.reference.attention import fast_graphs
from dsv4_numerics.reference.attention.ordered import Segment, sparse_attention
from dsv4_numerics.reference.attention.fast import BOUND_OUTPUTS, fast_sparse_attention
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.policies import IndexRule

from .test_attention_fast import HELD_OUT, N_DEFAULT, all_cases, case_segments, assert_matches_ordered, segments_on

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")


def graph_inputs(seed: int, T=5, H=4, D=64, N=40, K=12, dev="cpu", nan_row=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
    rows = (torch.randn(N, D, generator=g) * 3).to(torch.bfloat16)
    if nan_row is not None:
        rows[nan_row, 3] = math.nan
    idx = torch.randint(-1, N, (T, K), generator=g, dtype=torch.int32)
    ln = torch.randint(0, K + 1, (T,), generator=g, dtype=torch.int32)
    sink = torch.randn(H, generator=g)
    sink[1] = -math.inf
    segs = [Segment(rows.to(dev), idx.to(dev), ln.to(dev), IndexRule.MINUS1_ONLY)]
    return q.to(dev), segs, sink.to(dev)


def _check(f, q, segs, scale, sink, **kw):
    """``f`` against the ordered oracle on the same inputs, on the CPU."""
    o = sparse_attention(q.cpu(), segments_on(segs, "cpu"), scale, None if sink is None else sink.cpu(), **kw)
    assert_matches_ordered(f, o)


def test_graph_argument_is_validated():
    q, segs, sink = graph_inputs(1)
    with pytest.raises(InputError, match="graph"):
        fast_sparse_attention(q, segs, 0.125, sink, graph="yes")


def test_cache_refuses_when_disabled_or_not_due():
    c = fast_graphs.GraphCache(max_bytes=100)
    c.enabled = False
    boom = lambda st: pytest.fail("must not capture")  # noqa: E731
    assert c.replay("k", lambda: [None], lambda: 10, boom, boom) is None  # disabled
    c.enabled = True
    assert c.replay("k", lambda: [None], lambda: 10, boom, boom) is None  # first sighting: not due
    assert c.stats()["captures"] == 0
    with pytest.raises(TypeError):
        fast_graphs.set_enabled(1)


@cuda
@pytest.mark.parametrize("i", [0, 3, N_DEFAULT, N_DEFAULT + len(HELD_OUT) - 1])
def test_replay_within_bound_and_owned(i):
    """Capture on a case, replay it with another case's data of the same signature (a second
    seed), then check both results against the ordered oracle: the first result must not have
    changed when the second call replayed."""
    stage, case = all_cases()[i]
    inp = case.inputs
    dev = torch.device("cuda")
    segs = segments_on(case_segments(case, stage), dev)
    sink = inp.get("sink")
    sink = None if sink is None else sink.to(dev)
    q = inp["q"].to(dev)
    before = fast_graphs.CACHE.stats()
    f1 = fast_sparse_attention(q, segs, inp["scale"], sink, graph=True)
    keep = {n: getattr(f1, n).clone() for n in BOUND_OUTPUTS}
    q2 = q.flip(0).contiguous()
    f2 = fast_sparse_attention(q2, segs, inp["scale"], sink, graph=True)
    after = fast_graphs.CACHE.stats()
    assert after["replays"] >= before["replays"] + 2, after
    for n in BOUND_OUTPUTS:
        assert torch.equal(getattr(f1, n).nan_to_num(), keep[n].nan_to_num()), n
    for f, qq in ((f1, q), (f2, q2)):
        assert_matches_ordered(f, sparse_attention(qq.cpu(), case_segments(case, stage), inp["scale"], inp.get("sink")))


@cuda
def test_default_captures_on_the_second_call_and_matches_eager():
    q, segs, sink = graph_inputs(7, T=6, H=8, N=50, K=16, dev="cuda")
    fast_graphs.CACHE.clear()
    c0 = fast_graphs.CACHE.stats()["captures"]
    e = fast_sparse_attention(q, segs, 0.125, sink, graph=False)
    fast_sparse_attention(q, segs, 0.125, sink)  # first sighting: eager
    assert fast_graphs.CACHE.stats()["captures"] == c0
    f = fast_sparse_attention(q, segs, 0.125, sink)  # second: captured and replayed
    assert fast_graphs.CACHE.stats()["captures"] == c0 + 1
    _check(f, q, segs, 0.125, sink)
    for n in BOUND_OUTPUTS:
        d = (getattr(f, n) - getattr(e, n)).abs().nan_to_num()
        assert bool((d <= 2 * f.bound[n]).all()), n  # both within the bound of the ordered result


@cuda
def test_replay_raises_the_deferred_validation_errors():
    q, segs, sink = graph_inputs(11, dev="cuda")
    fast_sparse_attention(q, segs, 0.125, sink, graph=True)
    s = segs[0]
    bad_len = [Segment(s.rows, s.idx, s.length.clone().fill_(99), s.rule)]
    bad_idx = [Segment(s.rows, s.idx.clone().fill_(-5), s.length.clone().fill_(3), s.rule)]
    for bs, sk in ((bad_len, sink), (bad_idx, sink), (segs, sink.clone().fill_(math.nan))):
        with pytest.raises(InputError) as ordered:
            sparse_attention(q.cpu(), segments_on(bs, "cpu"), 0.125, sk.cpu())
        with pytest.raises(InputError) as fast:
            fast_sparse_attention(q, bs, 0.125, sk, graph=True)
        assert str(fast.value).replace("fast_sparse_attention", "sparse_attention") == str(ordered.value)


@cuda
def test_replay_recomputes_rows_that_need_ordered_logits():
    q, segs, sink = graph_inputs(5, dev="cuda")
    fast_sparse_attention(q, segs, 0.125, sink, graph=True)
    q2, segs2, _ = graph_inputs(5, dev="cuda", nan_row=list(range(0, 40, 3)))  # NaN in valid rows
    f = fast_sparse_attention(q2, segs2, 0.125, sink, graph=True)
    assert any(bool(torch.isnan(getattr(f, n)).any()) for n in ("out", "lse"))
    _check(f, q2, segs2, 0.125, sink)


@cuda
def test_a_graph_larger_than_the_cache_is_dropped_and_the_call_stays_correct(monkeypatch):
    small = fast_graphs.GraphCache(max_bytes=1)
    monkeypatch.setattr(fast_graphs, "CACHE", small)
    q, segs, sink = graph_inputs(13, dev="cuda")
    f = fast_sparse_attention(q, segs, 0.125, sink, graph=True)
    st = small.stats()
    assert st["entries"] == 0 and st["captures"] == 0 and any("more than" in v for v in st["failed"].values()), st
    _check(f, q, segs, 0.125, sink)
    fast_sparse_attention(q, segs, 0.125, sink, graph=True)  # refused at once now: eager
    assert small.stats()["replays"] == 0


@cuda
@pytest.mark.parametrize("variant", ["chunks", "no_topk", "scrub", "no_sink", "no_lengths", "float32_rows", "two_segments",
                                     "want_abs", "want_abs_chunks"])
def test_every_call_shape_captures(variant, monkeypatch):
    """``_issue`` reads no device value on any of its paths (several chunks, K = 0, NaN scrubbing,
    no sink, no lengths, a float64 table from mixed dtypes, two segments with mixed rules, the
    ``pv_abs`` GEMM): the capture succeeds and the replay is within the bound of the ordered oracle
    (``pv_abs``: the eager call's, to float64 rounding)."""
    cache = fast_graphs.GraphCache()
    monkeypatch.setattr(fast_graphs, "CACHE", cache)
    q, segs, sink = graph_inputs(17, T=6, H=4, N=30, K=10, dev="cuda")
    s = segs[0]
    kw = {}
    if variant == "chunks":
        kw["chunk_tokens"] = 2
    elif variant == "no_topk":
        segs = [Segment(s.rows, s.idx[:, :0], torch.zeros_like(s.length), s.rule)]
    elif variant == "scrub":
        rows = s.rows.clone()
        rows[3, 1] = math.nan
        segs, kw["nan_policy"] = [Segment(rows, s.idx, s.length, s.rule)], "scrub"
    elif variant == "no_sink":
        sink = None
    elif variant == "no_lengths":
        segs = [Segment(s.rows, s.idx.clamp(min=0), None, IndexRule.MINUS1_ONLY)]
    elif variant == "float32_rows":
        segs = [Segment(s.rows.float(), s.idx, s.length, s.rule)]
    elif variant == "two_segments":
        segs = [s, Segment(s.rows[:7], s.idx.remainder(9), s.length.clamp(max=4), IndexRule.ANY_OUT_OF_RANGE_INVALID)]
    elif variant.startswith("want_abs"):
        kw["want_abs"] = True
        if variant.endswith("chunks"):
            kw["chunk_tokens"] = 4
    f = fast_sparse_attention(q, segs, 0.125, sink, graph=True, **kw)
    st = cache.stats()
    assert st["captures"] == 1 and st["replays"] == 1 and not st["failed"], st
    _check(f, q, segs, 0.125, sink, nan_policy=kw.get("nan_policy", "propagate"))
    if kw.get("want_abs"):
        e = fast_sparse_attention(q, segs, 0.125, sink, graph=False, **kw)
        assert f.pv_abs is not None and f.pv_abs.shape == f.out.shape
        # cuBLAS may pick another bfloat16 GEMM under capture: a bf16 rounding or two apart, both upper
        # bounds within bf16_abs_factor of the exact value
        assert torch.allclose(f.pv_abs, e.pv_abs, rtol=2.0**-6, atol=0), (f.pv_abs - e.pv_abs).abs().max()
        again = fast_sparse_attention(q, segs, 0.125, sink, graph=True, **kw)  # a replay owns its pv_abs
        assert again.pv_abs.data_ptr() != f.pv_abs.data_ptr() and torch.equal(again.pv_abs, f.pv_abs)
    else:
        assert f.pv_abs is None
