"""How much CPU work a set of cores does per second when every core is busy: the ceiling of a
CPU-bound test suite's speed-up when it is given more cores.

A GPU suite that is bound by its CPU side (case building, the reference on the CPU, process
start-ups) can go at most as much faster on two GPUs' share of a host as that share's cores do
more work than one GPU's share. On virtual machines they need not do twice as much: a core runs
slower when its neighbours are busy (shared caches, memory bandwidth, frequency, host threads
behind the virtual cores), so ``.ci/gpu-scaling`` measures these ceilings next to each run's wall
time.

``measure(procs, units, kind)``: ``procs`` forked processes (inheriting this process's CPU
affinity, as the suite's workers do), released together, each doing ``units`` units of work,
returns ``{"kind", "procs", "units", "wall_s", "units_per_s"}`` (``units_per_s = procs * units /
wall``; ``wall``: the release to the last process's end) and, for ``kind="memory"``, ``gb_per_s``.
The kinds:

* ``"mix"``: Python bytecode (loops, dict and string work), small PyTorch CPU operations
  (dispatch-bound, as most of the suite's are) and one 16 MiB reduction, ~25 ms a unit;
* ``"memory"``: float64 passes over a 256 MiB tensor per process (``add_``: 512 MiB read and
  written a pass, 4 passes a unit, ~0.2 s on one core), what the CPU reference's fixed-order float64 loops do -- they
  stream their accumulators through memory -- so it is bound by the memory bandwidth of the set;
* ``"compute"``: the mix's bytecode loop alone (~10 ms a unit; its data fit in a core's first-level
  cache), bound by the cores' clock alone: where it scales and the mix does not, shared caches or
  memory are what the cores wait for; where it does not scale either, their clock is (a lower
  all-core frequency, or virtual cores that are siblings of one physical core).

With a long ``units`` (``--units``) the same processes are a *load*: ``.ci/gpu-scaling``'s
``NEIGHBOURS`` runs one kind on the cores a run does not use, to see which shared resource the
run's tests wait for.

Ratios between two sets' numbers are what to compare; the absolute values depend on the mix.

Command line: ``python -m dsv4_numerics.bench.cpu_ceiling [--procs N] [--units U] [--kind mix|memory|compute|both]``
prints the JSON record(s) (``--procs`` defaults to the usable CPUs, ``host_cpus.usable_cpus``;
``both``, the default: ``{"mix": ..., "memory": ...}``).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import threading
import time

from dsv4_numerics.runner.host_cpus import usable_cpus

__all__ = ["measure", "work_unit", "memory_unit", "compute_unit", "KINDS"]

KINDS = ("mix", "memory", "compute")
MEM_ELEMS = 1 << 25  # float64: 256 MiB per process (beyond a 2026 server L3 share)
MEM_PASSES = 4


def compute_unit() -> int:
    """One unit of the core-bound kind: a bytecode loop over small integers (no data beyond a
    core's first-level cache); returns a checksum so that nothing is optimised away."""
    acc = 0
    for i in range(200_000):
        acc = (acc + i * i) % 1_000_003
    return acc


def work_unit() -> int:
    """One unit of the mix (about 25 ms on one core of a 2026 x86 server): returns a checksum
    so that nothing is optimised away."""
    import torch

    acc = compute_unit()  # bytecode
    d = {f"k{i}": i for i in range(10_000)}  # dicts and strings
    acc += sum(len(k) for k in d) + len("-".join(sorted(d))[:10])
    x = torch.ones(64, 64)
    for _ in range(750):  # dispatch-bound small operations
        x = (x + 1.0).mul_(0.5)
    big = torch.ones(1 << 22)  # 16 MiB: memory-bound
    acc += int(big.sum().item()) + int(x[0, 0].item())
    return acc


def memory_unit(x) -> int:
    """One unit of the memory-bound kind: ``MEM_PASSES`` in-place float64 passes over ``x``
    (``MEM_ELEMS`` elements); returns the bytes moved (each pass reads and writes ``x``)."""
    for _ in range(MEM_PASSES):
        x.add_(1.0)
    return 2 * MEM_PASSES * x.numel() * x.element_size()


def _os_threads() -> int:
    """The process's threads as the OS counts them (native ones included: CUDA's, OpenMP's), where
    ``/proc`` tells; else Python's own count."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _child(barrier, units: int, kind: str, q) -> None:
    import torch

    torch.set_num_threads(1)
    if kind == "memory":
        x = torch.zeros(MEM_ELEMS, dtype=torch.float64)

        def unit():
            return memory_unit(x)
    else:
        unit = compute_unit if kind == "compute" else work_unit
    unit()  # warm: imports, allocator, the pages of x
    barrier.wait()
    for _ in range(units):
        unit()
    q.put(time.perf_counter())


def measure(procs: int | None = None, units: int | None = None, kind: str = "mix") -> dict:
    """The CPU set's throughput with ``procs`` busy processes doing ``kind`` work (module docstring)."""
    procs = usable_cpus() if procs is None else procs
    units = {"memory": 8, "compute": 50}.get(kind, 40) if units is None else units
    if not isinstance(procs, int) or isinstance(procs, bool) or procs < 1:
        raise ValueError(f"measure: procs must be a positive int, got {procs!r}")
    if not isinstance(units, int) or isinstance(units, bool) or units < 1:
        raise ValueError(f"measure: units must be a positive int, got {units!r}")
    if kind not in KINDS:
        raise ValueError(f"measure: kind must be one of {KINDS}, got {kind!r}")
    import torch  # noqa: F401 - imported before the fork: the children share it

    # fork from a single-threaded process (the command line: the children share its imports); from a
    # threaded one (a test worker, a CUDA program: native threads count too) a fork may copy a lock
    # another thread holds, which Python 3.12 warns about: a fork server then starts the children
    ctx = multiprocessing.get_context("fork" if _os_threads() == 1 else "forkserver")
    if ctx.get_start_method() == "forkserver":  # the server imports torch once; its children fork with it
        ctx.set_forkserver_preload(["torch", __name__])
    barrier, q = ctx.Barrier(procs + 1), ctx.Queue()
    kids = [ctx.Process(target=_child, args=(barrier, units, kind, q)) for _ in range(procs)]
    for k in kids:
        k.start()
    try:
        barrier.wait(timeout=300)  # a child that died starting (e.g. a fork server that cannot re-import
        t0 = time.perf_counter()   # an interactive __main__) must not hang the measurement
        ends = [q.get(timeout=600) for _ in kids]
    except Exception as e:  # noqa: BLE001 - BrokenBarrierError, queue.Empty
        for k in kids:
            k.kill()
        raise RuntimeError(f"measure: the {procs} worker processes did not all start and finish "
                           f"({type(e).__name__}); exit codes {[k.exitcode for k in kids]}") from e
    for k in kids:
        k.join()
    wall = max(ends) - t0
    rec = {"kind": kind, "procs": procs, "units": units, "wall_s": round(wall, 3),
           "units_per_s": round(procs * units / wall, 2)}
    if kind == "memory":
        rec["gb_per_s"] = round(procs * units * 2 * MEM_PASSES * MEM_ELEMS * 8 / wall / 1e9, 2)
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_numerics.bench.cpu_ceiling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=None, help="busy processes (default: the usable CPUs)")
    ap.add_argument("--units", type=int, default=None, help="units of work per process (default: 40 of the mix, 8 of memory, 50 of compute)")
    ap.add_argument("--kind", choices=(*KINDS, "both"), default="both",
                    help="the work (default: both = the mix and memory)")
    a = ap.parse_args(argv)
    if a.procs is not None and a.procs < 1:
        ap.error(f"--procs must be at least 1, got {a.procs}")
    if a.units is not None and a.units < 1:
        ap.error(f"--units must be at least 1, got {a.units}")
    if a.kind == "both":
        print(json.dumps({k: measure(a.procs, a.units, k) for k in ("mix", "memory")}))
    else:
        print(json.dumps(measure(a.procs, a.units, a.kind)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
