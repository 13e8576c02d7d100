"""How much CPU work a set of cores does per second when every core is busy: the ceiling of a
CPU-bound test suite's speed-up when it is given more cores.

A GPU suite that is bound by its CPU side (case building, the reference on the CPU, process
start-ups) can go at most as much faster on two GPUs' share of a host as that share's cores do
more work than one GPU's share. On the hosts lent here they do not do twice as much: a core runs
slower when its neighbours are busy (shared caches, memory bandwidth, frequency, host threads
behind the virtual cores), so ``.ci/gpu-scaling`` measures this ceiling next to each run's wall
time.

``measure(procs, units)``: ``procs`` forked processes (inheriting this process's CPU affinity, as
the suite's workers do), released together, each doing ``units`` units of a fixed mix -- Python
bytecode (loops, dict and string work), small PyTorch CPU operations (dispatch-bound, as the
suite's are) and one memory-bound reduction -- returns ``{"procs", "units", "wall_s",
"units_per_s"}``: the set's throughput, ``procs * units / wall`` (``wall``: the release to the
last process's end). Ratios between two sets' ``units_per_s`` are the numbers to compare; the
absolute value depends on the mix.

Command line: ``python -m dsv4_numerics.cpu_ceiling [--procs N] [--units U]`` prints the JSON
record (``--procs`` defaults to the usable CPUs, ``host_cpus.usable_cpus``).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

from .host_cpus import usable_cpus

__all__ = ["measure", "work_unit"]


def work_unit() -> int:
    """One unit of the mix (about 25 ms on one core of a 2026 x86 server): returns a checksum
    so that nothing is optimised away."""
    import torch

    acc = 0
    for i in range(200_000):  # bytecode
        acc = (acc + i * i) % 1_000_003
    d = {f"k{i}": i for i in range(10_000)}  # dicts and strings
    acc += sum(len(k) for k in d) + len("-".join(sorted(d))[:10])
    x = torch.ones(64, 64)
    for _ in range(750):  # dispatch-bound small operations
        x = (x + 1.0).mul_(0.5)
    big = torch.ones(1 << 22)  # 16 MiB: memory-bound
    acc += int(big.sum().item()) + int(x[0, 0].item())
    return acc


def _child(barrier, units: int, q) -> None:
    import torch

    torch.set_num_threads(1)
    work_unit()  # warm: imports, allocator
    barrier.wait()
    for _ in range(units):
        work_unit()
    q.put(time.perf_counter())


def measure(procs: int | None = None, units: int = 40) -> dict:
    """The CPU set's throughput with ``procs`` busy processes (module docstring)."""
    procs = usable_cpus() if procs is None else procs
    if not isinstance(procs, int) or isinstance(procs, bool) or procs < 1:
        raise ValueError(f"measure: procs must be a positive int, got {procs!r}")
    if not isinstance(units, int) or isinstance(units, bool) or units < 1:
        raise ValueError(f"measure: units must be a positive int, got {units!r}")
    import torch  # noqa: F401 - imported before the fork: the children share it

    ctx = multiprocessing.get_context("fork")
    barrier, q = ctx.Barrier(procs + 1), ctx.Queue()
    kids = [ctx.Process(target=_child, args=(barrier, units, q)) for _ in range(procs)]
    for k in kids:
        k.start()
    barrier.wait()
    t0 = time.perf_counter()
    ends = [q.get(timeout=600) for _ in kids]
    for k in kids:
        k.join()
    wall = max(ends) - t0
    return {"procs": procs, "units": units, "wall_s": round(wall, 3), "units_per_s": round(procs * units / wall, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_numerics.cpu_ceiling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=None, help="busy processes (default: the usable CPUs)")
    ap.add_argument("--units", type=int, default=40, help="units of work per process (default 40)")
    a = ap.parse_args(argv)
    if a.procs is not None and a.procs < 1:
        ap.error(f"--procs must be at least 1, got {a.procs}")
    if a.units < 1:
        ap.error(f"--units must be at least 1, got {a.units}")
    print(json.dumps(measure(a.procs, a.units)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
