"""Shape buckets of the fast oracle (``reference.attention.fast_buckets``): the padding is invalid by every
convention, so the ordered oracle of a padded call equals the original call's bit for bit, the
bucketed fast result stays within its (padded call's) bound of the ordered oracle on every default
case, validation errors are those of the original arguments, and on CUDA two shapes
of one bucket share one captured graph (GPU test: skips without CUDA)."""

from __future__ import annotations

import functools

import pytest
import torch

from dsv4_numerics.reference.attention import fast_graphs
from dsv4_numerics.reference.attention.ordered import Segment, sparse_attention
from dsv4_numerics.reference.attention.fast import BOUND_OUTPUTS, fast_sparse_attention
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.attention.fast_buckets import bucket, flat_signature, pad_call, padded_shapes, write_padded
from dsv4_numerics.reference.policies import IndexRule

from .test_attention_fast import N_DEFAULT, all_cases, case_segments, assert_matches_ordered, segments_on
from .test_fast_graphs import graph_inputs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")


def test_bucket_grid():
    grid = [bucket(n) for n in range(0, 1100)]
    assert grid[:14] == [0, 1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    assert bucket(640) == 768 and bucket(1152) == 1536 and bucket(128) == 128 and bucket(512) == 512
    for n in range(1, 1100):
        b = grid[n]
        assert n <= b <= 1.5 * n and bucket(b) == b  # at most 1.5x; a bucket is its own bucket
    assert sorted(set(grid[1:])) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768,
                                     1024, 1536]  # ~2 log2(n) buckets up to n


@functools.lru_cache(maxsize=None)
def _ordered(i):
    stage, case = all_cases()[i]
    inp = case.inputs
    return sparse_attention(inp["q"], case_segments(case, stage), inp["scale"], inp.get("sink"))


# N_DEFAULT (test_attention_fast): the default decode and prefill cases; the held-out cases follow


def _bit_equal(a, b) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int64), b.contiguous().view(torch.int64))


@pytest.mark.parametrize("i", [0, N_DEFAULT - 1])  # a decode and a prefill case
def test_ordered_oracle_of_the_padded_call_is_bit_identical(i):
    # the claim the bucketed bound rests on (fast_buckets docstring)
    stage, case = all_cases()[i]
    inp = case.inputs
    segs = case_segments(case, stage)
    qp, sp = pad_call(inp["q"], segs)
    assert qp.shape[0] == bucket(inp["q"].shape[0]) and [s.idx.shape[1] for s in sp] == [
        bucket(s.idx.shape[1]) for s in segs]
    o = _ordered(i)
    p = sparse_attention(qp, sp, inp["scale"], inp.get("sink"))
    T = inp["q"].shape[0]
    for name in ("out", "lse", "lse_with_sink", "max_logits"):
        assert _bit_equal(getattr(p, name)[:T], getattr(o, name)), name
    assert torch.equal(p.n_valid[:T], o.n_valid) and not bool(p.n_valid[T:].any())  # padded tokens lonely


@pytest.mark.parametrize("i", range(N_DEFAULT))
def test_bucketed_fast_result_within_its_bound_on_every_default_case(i):
    stage, case = all_cases()[i]
    inp = case.inputs
    segs = case_segments(case, stage)
    o = _ordered(i)
    f = fast_sparse_attention(inp["q"], segs, inp["scale"], inp.get("sink"), bucket=True)
    assert_matches_ordered(f, o)  # shapes, non-finite values, n_valid and |fast - ordered| <= bound
    u = fast_sparse_attention(inp["q"], segs, inp["scale"], inp.get("sink"), bucket=False)
    assert f.exact_logits == u.exact_logits  # padded tokens are lonely: no approximate logits
    for name in BOUND_OUTPUTS:  # g_K' for K' >= K: the bucketed bound is never the smaller one
        assert bool((f.bound[name] >= u.bound[name]).all()), name


def test_validation_errors_are_the_original_arguments():
    q, segs, sink = graph_inputs(3, T=5, K=12, N=40)
    s = segs[0]
    assert padded_shapes(5, segs) == (6, [(48, 12)])
    q, segs, sink = graph_inputs(3, T=5, K=10, N=40)  # K' = 12: a length of 11 or 12 is still an error
    s = segs[0]
    for bad_len in (11, 12):
        ln = s.length.clone()
        ln[2] = bad_len
        bad = [Segment(s.rows, s.idx, ln, s.rule)]
        with pytest.raises(InputError) as plain:
            fast_sparse_attention(q, bad, 0.125, sink, bucket=False)
        with pytest.raises(InputError) as bucketed:
            fast_sparse_attention(q, bad, 0.125, sink, bucket=True)
        assert str(bucketed.value) == str(plain.value) and "length" in str(plain.value)
    # an index >= N inside the prefix: an error under minus1_only, invalid under any_out_of_range
    # (padded rows 40..47 exist in the padded table: the index must not start reading them)
    idx = s.idx.clone()
    idx[:, 0] = 41
    ln = torch.full_like(s.length, 10)
    with pytest.raises(InputError) as plain:
        fast_sparse_attention(q, [Segment(s.rows, idx, ln, IndexRule.MINUS1_ONLY)], 0.125, sink, bucket=False)
    with pytest.raises(InputError) as bucketed:
        fast_sparse_attention(q, [Segment(s.rows, idx, ln, IndexRule.MINUS1_ONLY)], 0.125, sink, bucket=True)
    assert str(bucketed.value) == str(plain.value)
    oor = [Segment(s.rows, idx, ln, IndexRule.ANY_OUT_OF_RANGE_INVALID)]
    f = fast_sparse_attention(q, oor, 0.125, sink, bucket=True)
    assert_matches_ordered(f, sparse_attention(q, oor, 0.125, sink))
    with pytest.raises(InputError, match="bucket"):
        fast_sparse_attention(q, segs, 0.125, sink, bucket="yes")


def test_no_lengths_pads_to_the_issued_width():
    """Without lengths every column is in the prefix: the padded call's implied length is its own
    padded K, which the deferred check must accept (seen on the H200: the FlashMLA sweep fuzz and
    the graph test without lengths raised the internal 'deferred validation' assertion)."""
    q, segs, sink = graph_inputs(17, T=6, H=4, N=30, K=10)
    s = segs[0]
    for rule in (IndexRule.MINUS1_ONLY, IndexRule.ANY_OUT_OF_RANGE_INVALID):
        none = [Segment(s.rows, s.idx.clamp(min=0), None, rule)]
        assert padded_shapes(6, none)[1][0][1] > 10  # the columns really are padded
        f = fast_sparse_attention(q, none, 0.125, sink, bucket=True)
        assert_matches_ordered(f, sparse_attention(q, none, 0.125, sink))


def _flat(q, sink, segs):
    return [q, sink] + [t for s in segs for t in (s.rows, s.idx, s.length)]


def _call(seed, T, Ks, Ns, lengths=(True, True), sink=True):
    """A two-segment call (the first ``minus1_only`` with indices up to ``N + 3``, out of range, the
    second ``any_out_of_range_invalid``), every value random."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, 3, 8, generator=g).to(torch.bfloat16)
    segs = []
    for K, N, rule, ln in zip(Ks, Ns, (IndexRule.MINUS1_ONLY, IndexRule.ANY_OUT_OF_RANGE_INVALID), lengths):
        rows = torch.randn(N, 8, generator=g).to(torch.bfloat16)
        idx = torch.randint(-1, N + 3, (T, K), generator=g, dtype=torch.int32)
        length = torch.randint(0, K + 1, (T,), generator=g, dtype=torch.int32) if ln else None
        segs.append(Segment(rows, idx, length, rule))
    return q, (torch.randn(3, generator=g) if sink else None), segs


@pytest.mark.parametrize("lengths,sink", [((True, True), True), ((False, True), False)])
def test_write_padded_leaves_the_static_inputs_equal_to_pad_call_after_every_call(lengths, sink):
    """A replay writes each call into the static buffers of its bucket (``write_padded``) instead of
    building the padded call: after every call of a sequence whose tokens, columns and rows grow and
    shrink inside one bucket, the buffers equal ``pad_call``'s tensors of that call exactly (stale
    data of a larger earlier call is padding again), and the signature from the shapes alone is
    the padded call's."""
    shapes = [(7, (11, 5), (45, 20)), (8, (12, 6), (48, 24)), (7, (9, 5), (37, 18)), (8, (10, 6), (40, 17)),
              (7, (12, 5), (48, 24)), (7, (9, 5), (33, 17))]
    Tp, padded = padded_shapes(7, _call(0, *shapes[0], lengths, sink)[2])
    for T, Ks, Ns in shapes:  # all of one bucket: (8, [(48, 12), (24, 6)])
        assert padded_shapes(T, _call(0, T, Ks, Ns, lengths, sink)[2]) == (Tp, padded)
    first = _call(99, *shapes[0], lengths, sink)
    q0, sk0, segs0 = first
    qp0, sp0 = pad_call(q0, segs0)
    static = [None if t is None else t.clone() for t in _flat(qp0, sk0, sp0)]  # as a capture leaves them
    written = None
    for i, (T, Ks, Ns) in enumerate(shapes):
        q, sk, segs = _call(i, T, Ks, Ns, lengths, sink)
        written = write_padded(static, q, sk, segs, written)
        qp, sp = pad_call(q, segs)
        want = _flat(qp, sk, sp)
        assert flat_signature(q, sk, segs, True) == fast_graphs.signature(want)
        for j, (a, b) in enumerate(zip(static, want)):
            assert (a is None) == (b is None), (i, j)
            if a is not None:
                assert a.shape == b.shape and torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                                                          b.view(torch.int16) if b.dtype == torch.bfloat16 else b), (i, j)
    assert flat_signature(q, sk, segs, False) == fast_graphs.signature(_flat(q, sk, segs))


@cuda
def test_shapes_of_one_bucket_share_one_graph_and_stay_within_the_bound():
    fast_graphs.CACHE.clear()
    c0 = fast_graphs.CACHE.stats()
    dev = "cuda"
    qa, sa, sink = graph_inputs(21, T=7, K=11, N=45, dev=dev)  # bucket (8, 12, 48)
    qb, sb, _ = graph_inputs(22, T=8, K=12, N=48, dev=dev)  # a new shape, the same bucket
    for _ in range(2):  # the second call of the bucket captures
        f = fast_sparse_attention(qa, sa, 0.125, sink)
    c1 = fast_graphs.CACHE.stats()
    assert c1["captures"] - c0["captures"] == 1
    fb = fast_sparse_attention(qb, sb, 0.125, sink)  # first call of this shape: replays the graph
    c2 = fast_graphs.CACHE.stats()
    assert c2["captures"] == c1["captures"] and c2["replays"] == c1["replays"] + 1
    for (q, s, r) in ((qa, sa, f), (qb, sb, fb)):
        o = sparse_attention(q.cpu(), segments_on(s, "cpu"), 0.125, sink.cpu())
        assert_matches_ordered(r, o)


def test_bench_summary_puts_eager_judge_bucketed_first_and_replayed_side_by_side():
    from dsv4_numerics.bench.gpu import summarize

    def rec(cfg, eager, judge, first, replayed, judge_first=None, judge_replayed=None):
        r = {"config": cfg, "batch": 128, "ratio": 900.0, "flashmla_ms": 0.1, "oracle_ms": 90.0,
             "oracle_peak_extra_bytes": 0, "fast_ms": replayed / 10, "fast_ratio": replayed,
             "fast_graph_replayed": True, "fast_eager_ms": eager / 10, "fast_eager_ratio": eager,
             "fast_judge_eager_ms": judge / 10, "fast_judge_eager_ratio": judge,
             "fast_bucketed_first_ms": first / 10, "fast_bucketed_first_ratio": first,
             "fast_bucketed_first_replayed": True, "oracle_gflops": 1.0, "oracle_stream_gbps": 1.0}
        if judge_first is not None:
            r.update(fast_judge_bucketed_first_ms=judge_first / 10, fast_judge_bucketed_first_ratio=judge_first)
        if judge_replayed is not None:
            r.update(fast_judge_ms=judge_replayed / 10, fast_judge_ratio=judge_replayed)
        return r

    assert "within 10x" in summarize([rec("h64", 9.6, 9.9, 9.1, 8.3, 9.2)])["fast_target"]  # the default target
    assert summarize([rec("h64", 9.6, 9.9, 9.1, 8.3, 9.2)])["fast_judge_eager_target_met"]
    assert not summarize([rec("h64", 9.6, 10.4, 9.1, 8.3, 9.2)])["fast_judge_eager_target_met"]

    def summarize20(recs):  # the figures below against a 20x target
        return summarize(recs, target_ratio=20.0)

    s = summarize20([rec("h64", 19.6, 20.4, 14.1, 13.3, 15.2, 13.8), rec("h128", 15.2, 16.0, 13.9, 13.5, 14.4, 20.7)])
    assert s["fast_ratios_at_batch_128"] == {
        "h64": {"eager": 19.6, "judge_eager": 20.4, "bucketed_first": 14.1, "judge_bucketed_first": 15.2,
                "replayed": 13.3, "judge_replayed": 13.8},
        "h128": {"eager": 15.2, "judge_eager": 16.0, "bucketed_first": 13.9, "judge_bucketed_first": 14.4,
                 "replayed": 13.5, "judge_replayed": 20.7}}
    assert not s["fast_judge_replayed_target_met"]  # h128's judge replay above 20x
    assert summarize20([rec("h64", 19.6, 20.4, 14.1, 13.3, 15.2, 13.8)])["fast_judge_replayed_target_met"]
    assert s["fast_bucketed_first_target_met"] and s["fast_bucketed_first_replayed_at_batch_128"]["h64"]
    assert s["fast_eager_target_met"] and not s["fast_judge_eager_target_met"]
    assert s["fast_judge_bucketed_first_target_met"]
    assert not summarize20([rec("h64", 20.2, 20.2, 20.5, 13.3)])["fast_bucketed_first_target_met"]
    assert not summarize20([rec("h64", 20.2, 20.2, 20.5, 13.3)])["fast_eager_target_met"]
    # an older record without the judge's bucketed call: no ratio, target not met
    old = summarize20([rec("h64", 19.6, 20.4, 14.1, 13.3)])
    assert old["fast_ratios_at_batch_128"]["h64"]["judge_bucketed_first"] is None
    assert old["fast_ratios_at_batch_128"]["h64"]["judge_replayed"] is None
    assert not old["fast_judge_bucketed_first_target_met"] and not old["fast_judge_replayed_target_met"]
    assert not summarize20([rec("h64", 19.6, 20.4, 14.1, 13.3, 20.1)])["fast_judge_bucketed_first_target_met"]
    # the judge's eager host operations, per configuration, where the record has them
    counted = rec("h64", 9.6, 9.9, 9.1, 8.3, 9.2)
    counted["fast_judge_eager_host_ops"] = {"empty": 15, "view": 7, "bmm": 3}
    assert summarize([counted, rec("h128", 9.6, 9.9, 9.1, 8.3)])["judge_eager_host_ops_at_batch_128"] == {"h64": 25}


def test_bench_host_ops_counts_the_aten_operations_a_call_dispatches():
    """``bench.gpu.host_ops``: every aten operation of one call, views and allocations included,
    by name, most frequent first; a call that dispatches nothing counts nothing."""
    from dsv4_numerics.bench.gpu import host_ops

    x, a = torch.zeros(4, 3), torch.ones(3, 2)

    def call():
        y = x.view(3, 4)
        x.add_(1.0)
        x.add_(2.0)
        return torch.mm(y.t(), torch.empty(3, 2).copy_(a))

    ops = host_ops(call)
    assert ops == {"add_": 2, "view": 1, "t": 1, "mm": 1, "empty": 1, "copy_": 1}
    assert list(ops)[0] == "add_"
    assert host_ops(lambda: None) == {}
    assert bool((x == 3.0).all())  # the call ran, once


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the bench's host launch cost)")
def test_bench_host_launch_cost_is_a_positive_number_of_microseconds():
    from dsv4_numerics.bench.gpu import host_launch_us

    us = host_launch_us(torch.device("cuda"), n=200)
    assert 0.1 < us < 10_000, us
