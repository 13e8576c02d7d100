"""Where a test run's wall time went, from the per-process timelines the repository's conftest
writes under ``DSV4_TIMELINE=DIR`` (one ``<worker>.tsv`` per xdist worker: start, end, phase,
node id, then -- newer timelines -- the process's CPU seconds (user + system) and its waited-for
children's at the phase's start and end). ``python -m dsv4_numerics.runner.timeline DIR`` prints, per
worker and in total: start-up (process start to collection), collection, test time, idle time
(from the worker's first test to the run's last test end, minus its test time) and the tail (the
last worker's finish minus the median worker's), and the longest tests; with CPU columns also
each worker's CPU seconds before its first test (start-up, imports, collection), in its tests and
in its tests' waited-for children (subprocess and CLI tests), and the tests that cost the most CPU:
the breakdown of .ci/gpu-scaling's runs. CPU of processes nobody in the run waits for (the
kernel broker's children, a worker's own kernel child) is in none of these: the kernel children
write their own rows under ``DIR/children/`` (``dsv4_numerics.runner.child``), summarised
apart (:func:`children_lines`: warm-up, jobs, cases, the first use of each entry in each child,
idle time). With
``--report REPORT.json``: the judged cases' kernel-call, reference and comparison seconds per
family and stage (:func:`judged_time`).

``python -m dsv4_numerics.runner.timeline --durations JUNIT.xml [...]`` prints the scheduling units'
measured seconds as JSON (:func:`unit_durations`): the repository's ``tests/durations.json``,
which the root conftest's ``longest_first`` reads to hand the longest units out first.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path


ENV = "DSV4_TIMELINE"  # the folder the rows go to (the root conftest's, the kernel children's)


def row_line(start: float, end: float, phase: str, what: str, cpu0: float, cpu1: float,
             kids0: float = 0.0, kids1: float = 0.0) -> str:
    """One row as :func:`load` reads it: wall start and end (seconds since the epoch), phase, what
    (a node id, an entry, ``-``), the process's CPU seconds (user + system) at the start and end,
    and its waited-for children's at the start and end; tab-separated, newline-terminated."""
    return f"{start:.3f}\t{end:.3f}\t{phase}\t{what}\t{cpu0:.3f}\t{cpu1:.3f}\t{kids0:.3f}\t{kids1:.3f}\n"


def load(folder: str | Path) -> dict[str, list[tuple]]:
    """``{worker: [(start, end, phase, nodeid, cpu0, cpu1, kids0, kids1), ...]}`` of every
    ``*.tsv`` in ``folder``; the CPU seconds are None in a timeline written without them."""
    out: dict[str, list[tuple]] = {}
    for f in sorted(Path(folder).glob("*.tsv")):
        rows = []
        for line in f.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == 4:
                rows.append((float(parts[0]), float(parts[1]), parts[2], parts[3], None, None, None, None))
            elif len(parts) == 8:
                rows.append((float(parts[0]), float(parts[1]), parts[2], parts[3], *map(float, parts[4:])))
        out[f.stem] = rows
    return out


def cpu_lines(data: dict, top: int = 10) -> list[str]:
    """The CPU part of :func:`breakdown` (workers whose rows carry CPU seconds): per worker the CPU
    seconds before its first test, in its tests and in their waited-for children, in total, and
    the tests that cost the most CPU (their own plus their children's). Empty without CPU columns."""
    per, tests = [], []
    for w, rows in data.items():
        rows = [r for r in rows if r[4] is not None]
        t = [r for r in rows if r[2] == "test"]
        if not t:
            continue
        before = min(r[4] for r in t)
        own = sum(r[5] - r[4] for r in t)
        kids = sum(r[7] - r[6] for r in t)
        total = max(r[5] for r in rows) + max(r[7] for r in rows)
        per.append((before, own, kids, total))
        tests += [((r[5] - r[4]) + (r[7] - r[6]), r[5] - r[4], r[7] - r[6], r[1] - r[0], r[3]) for r in t]
    if not per:
        return []
    n = len(per)
    s = [sum(p[i] for p in per) for i in range(4)]
    out = [f"CPU seconds (user + system) of {n} worker(s): before the first test (start-up, imports, collection) "
           f"mean {s[0] / n:.1f}, max {max(p[0] for p in per):.1f}; in tests mean {s[1] / n:.1f}; in the tests' "
           f"waited-for children mean {s[2] / n:.1f}; whole processes summed {s[3]:.0f}",
           f"most CPU {top} tests (own + children, wall):"]
    for c, own, kids, wall, nodeid in sorted(tests, reverse=True)[:top]:
        out.append(f"  {c:7.1f} s = {own:.1f} + {kids:.1f}  ({wall:.1f} s wall)  {nodeid}")
    return out


_END_PHASES = ("sessionfinish", "unconfigure", "nodedown", "mainend", "exit", "imports", "hook")  # ends_of_run's rows


def breakdown(folder: str | Path, top: int = 10) -> str:
    """The report described in the module docstring, as text."""
    loaded = load(folder)
    data = {w: rows for w, rows in loaded.items() if w != "main" or len(loaded) == 1}
    if not data:
        return f"timeline: no *.tsv under {folder}"
    t_first = min(r[0] for rows in data.values() for r in rows if r[2] not in _END_PHASES)
    t_last = max(r[1] for rows in data.values() for r in rows if r[2] not in _END_PHASES)
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
    lines += ends_of_run(loaded, t_first, t_last)
    lines += cpu_lines(data, top)
    lines += children_lines(folder, top=5)
    lines.append(f"longest {top} tests:")
    for d, nodeid in sorted(tests_all, reverse=True)[:top]:
        lines.append(f"  {d:7.1f} s  {nodeid}")
    return "\n".join(lines)


def children_lines(folder: str | Path, top: int = 5) -> list[str]:
    """What the kernel children did, from their rows under ``folder/children`` (one ``<pid>.tsv``
    per child, phases ``warmup``, ``job`` (what: the entry) and ``case`` (``entry::case``)): how
    many, their warm-up (torch, device context, staged kernels) wall and CPU seconds, their jobs'
    and cases' summed wall seconds (a job's time outside its cases: loading the entry, its cases,
    the judge), the first case of each entry in each child against that entry's later cases (the
    first use: imports, JIT loads, first launches -- paid once per child that runs the entry), the
    children's CPU seconds and their idle share between their first warm-up start and last job
    end. Empty when no child wrote rows."""
    kids = load(Path(folder) / "children") if (Path(folder) / "children").is_dir() else {}
    kids = {k: v for k, v in kids.items() if v}
    if not kids:
        return []
    warm = [r for rows in kids.values() for r in rows if r[2] == "warmup"]
    jobs = [r for rows in kids.values() for r in rows if r[2] == "job"]
    cases = [r for rows in kids.values() for r in rows if r[2] == "case"]
    job_s = sum(r[1] - r[0] for r in jobs)
    case_s = sum(r[1] - r[0] for r in cases)
    firsts: dict[tuple[str, str], float] = {}
    later: dict[str, list[float]] = {}
    for pid, rows in kids.items():
        for r in sorted((r for r in rows if r[2] == "case"), key=lambda r: r[0]):
            entry = r[3].split("::", 1)[0]
            if (pid, entry) in firsts:
                later.setdefault(entry, []).append(r[1] - r[0])
            else:
                firsts[(pid, entry)] = r[1] - r[0]
    extra: dict[str, float] = {}
    for (_, entry), sec in firsts.items():
        base = statistics.median(later[entry]) if later.get(entry) else 0.0
        extra[entry] = extra.get(entry, 0.0) + max(0.0, sec - base)
    cpu = sum(max(r[5] for r in rows) for rows in kids.values())
    t0 = min(r[0] for rows in kids.values() for r in rows)
    t1 = max(r[1] for rows in kids.values() for r in rows)
    busy = sum(r[1] - r[0] for r in warm) + job_s
    out = [f"kernel children: {len(kids)}; warm-up mean {statistics.mean([r[1] - r[0] for r in warm]) if warm else 0:.1f} s "
           f"(max {max([r[1] - r[0] for r in warm], default=0):.1f}, CPU mean "
           f"{statistics.mean([r[5] - r[4] for r in warm]) if warm else 0:.1f}); {len(jobs)} jobs {job_s:.1f} s, of which "
           f"{len(cases)} cases {case_s:.1f} s and {job_s - case_s:.1f} s outside cases; CPU {cpu:.0f} s; idle "
           f"{100 * (1 - busy / max(1e-9, len(kids) * (t1 - t0))):.0f}% of {len(kids)} x {t1 - t0:.1f} s",
           f"  first use of an entry in a child: {len(firsts)} (child, entry) pairs, {sum(firsts.values()):.1f} s, "
           f"{sum(extra.values()):.1f} s over the entry's median later case; most:"]
    for entry, sec in sorted(extra.items(), key=lambda kv: -kv[1])[:top]:
        n = sum(1 for (_, e) in firsts if e == entry)
        out.append(f"  {sec:7.1f} s  {entry} (in {n} children)")
    return out


def ends_of_run(loaded: dict, t_first: float, t_last: float) -> list[str]:
    """The run's two ends, from the rows the conftest writes around them: how long after the
    xdist controller (``main``) started its first worker started, and after the last test's end
    when the workers reported done (``nodedown``), ended their ``unconfigure`` and began their
    interpreter's shutdown (``exit``), and when the controller's ``sessionfinish`` (it waits for
    every worker process to exit), ``unconfigure`` (the kernel broker's children end) and
    ``exit`` ended. Empty without a controller timeline (a plain run, or an older one)."""
    main = loaded.get("main")
    workers = [r for w, rows in loaded.items() if w != "main" for r in rows]  # every worker's rows
    if not main or not workers:
        return []

    def last(rows, phase):
        return max((r[1] for r in rows if r[2] == phase), default=None)

    out = []
    c0 = min((r[0] for r in main if r[2] == "sessionstart"), default=None)
    if c0 is not None:
        imports = [r[1] - r[0] for r in workers if r[2] == "imports"]
        out.append(f"start: the first worker started {t_first - c0:.1f} s after the controller"
                   + (f"; a worker's python start-up and imports before it (torch): mean {statistics.mean(imports):.1f} s, "
                      f"max {max(imports):.1f} s" if imports else ""))
    marks = [("workers reported done", last(main, "nodedown")),
             ("workers' unconfigure ended", last(workers, "unconfigure")),
             ("workers' main threads ended", last(workers, "mainend")),
             ("workers' shutdown began", last(workers, "exit")),
             ("controller's sessionfinish ended (waits for every worker process to exit)", last(main, "sessionfinish")),
             ("controller's unconfigure ended (kernel broker's children ended)", last(main, "unconfigure")),
             ("controller's shutdown began", last(main, "exit"))]
    shown = [f"{what} +{t - t_last:.1f} s" for what, t in marks if t is not None]
    if shown:
        out.append("end, after the last test: " + "; ".join(shown))
    hooks = sorted((r for r in main if r[2] == "hook" and r[1] - r[0] >= 0.05), key=lambda r: r[0])
    if hooks:  # the controller's end hooks (conftest's ``hook`` rows), in the order they ran
        out.append("controller's end hooks: " + "; ".join(
            f"{r[3]} +{r[0] - t_last:.1f}..+{r[1] - t_last:.1f} s" for r in hooks))
    return out


def judged_time(report: str | Path, top: int = 12) -> str:
    """Where the judged cases' time went, from a JSON report (``--dsv4-report`` or ``check
    --json``): per entry family and stage, the summed kernel-call, reference and comparison
    seconds of every Result that carries ``details["timing"]`` (``oracles.matrix.run_entry``).
    What is left of a run's test time beyond these sums is the harness's: children starting and
    importing, cases loaded and copied, the probes, the subprocess and CLI tests."""
    import gzip
    import json

    p = Path(report)
    raw = gzip.open(p, "rt").read() if p.suffix == ".gz" else p.read_text()
    results = json.loads(raw).get("results", [])
    sums: dict[tuple[str, str], list[float]] = {}
    for r in results:
        t = (r.get("details") or {}).get("timing")
        if not isinstance(t, dict):
            continue
        key = (str(r.get("entry", "?")).split(".", 1)[0], str(r.get("stage", "?")))
        acc = sums.setdefault(key, [0, 0.0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += float(t.get("call_s", 0.0))
        acc[2] += float(t.get("reference_s", 0.0))
        acc[3] += float(t.get("judge_s", 0.0))
    if not sums:
        return f"judged time: no Result in {report} carries details.timing"
    tot = [sum(v[i] for v in sums.values()) for i in range(4)]
    lines = [f"judged cases: {int(tot[0])}; kernel calls {tot[1]:.1f} s, references {tot[2]:.1f} s, "
             f"comparisons {tot[3]:.1f} s (summed over processes)",
             f"{'family':>14} {'stage':>22} {'cases':>6} {'call_s':>8} {'ref_s':>8} {'judge_s':>8}"]
    for (fam, stage), v in sorted(sums.items(), key=lambda kv: -(kv[1][1] + kv[1][2] + kv[1][3]))[:top]:
        lines.append(f"{fam:>14} {stage:>22} {int(v[0]):6d} {v[1]:8.1f} {v[2]:8.1f} {v[3]:8.1f}")
    return "\n".join(lines)


def unit_key(nodeid: str, group: str | None = None) -> str:
    """The scheduling unit of a test: ``@GROUP`` for a test of an ``xdist_group`` (the group runs
    on one worker as one unit), else the node id without any ``@group`` suffix."""
    return f"@{group}" if group else nodeid.split("@", 1)[0]


def unit_durations(junit_paths: list[str | Path], floor_s: float = 0.3) -> dict[str, float]:
    """``{unit: seconds}`` from pytest JUnit XML files (``--junitxml``): each test's time summed per
    scheduling unit (:func:`unit_key`; a name's ``@GROUP`` suffix, which pytest-xdist adds to the
    tests of a group, names the group), the mean over the files where a unit appears in several,
    rounded to 0.1 s; units under ``floor_s`` are left out (their order does not matter)."""
    import xml.etree.ElementTree as ET

    runs: dict[str, list[float]] = {}
    for path in junit_paths:
        per: dict[str, float] = {}
        for tc in ET.parse(path).iter("testcase"):
            name, classname = tc.get("name", ""), tc.get("classname", "")
            group = name.split("@", 1)[1] if "@" in name else None
            parts = classname.split(".")
            # classname "tests.kernels.test_matrix[.Class]": the module is the last test_* part
            cut = max((i for i, p in enumerate(parts) if p.startswith("test")), default=len(parts) - 1)
            nodeid = "/".join(parts[:cut + 1]) + ".py::" + "::".join(parts[cut + 1:] + [name])
            key = unit_key(nodeid, group)
            per[key] = per.get(key, 0.0) + float(tc.get("time") or 0.0)
        for key, sec in per.items():
            runs.setdefault(key, []).append(sec)
    out = {k: round(sum(v) / len(v), 1) for k, v in runs.items()}
    return {k: out[k] for k in sorted(out) if out[k] >= floor_s}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--durations"]:
        if len(args) < 2:
            print("usage: python -m dsv4_numerics.runner.timeline --durations JUNIT.xml [JUNIT.xml ...]", file=sys.stderr)
            return 2
        import json

        print(json.dumps(unit_durations(args[1:]), indent=0, sort_keys=True))
        return 0
    if len(args) not in (1, 3) or (len(args) == 3 and args[1] != "--report"):
        print("usage: python -m dsv4_numerics.runner.timeline DIR [--report REPORT.json[.gz]]", file=sys.stderr)
        return 2
    print(breakdown(args[0]))
    if len(args) == 3:
        print(judged_time(args[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
