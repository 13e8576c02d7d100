"""Where ``judge`` hands its Results besides returning them: the sinks the pytest plugin installs
around each test, so a test's Results reach ``--dsv4-report`` even when the test never gets to
hand them over itself (``assert_matches_reference`` raised, the test skipped or failed after
judging).

``publish(results)`` calls every installed sink with the list (nothing happens when none is
installed: outside a pytest session with the plugin, ``judge`` behaves exactly as before).
``collecting(sink)`` installs ``sink`` for the duration of a ``with`` block. Sinks must accept
the same Result objects more than once (the plugin deduplicates by identity).

``announce(call)`` tells every watcher (``watching(watcher)``) that a kernel is about to be
called on one case, *before* the call: ``call`` is a dict with ``entry``, ``stage``, ``case``,
``family``, ``device`` and ``policies``. If the call takes its process down (a segfault in a
kernel judged in-process), that announcement is what is left: the plugin writes it to its
xdist spool so the controller can still report an ``error`` for that kernel and case.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

RESULTS, JUDGED = "results", "judged"
_SINKS: dict[str, list[Callable[..., None]]] = {RESULTS: [], JUDGED: []}
_WATCHERS: list[Callable[[dict], None]] = []


def publish(results: list[Any]) -> None:
    """Give ``results`` (``oracles.report.Result`` objects) to every installed sink."""
    for sink in list(_SINKS[RESULTS]):
        sink(list(results))


def publish_judged(kernel: Any, stage: str, cases: list[Any], policies: dict, results: list[Any]) -> None:
    """Give one ``judge`` call -- the kernel, its stage, the Case objects, the policies it was
    given and its Results -- to every ``judged`` sink (the plugin's ``--dsv4-repro``)."""
    for sink in list(_SINKS[JUDGED]):
        sink(kernel, stage, list(cases), dict(policies), list(results))


def announce(call: dict) -> None:
    """Tell every installed watcher that a kernel call starts (module docstring)."""
    for watcher in list(_WATCHERS):
        watcher(dict(call))


@contextmanager
def _installed(registry: list, fn: Callable) -> Iterator[None]:
    registry.append(fn)
    try:
        yield
    finally:
        registry.remove(fn)


def collecting(sink: Callable[..., None], kind: str = RESULTS):
    """Install ``sink`` (of ``kind``: ``results`` or ``judged``) while the block runs (nested
    blocks: every installed sink gets them)."""
    return _installed(_SINKS[kind], sink)


def watching(watcher: Callable[[dict], None]):
    """Install ``watcher`` (gets every :func:`announce`) while the block runs."""
    return _installed(_WATCHERS, watcher)


__all__ = ["JUDGED", "RESULTS", "announce", "collecting", "publish", "publish_judged", "watching"]
