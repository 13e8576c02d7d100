"""CPU throughput of the reference pack path (a benchmark, not a test).

``python -m dsv4_numerics.bench.cpu [--sizes 1024 16384] [--repeats 5] [--threads 1]``
(also ``dsv4-numerics bench cpu ...``) times, on one CPU thread by default:

- ``encode``: ``reference.caches.model1.encode_records`` (tile quantiser + record assembly),
- ``pack``:   ``reference.caches.model1.insert`` (encode + validation + copy of the cache + scatter
  of the 584 bytes of every token into a 64-entry, 37 440-byte-stride production cache),

for bf16 rows of realistic content (RMSNorm(N(0,1)) * U[0.5, 1]) written to permuted slots, and
reports the median over ``repeats`` runs in tokens/s. ``bench_pack`` returns the numbers as a dict.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dsv4_numerics.reference.caches.model1 import empty_cache, encode_records, insert
from dsv4_numerics.reference.constants import HEAD_DIM, SWA_BLOCK_SIZE
from dsv4_numerics.reference.policies import ScaleRule


def _rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HEAD_DIM, generator=g)
    gain = torch.rand(HEAD_DIM, generator=g) * 0.5 + 0.5
    return (x * torch.rsqrt((x * x).mean(dim=1, keepdim=True) + 1e-6) * gain).to(torch.bfloat16)


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (allocator, first-call overheads)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_pack(sizes=(1024, 16384), repeats: int = 5, threads: int = 1,
               rule: ScaleRule = ScaleRule.AMAX_CLAMP, seed: int = 0) -> dict:
    """Median tokens/s of ``encode_records`` and ``insert`` per size N.

    Returns ``{"threads": t, "repeats": r, "rule": str, "block_size": 64, "results":
    [{"n": N, "encode_s": s, "encode_tok_s": x, "pack_s": s, "pack_tok_s": x}, ...]}``.
    """
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        results = []
        for n in sizes:
            k = _rows(n, seed)
            nb = -(-n // SWA_BLOCK_SIZE)
            cache = empty_cache(nb, SWA_BLOCK_SIZE)
            slots = torch.randperm(nb * SWA_BLOCK_SIZE, generator=torch.Generator().manual_seed(seed))[:n]
            t_enc = _median_seconds(lambda: encode_records(k, rule), repeats)
            t_pack = _median_seconds(lambda: insert(cache, k, slots, SWA_BLOCK_SIZE, rule), repeats)
            results.append({"n": n, "encode_s": t_enc, "encode_tok_s": n / t_enc,
                            "pack_s": t_pack, "pack_tok_s": n / t_pack})
        return {"threads": threads, "repeats": repeats, "rule": str(rule), "block_size": SWA_BLOCK_SIZE,
                "torch": torch.__version__, "results": results}
    finally:
        torch.set_num_threads(prev)


def format_table(res: dict) -> str:
    lines = [f"reference pack path, CPU, {res['threads']} thread(s), median of {res['repeats']} "
             f"(rule {res['rule']}, bs {res['block_size']}, torch {res['torch']})",
             f"{'N':>7}  {'encode ms':>10}  {'encode tok/s':>13}  {'pack ms':>10}  {'pack tok/s':>11}"]
    for r in res["results"]:
        lines.append(f"{r['n']:>7}  {r['encode_s'] * 1e3:>10.2f}  {r['encode_tok_s']:>13,.0f}  "
                     f"{r['pack_s'] * 1e3:>10.2f}  {r['pack_tok_s']:>11,.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dsv4-numerics bench cpu", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    print(format_table(bench_pack(tuple(args.sizes), args.repeats, args.threads)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
