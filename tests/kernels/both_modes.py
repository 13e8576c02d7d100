"""A judge for the isolated kernel children (``worker_child --judge``): runs ``run_entry`` under
the fast oracle (the GPU default) and under the ordered one, and returns the fast Results with
the ordered verdict and rule in ``details["ordered"]`` (``test_oracle_modes_gpu.py``). The kernel
is called once per case: the ordered pass judges the outputs the fast pass got (a kernel is
deterministic per call in what is judged; calling it twice would only double its cost)."""

from __future__ import annotations


class _CallOnce:
    """The entry, with ``call`` memoised by case name: the second pass judges the first pass's
    outputs (a call that raised is not remembered, so it raises again)."""

    def __init__(self, entry):
        self._entry, self._outputs = entry, {}

    def __getattr__(self, name):
        return getattr(self._entry, name)

    def call(self, case):
        if case.name not in self._outputs:
            self._outputs[case.name] = self._entry.call(case)
        return self._outputs[case.name]


def both(entry, cases=None, device=None):
    from dsv4_numerics.oracles.matrix import run_entry

    cases = list(cases) if cases is not None else None
    once = _CallOnce(entry)
    fast = run_entry(once, cases=cases, device=device, oracle_mode="fast")
    ordered = run_entry(once, cases=cases, device=device, oracle_mode="ordered")
    for f, o in zip(fast, ordered):
        f.details = dict(f.details or {})
        f.details["ordered"] = {"verdict": o.verdict, "rule": o.rule, "case": o.case,
                                "oracle": (o.details or {}).get("oracle")}
    return fast
