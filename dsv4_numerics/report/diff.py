"""``dsv4-numerics report diff BASE NEW``: what changed between two runs, as a CI gate.

BASE and NEW are each a report (``check --json``, ``--dsv4-report``) or a merged matrix
(``report merge --json``); a report is merged on its own first (``report_merge``). Cells are
matched by (entry, stage, arch), so runs of different staged-kernel versions, torch versions
or commits compare cell by cell; the header names each side's versions and commit.

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

Verdicts rank ``pass`` < ``skip`` < ``unavailable`` < ``fail`` < ``error`` (worse to the right).

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

from dsv4_numerics.oracles.text import format_number
from dsv4_numerics.reference.errors import InputError

from dsv4_numerics.report.merge import load_matrix, num
from dsv4_numerics.report.run_meta import staged_versions

RANK = {"pass": 0, "skip": 1, "unavailable": 2, "fail": 3, "error": 4}
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


def _cells(m: dict[str, Any]) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {(r["entry"], r["stage"], a): c for r in m["rows"] for a, c in r["cells"].items()}


def _f(v: Any) -> float | None:
    return None if v is None else num(v)


def compare_cells(b: dict[str, Any], n: dict[str, Any], ratio: float) -> list[tuple[str, bool, str]]:
    """``(kind, regression, text)`` for one cell present on both sides."""
    out = []
    vb, vn = b["verdict"], n["verdict"]
    if vb != vn:
        worse = RANK.get(vn, 4) > RANK.get(vb, 4)
        kind = "unavailable" if vn in ("unavailable", "skip") and vb in ("pass", "fail", "error") else "verdict"
        why = f" ({n.get('note', '')[:160]})" if worse and n.get("note") else ""
        out.append((kind, worse, f"{vb} -> {vn}{why}"))
    if int(n.get("judged", 0)) < int(b.get("judged", 0)) and vn not in ("unavailable", "skip"):
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
    cb, cn = _cells(base), _cells(new)
    out: list[Change] = []
    for key in sorted(set(cb) | set(cn)):
        b, n = cb.get(key), cn.get(key)
        if b is None:
            out.append(Change("new", *key, False, f"new cell: {n['verdict']}, {n.get('judged', 0)} cases judged"))
        elif n is None:
            out.append(Change("missing", *key, b["verdict"] != "unavailable",
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


def diff_paths(base: list[str], new: list[str], ratio: float = DEFAULT_RATIO):
    """``(base matrix, new matrix, changes)`` for the reports or matrices at the paths."""
    b, n = load_matrix(base), load_matrix(new)
    return b, n, diff_matrices(b, n, ratio)


__all__ = ["Change", "DEFAULT_RATIO", "RANK", "compare_cells", "diff_matrices", "diff_paths", "format_diff"]
