"""Speed of the judge on a GPU: the float64 oracle against FlashMLA decode, and the reference
byte writer against vLLM's writers, side by side in one run.

    python -m dsv4_numerics.bench.gpu --out bench.json [--quick]

Attention (FlashMLA MODEL1 production shapes, FMLA ``tests/test_flash_mla_sparse_decoding.py``
CONFIG1-4: main top-k 128 on pages of 256, extra top-k 512 / 1024 on pages of 64 (C4A) or 2
(C128A); vLLM calls with ``s_q = 1`` per token, attention.md 2.5): for every configuration and
batch size the script times

* ``flashmla_ms``   -- ``flash_mla_with_kvcache`` alone (inputs prepared, schedule metadata
                       reused after the first call as vLLM reuses it within a step),
* ``oracle_ms``     -- ``reference.attention.ordered.sparse_attention`` (fixed-order float64) on the
                       same tokens, rows pre-dequantised, ``chunk_tokens`` chosen to fit the
                       ``--oracle-budget-gib`` (default 2 GiB) memory target,
* ``fast_ms``       -- ``reference.attention.fast.fast_sparse_attention`` (the GPU judging oracle:
                       unordered float64 GEMMs plus its a-priori bound), default chunking, with
                       ``fast_ratio = fast_ms / flashmla_ms``, ``fast_peak_extra_bytes``, and the
                       largest observed ``|fast - ordered|`` and returned bound per output
                       (``fast_vs_ordered``). The default call replays a CUDA graph once its
                       signature comes a second time (``reference.attention.fast_graphs``), as these
                       timing loops do (``fast_graph_replayed``); ``fast_eager_ms`` /
                       ``fast_eager_ratio`` time ``graph=False``, what a call whose shapes are
                       seen once costs (fuzzing, a matrix of cases), with its own
                       ``fast_eager_vs_ordered``; ``fast_judge_eager_ms`` / ``_ratio`` time
                       the attention judge's own call (eager, ``want_abs=True``: plus the
                       bf16-P budget ``pv_abs``, one bfloat16 GEMM), with the aten operations
                       its host dispatches (``fast_judge_eager_host_ops``, ``host_ops``: the
                       host work that sets an eager call's time on a slow host), and
                       ``fast_judge_ms`` / ``_ratio`` the same call replayed; ``fast_bucketed_first_ms`` /
                       ``_ratio`` time the first call of a new shape whose shape bucket
                       (``reference.attention.fast_buckets``) is already captured, what a matrix case or
                       fuzz draw costs by default (``bench_bucketed_first``); the summary's
                       ``fast_ratios_at_batch_128`` puts eager, bucketed-first (plain and the judge's) and replayed
                       side by side,
* ``fused_ms`` / ``fused_eager_ms`` / ``fused_judge_eager_ms`` / ``fused_judge_ms`` -- the same
                       calls through the fused Triton kernels (``fused=True``,
                       ``reference.attention.fast_fused``; the plain ``fast_*`` keys time
                       ``fused=False``): replayed, eager, the judge's eager call and the judge's call
                       replayed, each checked against the ordered oracle (``fused_*_vs_ordered``,
                       part of ``fast_within_bound_everywhere``), with ``fused_peak_extra_bytes``;
                       the summary's ``fused_ratios_at_batch_128`` puts them beside the PyTorch
                       path's (``old_*``), ``fused_error`` where the kernels are not available,
* ``bmm_fp64_ms``   -- the same arithmetic as unordered float64 ``bmm``s on gathered rows: what
                       float64 costs on this GPU when the reduction order is left to cuBLAS
                       (the price of bit-reproducibility is ``oracle_ms / bmm_fp64_ms``),

as medians over CUDA-event timed iterations, with ``ratio = oracle_ms / flashmla_ms`` and the
oracle's peak extra memory (``torch.cuda.max_memory_allocated`` minus what was allocated
before). ``bounds`` explains what limits the oracle: its float64 FLOP rate and the bytes its
fixed-order loops stream (each of the ``D`` logit steps and ``K`` value steps reads and writes a
float64 ``[chunk, H, K]`` / ``[chunk, H, D]`` accumulator).

Writers: ``reference.caches.model1.insert`` (Q_A) against vLLM's Triton
``quantize_and_insert_k_cache`` and, when the staged CUDA library is present, the CUDA
``fused_deepseek_v4_kv_rope_insert`` driven as the matrix entry ``vllm_cuda.kv_rope_insert``
drives it (a kernel that is not importable is reported as such).

Input content does not affect timing: cache bytes are random finite FP8 codes with scale bytes
in [115, 125] and N(0, 0.1) bf16 RoPE values; indices are distinct valid slots, full lengths.
"""

from __future__ import annotations

import argparse
import math
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from dsv4_numerics.reference.attention.ordered import Segment, peak_bytes_estimate, sparse_attention
from dsv4_numerics.reference.attention import fast_graphs
from dsv4_numerics.reference.attention.fast_buckets import bucket
from dsv4_numerics.reference.attention.fast import BOUND_OUTPUTS, fast_sparse_attention
from dsv4_numerics.reference.caches.model1 import dequantize_all, insert, kernel_view
from dsv4_numerics.reference.constants import (
    C4_BLOCK_SIZE,
    C128_BLOCK_SIZE,
    DATA_ROW_BYTES,
    HEAD_DIM,
    KV_BLOCK_SIZE,
    NOPE_DIM,
    SCALE_ROW_BYTES,
    SWA_BLOCK_SIZE,
    SWA_WINDOW,
    production_page_stride,
)
from dsv4_numerics.reference.policies import IndexRule, ScaleRule, Ue8m0Consumer

GiB = 2**30
H200_FP64_PEAK_TFLOPS = 67.0  # NVIDIA H200 SXM datasheet, FP64 Tensor Core (FP64 vector: 34)

# (name, heads, extra_topk, extra_block_size): FlashMLA MODEL1 CONFIG1-4 shapes
CONFIGS = [
    ("h64-c4a-top512", 64, 512, C4_BLOCK_SIZE),
    ("h128-c4a-top1024", 128, 1024, C4_BLOCK_SIZE),
    ("h64-c128a-top512-bs2", 64, 512, C128_BLOCK_SIZE),
    ("h128-c128a-top1024-bs2", 128, 1024, C128_BLOCK_SIZE),
]
BATCHES = [2, 8, 32, 128, 256]


# ----------------------------------------------------------------------------- inputs

def random_cache(num_slots: int, bs: int, g: torch.Generator, device) -> torch.Tensor:
    """A 584-byte paged cache ``[nb, production_page_stride(bs)]`` holding ``num_slots`` random
    finite records (codes avoid 0x7F/0xFF, scale bytes 115..125, RoPE N(0, 0.1) bf16)."""
    nb = -(-num_slots // bs)
    stride = production_page_stride(bs)
    codes = torch.randint(0, 0x7F, (nb, bs, NOPE_DIM), generator=g, dtype=torch.int32)
    sign = torch.randint(0, 2, (nb, bs, NOPE_DIM), generator=g, dtype=torch.int32) << 7
    codes = (codes | sign).to(torch.uint8)
    rope = (torch.randn(nb, bs, 64, generator=g) * 0.1).to(torch.bfloat16).view(torch.uint8)
    scales = torch.zeros(nb, bs, SCALE_ROW_BYTES, dtype=torch.uint8)
    scales[:, :, :7] = torch.randint(115, 126, (nb, bs, 7), generator=g, dtype=torch.int32).to(torch.uint8)
    page = torch.zeros(nb, stride, dtype=torch.uint8)
    page[:, : bs * DATA_ROW_BYTES] = torch.cat([codes, rope], dim=2).reshape(nb, -1)
    page[:, bs * DATA_ROW_BYTES: bs * (DATA_ROW_BYTES + SCALE_ROW_BYTES)] = scales.reshape(nb, -1)
    return page.to(device)


def decode_inputs(batch: int, heads: int, extra_topk: int, extra_bs: int, seed: int, device):
    g = torch.Generator().manual_seed(seed)
    swa_slots = batch * SWA_WINDOW
    ext_slots = max(batch * extra_topk // 4, extra_topk)  # requests share compressed entries
    swa_cache = random_cache(swa_slots, KV_BLOCK_SIZE, g, device)
    ext_cache = random_cache(ext_slots, extra_bs, g, device)
    n_swa = swa_cache.shape[0] * KV_BLOCK_SIZE
    n_ext = ext_cache.shape[0] * extra_bs
    swa_idx = torch.stack([torch.randperm(n_swa, generator=g)[:SWA_WINDOW] for _ in range(batch)]).to(torch.int32)
    ext_idx = torch.stack([torch.randperm(n_ext, generator=g)[:extra_topk] for _ in range(batch)]).to(torch.int32)
    q = torch.randn(batch, heads, HEAD_DIM, generator=g).clamp(-1, 1).to(torch.bfloat16)
    sink = torch.randn(heads, generator=g)
    return {
        "q": q.to(device), "sink": sink.to(device), "scale": HEAD_DIM**-0.5,
        "swa_cache": swa_cache, "swa_idx": swa_idx.to(device),
        "swa_len": torch.full((batch,), SWA_WINDOW, dtype=torch.int32, device=device),
        "ext_cache": ext_cache, "ext_bs": extra_bs, "ext_idx": ext_idx.to(device),
        "ext_len": torch.full((batch,), extra_topk, dtype=torch.int32, device=device),
    }


# ----------------------------------------------------------------------------- timing

def cuda_median_ms(fn, warmup: int, iters: int) -> tuple[float, list[float]]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), times


def host_launch_us(device, n: int = 2000) -> float:
    """The host's cost of one small CUDA op (a ``[128, 64, 1]`` float64 add, issued ``n`` times
    without a sync; median of 3 rounds), in microseconds: what bounds an eager fast-oracle call
    on hosts where its ~65 kernels take longer to issue than the GPU takes to run them."""
    x = torch.zeros(128, 64, 1, dtype=torch.float64, device=device)
    rounds = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            x.add_(1.0)
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    torch.cuda.synchronize()
    return statistics.median(rounds)


def host_ops(fn) -> dict[str, int]:
    """The aten operations one call of ``fn`` dispatches, ``{name: count}`` (``TorchDispatchMode``;
    views and allocations included, Triton launches not, being no aten operations), most frequent
    first: the per-call host work of an eager call, counted rather than timed."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    counts: Counter = Counter()

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    with _Count():
        fn()
    return dict(counts.most_common())


def flashmla_fn(inp):
    from dsv4_numerics.kernels.flashmla.sparse import flashmla_interface

    fm = flashmla_interface()
    q = inp["q"].unsqueeze(1).contiguous()
    swa = kernel_view(inp["swa_cache"], KV_BLOCK_SIZE).unsqueeze(2)
    ext = kernel_view(inp["ext_cache"], inp["ext_bs"]).unsqueeze(2)
    sched, _ = fm.get_mla_metadata()
    args = dict(q=q, k_cache=swa, block_table=None, cache_seqlens=None, head_dim_v=HEAD_DIM,
                tile_scheduler_metadata=sched, softmax_scale=inp["scale"], is_fp8_kvcache=True,
                indices=inp["swa_idx"].unsqueeze(1), attn_sink=inp["sink"], topk_length=inp["swa_len"],
                extra_k_cache=ext, extra_indices_in_kvcache=inp["ext_idx"].unsqueeze(1),
                extra_topk_length=inp["ext_len"])
    return lambda: fm.flash_mla_with_kvcache(**args)


def oracle_setup(inp):
    rows_swa = dequantize_all(inp["swa_cache"], KV_BLOCK_SIZE, consumer=Ue8m0Consumer.FLASHMLA)
    rows_ext = dequantize_all(inp["ext_cache"], inp["ext_bs"], consumer=Ue8m0Consumer.FLASHMLA)
    return [Segment(rows_swa, inp["swa_idx"], inp["swa_len"], IndexRule.MINUS1_ONLY),
            Segment(rows_ext, inp["ext_idx"], inp["ext_len"], IndexRule.MINUS1_ONLY)]


def bmm_fp64_fn(inp, segs):
    idx = torch.cat([s.idx.long() for s in segs], dim=1)  # [T, K] into the concatenated rows
    off = segs[0].rows.shape[0]
    idx[:, segs[0].idx.shape[1]:] += off
    rows = torch.cat([segs[0].rows, segs[1].rows]).double()
    q = inp["q"].double()
    scale = inp["scale"]

    def run():
        kv = rows[idx]  # [T, K, D]
        s = torch.bmm(q, kv.transpose(1, 2)) * scale  # [T, H, K]
        p = torch.softmax(s, dim=-1)
        return torch.bmm(p, kv)

    return run


def bench_attention(configs, batches, warmup, iters, budget_gib, device, log):
    rows = []
    for name, heads, extra_topk, extra_bs in configs:
        for batch in batches:
            inp = decode_inputs(batch, heads, extra_topk, extra_bs, seed=batch * 131 + heads, device=device)
            k_total = SWA_WINDOW + extra_topk
            rec = {"config": name, "heads": heads, "batch": batch, "s_q": 1, "topk": SWA_WINDOW,
                   "block_size": KV_BLOCK_SIZE, "extra_topk": extra_topk, "extra_block_size": extra_bs}
            try:
                rec["flashmla_ms"], _ = cuda_median_ms(flashmla_fn(inp), warmup, iters)
            except Exception as e:  # noqa: BLE001 - report, keep benchmarking the reference
                rec["flashmla_error"] = f"{type(e).__name__}: {e}"[:400]
            segs = oracle_setup(inp)
            per_tok = peak_bytes_estimate(1, heads, k_total)
            chunk = max(1, min(batch, int(budget_gib * GiB * 0.9) // per_tok))
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            oracle = lambda: sparse_attention(inp["q"], segs, inp["scale"], sink=inp["sink"], chunk_tokens=chunk)  # noqa: E731
            o_iters = max(1, min(iters, 3 if batch >= 128 else iters))
            rec["oracle_ms"], _ = cuda_median_ms(oracle, 1, o_iters)
            rec["oracle_chunk_tokens"] = chunk
            rec["oracle_peak_extra_bytes"] = int(torch.cuda.max_memory_allocated() - base)
            ordered = oracle()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            # the PyTorch path (fused=False) under the plain keys; the fused Triton kernels
            # (reference.attention.fast_fused) under fused_* (bench_fused), side by side
            # the default call: a signature's second call captures a CUDA graph, later calls replay it
            fast = lambda: fast_sparse_attention(inp["q"], segs, inp["scale"], sink=inp["sink"], fused=False)  # noqa: E731
            g0 = fast_graphs.CACHE.stats()
            rec["fast_ms"], _ = cuda_median_ms(fast, 2, iters)
            g1 = fast_graphs.CACHE.stats()
            rec["fast_graph_replayed"] = g1["replays"] - g0["replays"] >= iters
            rec["fast_vs_ordered"] = fast_vs_ordered(fast(), ordered)
            bench_bucketed_first(rec, inp, segs, ordered, iters)
            bench_bucketed_first(rec, inp, segs, ordered, iters, judge=True)
            # eager (graph=False): what a call with a signature seen once costs
            eager = lambda: fast_sparse_attention(inp["q"], segs, inp["scale"], sink=inp["sink"], graph=False,  # noqa: E731
                                                  fused=False)
            rec["fast_eager_ms"], _ = cuda_median_ms(eager, 2, iters)
            rec["fast_eager_vs_ordered"] = fast_vs_ordered(eager(), ordered)
            # the judge's call: eager, with the bf16-P budget pv_abs (want_abs=True)
            judge = lambda: fast_sparse_attention(inp["q"], segs, inp["scale"], sink=inp["sink"], graph=False,  # noqa: E731
                                                  want_abs=True, fused=False)
            rec["fast_judge_eager_ms"], _ = cuda_median_ms(judge, 2, iters)
            rec["fast_judge_eager_vs_ordered"] = fast_vs_ordered(judge(), ordered)
            rec["fast_judge_eager_host_ops"] = host_ops(judge)
            # the judge's call replayed: the default call with pv_abs (its graph captured on the second call)
            judge_r = lambda: fast_sparse_attention(inp["q"], segs, inp["scale"], sink=inp["sink"],  # noqa: E731
                                                    want_abs=True, fused=False)
            g0 = fast_graphs.CACHE.stats()
            rec["fast_judge_ms"], _ = cuda_median_ms(judge_r, 2, iters)
            rec["fast_judge_graph_replayed"] = fast_graphs.CACHE.stats()["replays"] - g0["replays"] >= iters
            rec["fast_judge_vs_ordered"] = fast_vs_ordered(judge_r(), ordered)
            fast_graphs.CACHE.clear()  # the graph's pool and static inputs count until here
            rec["fast_peak_extra_bytes"] = int(torch.cuda.max_memory_allocated() - base)
            bench_fused(rec, inp, segs, ordered, iters)
            bench_torch_passes(rec, inp, segs, ordered, iters)
            del ordered
            try:
                rec["bmm_fp64_ms"], _ = cuda_median_ms(bmm_fp64_fn(inp, segs), 1, o_iters)
            except torch.cuda.OutOfMemoryError as e:
                rec["bmm_fp64_error"] = f"OutOfMemoryError: {str(e)[:200]}"
                torch.cuda.empty_cache()
            flops = 4.0 * batch * heads * k_total * HEAD_DIM  # QK^T and P V, multiply-add = 2
            rec["flops"] = flops
            rec["oracle_gflops"] = flops / (rec["oracle_ms"] * 1e-3) / 1e9
            # bytes the fixed-order loops stream: D logit steps read+write a [chunk,H,K] f64
            # accumulator and read a [chunk,1,K] slice; K value steps read+write [chunk,H,D]
            rec["oracle_stream_bytes"] = float(batch * heads * 8 * (HEAD_DIM * k_total * 2 + k_total * HEAD_DIM * 2))
            rec["oracle_stream_gbps"] = rec["oracle_stream_bytes"] / (rec["oracle_ms"] * 1e-3) / 1e9
            if "flashmla_ms" in rec:
                rec["ratio"] = rec["oracle_ms"] / rec["flashmla_ms"]
                rec["fast_ratio"] = rec["fast_ms"] / rec["flashmla_ms"]
                rec["fast_eager_ratio"] = rec["fast_eager_ms"] / rec["flashmla_ms"]
                rec["fast_judge_eager_ratio"] = rec["fast_judge_eager_ms"] / rec["flashmla_ms"]
                rec["fast_judge_ratio"] = rec["fast_judge_ms"] / rec["flashmla_ms"]
                for key in ("fused", "fused_eager", "fused_judge_eager", "fused_judge", "torch_passes",
                            "torch_passes_eager", "torch_passes_judge_eager"):
                    if f"{key}_ms" in rec:  # absent where the fused kernels are not available
                        rec[f"{key}_ratio"] = rec[f"{key}_ms"] / rec["flashmla_ms"]
                for key in ("fast_bucketed_first", "fast_judge_bucketed_first"):
                    if f"{key}_ms" in rec:  # absent where no smaller shape shares the batch's bucket
                        rec[f"{key}_ratio"] = rec[f"{key}_ms"] / rec["flashmla_ms"]
            if "bmm_fp64_ms" in rec:
                rec["determinism_cost"] = rec["oracle_ms"] / rec["bmm_fp64_ms"]
            log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items()}))
            rows.append(rec)
            del inp, segs
            torch.cuda.empty_cache()
    return rows


def bench_fused(rec: dict, inp: dict, segs: list, ordered, iters: int) -> None:
    """The fused Triton kernels (``fast_sparse_attention(fused=True)``, ``reference.attention.fast_fused``)
    beside the PyTorch path's keys: ``fused_ms`` (replayed CUDA graph, as ``fast_ms``),
    ``fused_eager_ms`` (``graph=False``), ``fused_judge_eager_ms`` (the judge's eager call,
    ``want_abs=True``) and ``fused_judge_ms`` (the judge's call replayed), each result checked
    against the ordered oracle (``fused_*_vs_ordered``: ``|fused - ordered|`` against the returned
    bound), ``fused_peak_extra_bytes`` (graphs included). ``fused_error`` where the kernels are not available."""
    from dsv4_numerics.reference.attention import fast_fused

    ok, why = fast_fused.available(inp["q"].device)
    if not ok:
        rec["fused_error"] = why
        return
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for key, kw in (("fused", {}), ("fused_eager", {"graph": False}),
                    ("fused_judge_eager", {"graph": False, "want_abs": True}), ("fused_judge", {"want_abs": True})):
        call = lambda: fast_sparse_attention(inp["q"], segs, inp["scale"], sink=inp["sink"], fused=True, **kw)  # noqa: E731
        g0 = fast_graphs.CACHE.stats()
        rec[f"{key}_ms"], _ = cuda_median_ms(call, 2, iters)
        if "graph" not in kw:
            rec[f"{key}_graph_replayed"] = fast_graphs.CACHE.stats()["replays"] - g0["replays"] >= iters
        rec[f"{key}_vs_ordered"] = fast_vs_ordered(call(), ordered)
    fast_graphs.CACHE.clear()
    rec["fused_peak_extra_bytes"] = int(torch.cuda.max_memory_allocated() - base)


def bench_torch_passes(rec: dict, inp: dict, segs: list, ordered, iters: int) -> None:
    """The fast oracle's PyTorch passes (``passes=False``) beside the default call, which takes the
    Triton passes (``reference.attention.fast_passes``) where Triton is importable: ``torch_passes_ms``
    (replayed, as ``fast_ms``), ``torch_passes_eager_ms`` and ``torch_passes_judge_eager_ms``, each
    checked against the ordered oracle (``torch_passes_*_vs_ordered``); ``fast_passes`` records
    whether the plain keys ran the Triton passes."""
    from dsv4_numerics.reference.attention import fast_passes

    rec["fast_passes"] = fast_passes.default_on(inp["q"].device)
    for key, kw in (("torch_passes", {}), ("torch_passes_eager", {"graph": False}),
                    ("torch_passes_judge_eager", {"graph": False, "want_abs": True})):
        call = lambda: fast_sparse_attention(inp["q"], segs, inp["scale"], sink=inp["sink"], fused=False,  # noqa: E731
                                             passes=False, **kw)
        rec[f"{key}_ms"], _ = cuda_median_ms(call, 2, iters)
        rec[f"{key}_vs_ordered"] = fast_vs_ordered(call(), ordered)
    fast_graphs.CACHE.clear()


def _first_tokens(segs, T: int) -> list:
    """The segments of a call over the first ``T`` tokens (views)."""
    return [Segment(s.rows, s.idx[:T], None if s.length is None else s.length[:T], s.rule) for s in segs]


def bench_bucketed_first(rec: dict, inp: dict, segs: list, ordered, iters: int, judge: bool = False) -> None:
    """``fast_bucketed_first_ms``: the first call of a NEW shape whose bucket
    (``reference.attention.fast_buckets``) already has a captured graph -- what a matrix case or a fuzz draw
    costs once its bucket is warm. Times ``iters`` calls over the first ``batch - j`` tokens
    (``j = 1..iters``, each shape called once; all in the batch's bucket when ``batch`` is a bucket
    value, as 128 is) after the default timing captured the bucket; ``fast_bucketed_first_replayed``:
    every one of them replayed the graph (none captured); ``fast_bucketed_first_vs_ordered``: the
    last one against the ordered oracle's first tokens (tokens are independent). ``judge``: the
    attention judge's own call instead (``want_abs=True``: plus the bf16-P budget ``pv_abs``),
    its bucket warmed by two calls at the whole batch first; keys ``fast_judge_bucketed_first_*``."""
    from types import SimpleNamespace

    T = inp["q"].shape[0]
    shapes = [T - j for j in range(1, iters + 1) if T - j > 0 and bucket(T - j) == bucket(T)]
    if not shapes:
        return
    key = "fast_judge_bucketed_first" if judge else "fast_bucketed_first"
    extra = {"want_abs": True, "fused": False} if judge else {"fused": False}
    for _ in range(2 if judge else 0):  # a signature's second call captures its graph
        fast_sparse_attention(inp["q"], segs, inp["scale"], sink=inp["sink"], **extra)
    g0 = fast_graphs.CACHE.stats()
    times, f = [], None
    for t in shapes:
        sg = _first_tokens(segs, t)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f = fast_sparse_attention(inp["q"][:t], sg, inp["scale"], sink=inp["sink"], **extra)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    g1 = fast_graphs.CACHE.stats()
    rec[f"{key}_ms"] = statistics.median(times)
    rec[f"{key}_shapes"] = len(shapes)
    rec[f"{key}_replayed"] = g1["replays"] - g0["replays"] == len(shapes) and g1["captures"] == g0["captures"]
    t = shapes[-1]
    o = SimpleNamespace(**{k: getattr(ordered, k)[:t] for k in BOUND_OUTPUTS})
    rec[f"{key}_vs_ordered"] = fast_vs_ordered(f, o)


def fast_vs_ordered(f, o) -> dict:
    """Per output: largest observed ``|fast - ordered|`` and largest returned bound (finite
    positions), whether every difference is within its bound, non-finite positions equal, and
    the fraction of (token, head) rows whose logits were proven exact."""
    rep = {"exact_logit_rows": f.exact_logits}
    for name in BOUND_OUTPUTS:
        a, b, bd = getattr(f, name), getattr(o, name), f.bound[name]
        fin = torch.isfinite(b)
        d = (a - b).abs()[fin]
        rep[name] = {"max_diff": float(d.max()) if d.numel() else 0.0,
                     "max_bound": float(bd.max()) if bd.numel() else 0.0,
                     "within_bound": bool((d <= bd[fin]).all()),
                     "nonfinite_equal": bool(torch.equal(fin, torch.isfinite(a)))}
    return rep


def bench_writers(ns, warmup, iters, device, log):
    out = []
    for n in ns:
        g = torch.Generator().manual_seed(n)
        k = (torch.randn(n, HEAD_DIM, generator=g) * 0.3).to(torch.bfloat16).to(device)
        nb = -(-n // SWA_BLOCK_SIZE) + 1
        slots = torch.randperm(nb * SWA_BLOCK_SIZE, generator=g)[:n].to(device)
        cache = torch.zeros(nb, production_page_stride(SWA_BLOCK_SIZE), dtype=torch.uint8, device=device)
        rec = {"tokens": n, "block_size": SWA_BLOCK_SIZE}
        rec["reference_insert_ms"], _ = cuda_median_ms(
            lambda: insert(cache, k, slots, SWA_BLOCK_SIZE, ScaleRule.AMAX_CLAMP), warmup, iters)
        try:
            from vllm.models.deepseek_v4.common.ops.cache_utils import quantize_and_insert_k_cache

            c2 = cache.clone()
            rec["vllm_triton_ms"], _ = cuda_median_ms(
                lambda: quantize_and_insert_k_cache(k, c2, slots.to(torch.int64), block_size=SWA_BLOCK_SIZE),
                warmup, iters)
            rec["ratio_triton"] = rec["reference_insert_ms"] / rec["vllm_triton_ms"]
        except Exception as e:  # noqa: BLE001
            rec["vllm_triton_error"] = f"{type(e).__name__}: {e}"[:300]
        try:
            # the matrix entry's own conversion (vllm_cuda.kv_rope_insert): the [nb, bs, 584] kernel
            # view of a cache copy, int64 slots, zero positions and the identity RoPE table
            from dsv4_numerics.kernels.vllm.cuda import cuda_op
            from dsv4_numerics.kernels.vllm.writer_args import kv_rope_insert_args

            a = kv_rope_insert_args({"k": k, "cache": cache, "slot_mapping": slots, "block_size": SWA_BLOCK_SIZE})
            op = cuda_op("kv_only")
            args = (a["kv"], a["k_cache"], a["slot_mapping"], a["position_ids"], a["cos_sin_cache"],
                    a["cache_block_size"], a["fp8_scale"], a["kv_mxfp8"])
            rec["vllm_cuda_ms"], _ = cuda_median_ms(lambda: op(*args), warmup, iters)
            rec["ratio_cuda"] = rec["reference_insert_ms"] / rec["vllm_cuda_ms"]
        except Exception as e:  # noqa: BLE001
            rec["vllm_cuda_error"] = f"{type(e).__name__}: {e}"[:300]
        log(json.dumps({kk: (round(v, 4) if isinstance(v, float) else v) for kk, v in rec.items()}))
        out.append(rec)
    return out


# the default call's report, graph=False's and the bucketed first calls' reports
_FAST_REPS = ("fast_vs_ordered", "fast_eager_vs_ordered", "fast_judge_eager_vs_ordered", "fast_judge_vs_ordered",
              "fast_bucketed_first_vs_ordered",
              "fast_judge_bucketed_first_vs_ordered", "fused_vs_ordered", "fused_eager_vs_ordered",
              "fused_judge_eager_vs_ordered", "fused_judge_vs_ordered", "torch_passes_vs_ordered",
              "torch_passes_eager_vs_ordered", "torch_passes_judge_eager_vs_ordered")


def summarize(att, target_ratio=10.0, target_gib=2.0, writers=None) -> dict:
    at128 = [r for r in att if r["batch"] == 128 and "ratio" in r]
    worst_mem = max((r["oracle_peak_extra_bytes"] for r in att), default=0)
    worst_fast = max((r.get("fast_peak_extra_bytes", 0) for r in att), default=0)
    s = {
        "fast_target": f"fast oracle within {target_ratio:g}x of FlashMLA at batch 128, <= {target_gib:g} GiB extra",
        "fast_ratio_at_batch_128": {r["config"]: round(r["fast_ratio"], 2) for r in at128},
        "fast_ms_at_batch_128": {r["config"]: round(r["fast_ms"], 3) for r in at128},
        "fast_graph_replayed_at_batch_128": {r["config"]: r["fast_graph_replayed"] for r in at128},
        "fast_eager_ratio_at_batch_128": {r["config"]: round(r["fast_eager_ratio"], 2) for r in at128},
        "fast_eager_ms_at_batch_128": {r["config"]: round(r["fast_eager_ms"], 3) for r in at128},
        # eager vs replayed side by side: plain eager (graph=False), the first call of a new shape
        # in a warm bucket, and the replay of a repeated shape
        "fast_ratios_at_batch_128": {r["config"]: {"eager": round(r["fast_eager_ratio"], 2),
                                                   "judge_eager": round(r["fast_judge_eager_ratio"], 2)
                                                   if "fast_judge_eager_ratio" in r else None,
                                                   "bucketed_first": round(r["fast_bucketed_first_ratio"], 2)
                                                   if "fast_bucketed_first_ratio" in r else None,
                                                   "judge_bucketed_first": round(r["fast_judge_bucketed_first_ratio"], 2)
                                                   if "fast_judge_bucketed_first_ratio" in r else None,
                                                   "replayed": round(r["fast_ratio"], 2),
                                                   "judge_replayed": round(r["fast_judge_ratio"], 2)
                                                   if "fast_judge_ratio" in r else None} for r in at128},
        # the aten operations the judge's eager call dispatches on the host (``host_ops``)
        "judge_eager_host_ops_at_batch_128": {r["config"]: sum(r["fast_judge_eager_host_ops"].values())
                                              for r in at128 if "fast_judge_eager_host_ops" in r},
        # the fused Triton kernels beside the PyTorch path (fused=False), at the same batch
        "fused_ratios_at_batch_128": {r["config"]: {
            "eager": round(r["fused_eager_ratio"], 2) if "fused_eager_ratio" in r else None,
            "judge_eager": round(r["fused_judge_eager_ratio"], 2) if "fused_judge_eager_ratio" in r else None,
            "replayed": round(r["fused_ratio"], 2) if "fused_ratio" in r else None,
            "judge_replayed": round(r["fused_judge_ratio"], 2) if "fused_judge_ratio" in r else None,
            "old_eager": round(r["fast_eager_ratio"], 2), "old_judge_eager": round(r["fast_judge_eager_ratio"], 2),
            "old_replayed": round(r["fast_ratio"], 2)} for r in at128},
        # the default call (Triton passes where Triton is importable) beside the PyTorch passes
        "passes_ratios_at_batch_128": {r["config"]: {
            "triton_passes": r.get("fast_passes"),
            "eager": round(r["fast_eager_ratio"], 2), "judge_eager": round(r["fast_judge_eager_ratio"], 2),
            "replayed": round(r["fast_ratio"], 2),
            "torch_eager": round(r["torch_passes_eager_ratio"], 2) if "torch_passes_eager_ratio" in r else None,
            "torch_judge_eager": round(r["torch_passes_judge_eager_ratio"], 2)
            if "torch_passes_judge_eager_ratio" in r else None,
            "torch_replayed": round(r["torch_passes_ratio"], 2) if "torch_passes_ratio" in r else None}
            for r in at128},
        "worst_fused_peak_extra_gib": round(max((r.get("fused_peak_extra_bytes", 0) for r in att), default=0) / GiB, 3),
        "fused_error": sorted({r["fused_error"] for r in att if "fused_error" in r}),
        "fast_bucketed_first_replayed_at_batch_128": {r["config"]: r.get("fast_bucketed_first_replayed")
                                                      for r in at128},
        "fast_eager_target_met": bool(at128) and all(r["fast_eager_ratio"] <= target_ratio for r in at128),
        "fast_judge_eager_target_met": bool(at128) and all(r.get("fast_judge_eager_ratio", math.inf) <= target_ratio
                                                           for r in at128),
        "fast_bucketed_first_target_met": bool(at128) and all(r.get("fast_bucketed_first_ratio", math.inf)
                                                              <= target_ratio for r in at128),
        "fast_judge_bucketed_first_target_met": bool(at128) and all(
            r.get("fast_judge_bucketed_first_ratio", math.inf) <= target_ratio for r in at128),
        "fast_judge_replayed_target_met": bool(at128) and all(r.get("fast_judge_ratio", math.inf) <= target_ratio
                                                              for r in at128),
        "flashmla_ms_at_batch_128": {r["config"]: round(r["flashmla_ms"], 4) for r in at128},
        "ordered_ms_at_batch_128": {r["config"]: round(r["oracle_ms"], 2) for r in at128},
        "bmm_fp64_ms_at_batch_128": {r["config"]: round(r["bmm_fp64_ms"], 3) for r in at128 if "bmm_fp64_ms" in r},
        "fast_speedup_over_ordered_at_batch_128": {r["config"]: round(r["oracle_ms"] / r["fast_ms"], 1) for r in at128},
        "worst_fast_peak_extra_gib": round(worst_fast / GiB, 3),
        "fast_memory_target_met": worst_fast <= target_gib * GiB,
        "fast_ratio_target_met": bool(at128) and all(r["fast_ratio"] <= target_ratio for r in at128),
        "fast_within_bound_everywhere": all(v["within_bound"] and v["nonfinite_equal"]
                                            for r in att for rep in _FAST_REPS
                                            for k, v in r.get(rep, {}).items() if isinstance(v, dict)),
        "fast_max_diff_over_bound": {k: [max((r[rep][k]["max_diff"] for r in att for rep in _FAST_REPS if rep in r),
                                             default=0.0),
                                         max((r[rep][k]["max_bound"] for r in att for rep in _FAST_REPS if rep in r),
                                             default=0.0)]
                                     for k in BOUND_OUTPUTS},
        "writers": {str(w["tokens"]): {k: w[k] for k in ("reference_insert_ms", "vllm_triton_ms", "ratio_triton")
                                       if k in w} for w in (writers or [])},
        "target": f"oracle within {target_ratio:g}x of FlashMLA at batch 128, <= {target_gib:g} GiB extra memory",
        "ratio_at_batch_128": {r["config"]: round(r["ratio"], 1) for r in at128},
        "worst_oracle_peak_extra_gib": round(worst_mem / GiB, 3),
        "memory_target_met": worst_mem <= target_gib * GiB,
        "ratio_target_met": bool(at128) and all(r["ratio"] <= target_ratio for r in at128),
    }
    if at128:
        best = max(at128, key=lambda r: r["oracle_gflops"])
        s["bounds"] = (
            f"the oracle reaches {best['oracle_gflops']:.1f} GFLOP/s of float64 "
            f"({best['oracle_gflops'] / (H200_FP64_PEAK_TFLOPS * 1e3) * 100:.2f}% of the {H200_FP64_PEAK_TFLOPS:g} "
            f"TFLOP/s FP64 peak) and streams ~{best['oracle_stream_gbps']:.0f} GB/s through its fixed-order "
            "accumulators: it is bound by the sequential, elementwise float64 reduction order "
            "(D + K dependent steps per chunk, each a full pass over a float64 accumulator) that "
            "makes its bits device-independent, not by FLOPs; unordered float64 bmm "
            f"(bmm_fp64_ms) shows the cost of that order ({best.get('determinism_cost', float('nan')):.1f}x).")
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_numerics.bench.gpu", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON report path")
    ap.add_argument("--quick", action="store_true", help="two configs x batches 2 and 128, fewer iterations")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--oracle-budget-gib", type=float, default=2.0)
    ap.add_argument("--no-writers", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU visible; nothing to time", file=sys.stderr)
        return 2
    from dsv4_numerics.kernels.staged import activate

    activate()  # DSV4_STAGED folders, before any kernel (FlashMLA, the Triton writer) is looked up
    device = torch.device("cuda:0")

    def log(line: str) -> None:
        print(line, flush=True)

    configs = CONFIGS[:2] if args.quick else CONFIGS
    batches = [2, 128] if args.quick else BATCHES
    iters = min(args.iters, 10) if args.quick else args.iters
    t0 = time.time()
    from dsv4_numerics.kernels.flashmla.sparse import ENTRIES as FM

    fm_reason = FM[0].available()[1]
    report = {
        "schema": "dsv4-numerics/bench/1",
        "device": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "flashmla_available": fm_reason == "", "flashmla_reason": fm_reason,
        "timing": {"method": "CUDA events, median", "warmup": args.warmup, "iters": iters},
        "oracle_budget_gib": args.oracle_budget_gib,
        "host_launch_us": round(host_launch_us(device), 2),
    }
    report["attention"] = bench_attention(configs, batches, args.warmup, iters, args.oracle_budget_gib, device, log)
    if not args.no_writers:
        report["writers"] = bench_writers([4096, 32768], args.warmup, iters, device, log)
    report["summary"] = summarize(report["attention"], target_gib=args.oracle_budget_gib,
                                  writers=report.get("writers"))
    report["summary"]["host_launch_us"] = report["host_launch_us"]
    report["wall_s"] = round(time.time() - t0, 1)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=lambda o: str(o)) + "\n")
    log(json.dumps(report["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
