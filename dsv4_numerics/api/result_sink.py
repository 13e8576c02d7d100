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

_SINKS: list[Callable[[list[Any]], None]] = []


def publish(results: list[Any]) -> None:
    """Give ``results`` (``oracles.report.Result`` objects) to every installed sink."""
    for sink in list(_SINKS):
        sink(list(results))


@contextmanager
def collecting(sink: Callable[[list[Any]], None]) -> Iterator[None]:
    """Install ``sink`` while the block runs (nested blocks: every installed sink gets them)."""
    _SINKS.append(sink)
    try:
        yield
    finally:
        _SINKS.remove(sink)


__all__ = ["collecting", "publish"]
