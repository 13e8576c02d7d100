"""A judge for the isolated kernel children (``worker_child --judge``): runs ``run_entry`` under
the fast oracle (the GPU default) and under the ordered one, and returns the fast Results with
the ordered verdict and rule in ``details["ordered"]`` (``test_oracle_modes_gpu.py``)."""

from __future__ import annotations


def both(entry, cases=None, device=None):
    from dsv4_numerics.oracles.matrix import run_entry

    fast = run_entry(entry, cases=cases, device=device, oracle_mode="fast")
    ordered = run_entry(entry, cases=cases, device=device, oracle_mode="ordered")
    for f, o in zip(fast, ordered):
        f.details = dict(f.details or {})
        f.details["ordered"] = {"verdict": o.verdict, "rule": o.rule, "case": o.case,
                                "oracle": (o.details or {}).get("oracle")}
    return fast
