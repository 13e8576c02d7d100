"""A judge for the isolated kernel children (``worker_child --judge``): runs ``run_entry`` under
the fast oracle (the GPU default) and under the ordered one, and returns the fast Results with
the ordered verdict and rule in ``details["ordered"]`` (``test_oracle_modes_gpu.py``). The kernel
is called once per case: the ordered pass judges the outputs the fast pass got (a kernel is
deterministic per call in what is judged; calling it twice would only double its cost)."""

from __future__ import annotations


class _Replay:
    """The entry, with ``call`` answering each case from the first pass's outputs."""

    def __init__(self, entry):
        self._entry, self._outputs = entry, {}

    def __getattr__(self, name):
        return getattr(self._entry, name)

    def record(self, case):
        out = self._entry.call(case)
        self._outputs[case.name] = out
        return out

    def replay(self, case):
        if case.name in self._outputs:
            return self._outputs[case.name]
        return self._entry.call(case)


class _Calling:
    def __init__(self, replay: _Replay, call):
        self._r, self.call = replay, call

    def __getattr__(self, name):
        return getattr(self._r, name)


def both(entry, cases=None, device=None):
    from dsv4_numerics.oracles.matrix import run_entry

    cases = list(cases) if cases is not None else None
    r = _Replay(entry)
    fast = run_entry(_Calling(r, r.record), cases=cases, device=device, oracle_mode="fast")
    ordered = run_entry(_Calling(r, r.replay), cases=cases, device=device, oracle_mode="ordered")
    for f, o in zip(fast, ordered):
        f.details = dict(f.details or {})
        f.details["ordered"] = {"verdict": o.verdict, "rule": o.rule, "case": o.case,
                                "oracle": (o.details or {}).get("oracle")}
    return fast
