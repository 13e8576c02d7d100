"""``--dsv4-repro DIR``: one reproducer (``dsv4_numerics.repro``) per failing case that ``judge``
(or ``assert_matches_reference``) judges inside a test, in ``DIR/<test id>/<case>/``.

Inside a hypothesis test only the final replay of the shrunk failing example is written (the
examples drawn and shrunk before it are not). A registry entry's reproducer calls its production op; a plain callable's imports it by its
dotted path (a callable that is not importable that way -- a lambda, a local function -- gets a
line saying so instead). Writing never changes the test's outcome: a problem is reported in the
terminal summary.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

OPTION = "--dsv4-repro"
WRITTEN: list[str] = []  # summary lines of this process, for the terminal summary


def folder_name(nodeid: str) -> str:
    """A file-system-safe folder name for a test id."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_")[:150]


def sink_for(nodeid: str, root: str):
    """The ``judged`` sink (``api.result_sink``) of one test: writes a reproducer per failing Result."""

    def sink(kernel: Any, stage: str, cases: list, policies: dict, results: list) -> None:
        from dsv4_numerics.reference.errors import InputError
        from dsv4_numerics.repro.job import make

        if drawing_not_final():
            return

        by_name = {c.name: c for c in cases}
        for r in results:
            if r.verdict != "fail" or r.case not in by_name:
                continue
            out = Path(root) / folder_name(nodeid) / folder_name(r.case)
            try:
                rep = make(kernel, stage, case=by_name[r.case], out=out, force=True, policies=policies, impact=False)
            except InputError as e:
                WRITTEN.append(f"{nodeid} [{r.case}]: no reproducer: {e}")
                continue
            WRITTEN.append(f"{nodeid} [{r.case}]: {rep.out} ({rep.lines} lines, {rep.input_bytes} input bytes, "
                           f"exits {rep.exit_status})")

    return sink


def drawing_not_final() -> bool:
    """Inside a hypothesis test, true for every example but the final replay of the shrunk
    failing one: only that one is written (hypothesis has already minimised it)."""
    try:
        from hypothesis.control import current_build_context, currently_in_test_context
    except ImportError:
        return False
    if not currently_in_test_context():
        return False
    return not getattr(current_build_context(), "is_final", True)


def summary(terminalreporter) -> None:
    if WRITTEN:
        terminalreporter.section("dsv4-numerics reproducers")
        for line in WRITTEN:
            terminalreporter.write_line(line)


__all__ = ["OPTION", "WRITTEN", "drawing_not_final", "folder_name", "sink_for", "summary"]
