"""Where a test run's wall time went, from the per-process timelines the repository's conftest
writes under ``DSV4_TIMELINE=DIR`` (one ``<worker>.tsv`` per xdist worker: start, end, phase,
node id). ``python -m dsv4_numerics.timeline DIR`` prints, per worker and in total: start-up
(process start to collection), collection, test time, idle time (from the worker's first test to
the run's last test end, minus its test time) and the tail (the last worker's finish minus the
median worker's), and the longest tests: the breakdown of .ci/gpu-scaling's runs.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path


def load(folder: str | Path) -> dict[str, list[tuple[float, float, str, str]]]:
    """``{worker: [(start, end, phase, nodeid), ...]}`` of every ``*.tsv`` in ``folder``."""
    out: dict[str, list[tuple[float, float, str, str]]] = {}
    for f in sorted(Path(folder).glob("*.tsv")):
        rows = []
        for line in f.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == 4:
                rows.append((float(parts[0]), float(parts[1]), parts[2], parts[3]))
        out[f.stem] = rows
    return out


def breakdown(folder: str | Path, top: int = 10) -> str:
    """The report described in the module docstring, as text."""
    loaded = load(folder)
    data = {w: rows for w, rows in loaded.items() if w != "main" or len(loaded) == 1}
    if not data:
        return f"timeline: no *.tsv under {folder}"
    t_first = min(r[0] for rows in data.values() for r in rows)
    t_last = max(r[1] for rows in data.values() for r in rows)
    lines = [f"timeline of {len(data)} process(es): wall {t_last - t_first:.1f} s (first process start to last test end)"]
    lines.append(f"{'worker':>8} {'startup':>8} {'collect':>8} {'tests':>8} {'busy':>8} {'idle':>8} {'done at':>8}")
    ends, tot = [], {"startup": 0.0, "collect": 0.0, "tests": 0.0, "idle": 0.0}
    tests_all = []
    for w, rows in sorted(data.items(), key=lambda kv: (len(kv[0]), kv[0])):
        start = min((r[0] for r in rows if r[2] == "sessionstart"), default=t_first)
        coll = [r for r in rows if r[2] == "collection"]
        tests = [r for r in rows if r[2] == "test"]
        tests_all += [(r[1] - r[0], r[3]) for r in tests]
        c0, c1 = (coll[0][0], coll[0][1]) if coll else (start, start)
        busy = sum(r[1] - r[0] for r in tests)
        first = min((r[0] for r in tests), default=c1)
        end = max((r[1] for r in tests), default=c1)
        idle = (t_last - first) - busy
        ends.append(end - t_first)
        for k, v in (("startup", c0 - t_first), ("collect", c1 - c0), ("tests", busy), ("idle", idle)):
            tot[k] += v
        lines.append(f"{w:>8} {c0 - t_first:8.1f} {c1 - c0:8.1f} {len(tests):8d} {busy:8.1f} {idle:8.1f} {end - t_first:8.1f}")
    n = len(data)
    lines.append(f"{'mean':>8} {tot['startup'] / n:8.1f} {tot['collect'] / n:8.1f} {'':>8} {tot['tests'] / n:8.1f} "
                 f"{tot['idle'] / n:8.1f} {statistics.median(ends):8.1f} (median)")
    lines.append(f"tail: the last worker finished {max(ends) - statistics.median(ends):.1f} s after the median one")
    lines.append(f"longest {top} tests:")
    for d, nodeid in sorted(tests_all, reverse=True)[:top]:
        lines.append(f"  {d:7.1f} s  {nodeid}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m dsv4_numerics.timeline DIR", file=sys.stderr)
        return 2
    print(breakdown(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
