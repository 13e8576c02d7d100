"""Speed and memory of the float64 sparse-attention oracle (a benchmark, not a test).

``python -m dsv4_numerics.bench.oracle [--tokens 32 64] [--heads 64 128]
[--topk 128 512] [--device cpu|cuda] [--chunk N] [--repeats 3] [--mode exact|bf16_p]``

Times ``reference.attention.ordered.sparse_attention`` at production decode shapes: ``T`` query tokens,
``H`` heads, one SWA segment of ``topk[0]`` slots (128) plus one compressed segment of
``topk[1]`` slots (512 Flash / 1024 Pro), exact bf16 rows, a sink with +-inf heads. Reports the
median seconds over ``repeats`` runs (after one warm-up), tokens/s and peak memory:

- CPU: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` delta across the run (the process high-water
  mark, so only growth beyond earlier peaks is visible; run one shape per process for a clean
  number) next to ``attention.peak_bytes_estimate`` of the chosen chunk;
- CUDA: ``torch.cuda.max_memory_allocated`` delta, timed with CUDA events.
"""

from __future__ import annotations

import argparse
import math
import resource
import statistics
import sys
import time

import torch

from dsv4_numerics.reference.attention.ordered import Segment, auto_chunk_tokens, peak_bytes_estimate, sparse_attention
from dsv4_numerics.reference.constants import HEAD_DIM


def _problem(T: int, H: int, k_swa: int, k_comp: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n_swa, n_comp = max(4 * k_swa, 256), max(2 * k_comp, 256)
    q = torch.randn(T, H, HEAD_DIM, generator=g).clamp(-1, 1).to(torch.bfloat16)
    swa = (torch.randn(n_swa, HEAD_DIM, generator=g) * 0.1).clamp(-1, 1).to(torch.bfloat16)
    comp = (torch.randn(n_comp, HEAD_DIM, generator=g) * 0.1).clamp(-1, 1).to(torch.bfloat16)
    i_swa = torch.stack([torch.randperm(n_swa, generator=g)[:k_swa] for _ in range(T)]).to(torch.int32)
    i_comp = torch.stack([torch.randperm(n_comp, generator=g)[:k_comp] for _ in range(T)]).to(torch.int32)
    sink = torch.randn(H, generator=g)
    sink[1 % H], sink[2 % H] = math.inf, -math.inf
    d = torch.device(device)
    segs = [Segment(swa.to(d), i_swa.to(d)), Segment(comp.to(d), i_comp.to(d))]
    return q.to(d), segs, sink.to(d)


def bench_oracle(T: int, H: int, k_swa: int = 128, k_comp: int = 512, device: str = "cpu",
                 chunk: int | None = None, repeats: int = 3, mode: str = "exact") -> dict:
    """Median seconds, tokens/s and peak-memory figures of one shape (module docstring)."""
    q, segs, sink = _problem(T, H, k_swa, k_comp, device)
    K = k_swa + k_comp
    c = chunk if chunk is not None else auto_chunk_tokens(H, K, device=device)
    run = lambda: sparse_attention(q, segs, HEAD_DIM**-0.5, sink, mode=mode, chunk_tokens=c)  # noqa: E731
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    run()  # warm-up
    times = []
    for _ in range(repeats):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            run()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    out = {"device": device, "T": T, "H": H, "K": K, "chunk_tokens": c, "mode": mode,
           "seconds": med, "tokens_per_s": T / med,
           "peak_estimate_MiB": peak_bytes_estimate(c, H, K) / 2**20,
           "threads": torch.get_num_threads()}
    if cuda:
        out["peak_alloc_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        out["maxrss_growth_MiB"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0) / 2**20
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_numerics.bench.oracle", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--heads", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--topk", type=int, nargs=2, default=[128, 512], metavar=("SWA", "COMPRESSED"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mode", default="exact", choices=["exact", "bf16_p"])
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_oracle: --device cuda requested but no CUDA device is visible", file=sys.stderr)
        return 2
    for T in a.tokens:
        for H in a.heads:
            r = bench_oracle(T, H, a.topk[0], a.topk[1], a.device, a.chunk, a.repeats, a.mode)
            mem = (f"peak alloc {r['peak_alloc_MiB']:.0f} MiB" if "peak_alloc_MiB" in r
                   else f"maxrss growth {r['maxrss_growth_MiB']:.0f} MiB")
            print(f"{r['device']:>5} {r['mode']:>6} T={T:4d} H={H:4d} K={r['K']:5d} chunk={r['chunk_tokens']:3d} "
                  f"{r['seconds']:8.3f} s  {r['tokens_per_s']:9.1f} tok/s  estimate {r['peak_estimate_MiB']:.0f} MiB  "
                  f"{mem}  threads={r['threads']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
