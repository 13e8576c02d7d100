"""A guard for pytest-xdist runs: every item the workers collected must come back with a report.

Under xdist the controller prints the counts of the reports it received. An item that a worker
collected but never reported -- no pass, fail, skip or crash report -- is simply absent: from the
counts, from JUnit, from ``--dsv4-report``, and the run can end green. One GPU run of this suite
lost a case group that way (5 items, after its worker spent 226 s in it; README "How many
workers"). With this plugin the controller keeps a ledger -- the ids each worker collected
(``pytest_xdist_node_collection_finished``) against the ids that got a report
(``pytest_runtest_logreport``) -- and at the session's end names the items that got none and
fails the session (exit status 1).

Opt-in: ``-p dsv4_numerics.plugin.lost_items`` (this repository's root conftest loads it). Without xdist,
or in an xdist worker, it does nothing. It does not judge a run that stopped early on purpose
(``-x`` / ``--maxfail`` reached, or interrupted): those leave items unrun by design.
"""
from __future__ import annotations

import pytest

__all__ = ["Ledger", "MAX_LISTED"]

MAX_LISTED = 20  # items named in the message; the rest are counted


class Ledger:
    """The controller's record of collected and reported item ids (insertion order kept)."""

    def __init__(self) -> None:
        self.collected: dict[str, None] = {}
        self.reported: set[str] = set()

    def collect(self, ids) -> None:
        for i in ids:
            self.collected.setdefault(i)

    def report(self, nodeid: str) -> None:
        self.reported.add(nodeid)

    def missing(self) -> list[str]:
        """The collected ids without a report, in collection order."""
        return [i for i in self.collected if i not in self.reported]

    def message(self) -> str | None:
        """The failure's text, or None when nothing is missing."""
        lost = self.missing()
        if not lost:
            return None
        more = len(lost) - MAX_LISTED
        names = "\n".join(f"  {i}" for i in lost[:MAX_LISTED]) + (f"\n  ... and {more} more" if more > 0 else "")
        return (f"dsv4-numerics: {len(lost)} of {len(self.collected)} collected items got no report (not "
                f"passed, failed, skipped nor reported as a crash): a worker lost them, so the counts, "
                f"JUnit and --dsv4-report leave them out; failing the session\n{names}")


_LEDGER = pytest.StashKey[Ledger]()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    config = node.config
    if _LEDGER not in config.stash:
        config.stash[_LEDGER] = Ledger()
    config.stash[_LEDGER].collect(ids)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    session.config.pluginmanager.register(_Reports(session.config), "dsv4-lost-items-reports")


class _Reports:
    """Records every report's id into the session's ledger (the controller's, once the workers
    have sent their collections)."""

    def __init__(self, config) -> None:
        self.config = config

    def pytest_runtest_logreport(self, report):
        ledger = self.config.stash.get(_LEDGER, None)
        if ledger is not None:
            ledger.report(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    ledger = session.config.stash.get(_LEDGER, None)
    if ledger is None or exitstatus == pytest.ExitCode.INTERRUPTED or session.shouldfail or session.shouldstop:
        return
    text = ledger.message()
    if text is None:
        return
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write("\n")  # after the progress line, which has no newline yet
        tr.write_sep("=", "lost items", red=True)
        for line in text.splitlines():
            tr.write_line(line, red=True, bold=line.startswith("dsv4-numerics"))
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
