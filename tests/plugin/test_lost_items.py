"""``dsv4_numerics.plugin.lost_items`` (loaded by this repository's root conftest): under xdist, an item a
worker collected but never reported fails the session by name. A foreign suite in a temp dir, run
in a subprocess; its conftest makes a worker run one chosen item without any report -- what one GPU
run of this suite did to a case group (README "How many workers")."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from dsv4_numerics.plugin.lost_items import MAX_LISTED, Ledger

pytest.importorskip("xdist")

_CONFTEST = '''
    import os
    import pytest

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(item, nextitem):
        # in a worker: the chosen items are neither run nor reported
        if os.environ.get("PYTEST_XDIST_WORKER") and item.name in os.environ.get("SWALLOW", "").split(","):
            return True
'''
_TESTS = '''
    import os

    def test_a():
        pass

    def test_b():
        pass

    def test_fails():
        assert os.environ.get("FAIL") != "1"

    def test_crashes():
        if os.environ.get("CRASH") == "1":
            os._exit(3)
'''


def _run(tmp_path, *args, **env):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # pins rootdir: no conftest above is read
    (tmp_path / "conftest.py").write_text(textwrap.dedent(_CONFTEST))
    (tmp_path / "test_x.py").write_text(textwrap.dedent(_TESTS))
    e = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DSV4_"))}
    e.update(env, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # xdist and the plugin under test, no other
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "xdist", "-p", "no:cacheprovider", "-q", "-n", "2",
                           "-p", "dsv4_numerics.plugin.lost_items", *args],
                          cwd=tmp_path, capture_output=True, text=True, env=e, timeout=240)


def test_a_lost_item_fails_the_session_by_name_and_a_crash_or_an_early_stop_does_not(tmp_path):
    """One run loses ``test_b`` and crashes a worker in ``test_crashes`` (xdist reports the crashed
    item as failed: it has a report, so it is not lost); a run stopped by ``-x`` is not judged. A run
    that loses nothing passes: this repository's own suite, which loads the plugin, is that run."""
    lost = _run(tmp_path, SWALLOW="test_b", CRASH="1")
    assert lost.returncode == 1, lost.stdout[-2000:]
    assert "1 of 4 collected items got no report" in lost.stdout and "  test_x.py::test_b" in lost.stdout
    assert "crashed" in lost.stdout and "  test_x.py::test_crashes" not in lost.stdout
    assert "1 failed, 2 passed" in lost.stdout  # pytest's own counts never saw test_b
    stop = _run(tmp_path, "-x", SWALLOW="test_a", FAIL="1")
    assert "lost items" not in stop.stdout and stop.returncode != 0, stop.stdout[-2000:]


def test_the_ledger_names_the_first_items_in_collection_order():
    ledger = Ledger()
    ids = [f"t.py::test_{i}" for i in range(MAX_LISTED + 5)]
    ledger.collect(ids[:10])
    ledger.collect(ids)  # every worker sends the same collection
    assert ledger.message() is not None and ledger.missing() == ids
    for i in ids[::2]:
        ledger.report(i)
    text = ledger.message()
    assert f"{len(ids[1::2])} of {len(ids)} collected items" in text
    assert [line.strip() for line in text.splitlines()[1:]] == ids[1::2]
    for i in ids:
        ledger.report(i)
    assert ledger.message() is None
    big = Ledger()
    big.collect(ids)
    assert big.message().splitlines()[-1].strip() == "... and 5 more"
