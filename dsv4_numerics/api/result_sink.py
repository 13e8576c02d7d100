"""Where ``judge`` hands its Results besides returning them: the sinks the pytest plugin installs
around each test, so a test's Results reach ``--dsv4-report`` even when the test never gets to
hand them over itself (``assert_matches_reference`` raised, the test skipped or failed after
judging).

``publish(results)`` calls every installed sink with the list (nothing happens when none is
installed: outside a pytest session with the plugin, ``judge`` behaves exactly as before).
``collecting(sink)`` installs ``sink`` for the duration of a ``with`` block. Sinks must accept
the same Result objects more than once (the plugin deduplicates by identity).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

RESULTS, JUDGED = "results", "judged"
_SINKS: dict[str, list[Callable[..., None]]] = {RESULTS: [], JUDGED: []}


def publish(results: list[Any]) -> None:
    """Give ``results`` (``oracles.report.Result`` objects) to every installed sink."""
    for sink in list(_SINKS[RESULTS]):
        sink(list(results))


def publish_judged(kernel: Any, stage: str, cases: list[Any], policies: dict, results: list[Any]) -> None:
    """Give one ``judge`` call -- the kernel, its stage, the Case objects, the policies it was
    given and its Results -- to every ``judged`` sink (the plugin's ``--dsv4-repro``)."""
    for sink in list(_SINKS[JUDGED]):
        sink(kernel, stage, list(cases), dict(policies), list(results))


@contextmanager
def collecting(sink: Callable[..., None], kind: str = RESULTS) -> Iterator[None]:
    """Install ``sink`` (of ``kind``: ``results`` or ``judged``) while the block runs (nested
    blocks: every installed sink gets them)."""
    _SINKS[kind].append(sink)
    try:
        yield
    finally:
        _SINKS[kind].remove(sink)


__all__ = ["JUDGED", "RESULTS", "collecting", "publish", "publish_judged"]
