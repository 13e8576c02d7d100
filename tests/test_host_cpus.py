"""dsv4_numerics.runner.host_cpus: shares of the host are divided from the CPUs this process may run on
(its affinity set), not from every core of the host."""

from __future__ import annotations

import os
import sys

import pytest

from dsv4_numerics.runner import host_cpus
from dsv4_numerics.runner.pool import default_jobs


def test_usable_cpus_is_the_affinity_set_or_the_cpu_count(monkeypatch):
    monkeypatch.setattr(host_cpus.os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    monkeypatch.setattr(host_cpus.os, "cpu_count", lambda: 64)
    assert host_cpus.usable_cpus() == 3
    monkeypatch.delattr(host_cpus.os, "sched_getaffinity", raising=False)
    assert host_cpus.usable_cpus() == 64
    monkeypatch.setattr(host_cpus.os, "cpu_count", lambda: None)
    assert host_cpus.usable_cpus() == 1


def test_default_child_count_follows_the_usable_cpus(monkeypatch):
    monkeypatch.setattr(host_cpus.os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    monkeypatch.setattr(host_cpus.os, "cpu_count", lambda: 64)
    assert default_jobs(num_gpus=2, num_entries=40) == 2  # one per two usable CPUs, not 32


def test_xdist_workers_share_the_usable_cpus_not_the_host(monkeypatch):
    """The root conftest divides usable_cpus() between the xdist workers (a 4-CPU affinity set on a
    64-core host, 2 workers: 2 threads each, not 32)."""
    import torch

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    mod = next(m for m in list(sys.modules.values())
               if os.path.abspath(getattr(m, "__file__", None) or "") == os.path.join(root, "conftest.py"))
    monkeypatch.setattr(mod, "usable_cpus", lambda: 4)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    old = torch.get_num_threads()
    try:
        mod._share_cpu_threads_between_xdist_workers()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)
