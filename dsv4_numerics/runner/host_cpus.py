"""The CPUs this process may run on: what every share of the host (xdist workers' intra-op
threads, kernel children's ``OMP_NUM_THREADS``, the default child count) is divided from.

``usable_cpus()`` is the size of the process's CPU affinity set (``os.sched_getaffinity``), not
``os.cpu_count()``: a CI runner confined to a cpuset (a container, ``taskset``, one GPU's share of
a multi-GPU host) sees every core of the host in ``os.cpu_count()``, and dividing that between its
workers gave each of them threads for cores it cannot use (16 workers on a 16-core share of a
32-core host got 2 intra-op threads each). Where the platform has no affinity call (macOS,
Windows): ``os.cpu_count()``; at least 1.
"""
from __future__ import annotations

import os

__all__ = ["usable_cpus"]


def usable_cpus() -> int:
    """The number of CPUs this process may run on (module docstring); at least 1."""
    affinity = getattr(os, "sched_getaffinity", None)
    if affinity is not None:
        try:
            return max(1, len(affinity(0)))
        except OSError:  # pragma: no cover - a platform that lists the call but refuses it
            pass
    return max(1, os.cpu_count() or 1)
