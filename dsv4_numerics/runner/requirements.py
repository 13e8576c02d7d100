"""Required entries: which kernel entries a run must judge, and whether it judged them.

``check --require`` / ``--require-available`` and the pytest plugin's ``--dsv4-require`` /
``--dsv4-require-available`` share this rule; they differ only in where the evidence comes from
(``check``'s table rows, the Results the tests attached) and in how a failure line reads.

A requirement is a ``(pattern, entry name)`` pair: ``pattern`` is the glob the user gave
(a name or an ``fnmatch`` glob, case-sensitive: ``kernels.registry.match_patterns``) or the flag's name for "every entry whose architectures match the
hardware here". It is met when at least one of the entry's cases was *judged* (verdict
``pass``, ``fail`` or ``error``): an entry that was unavailable, only skipped, or never ran
fails it, with the reason. Its record, as both reports write it::

    {"require": pattern, "entry": name, "judged": int, "ok": bool, "reason": str}

Importing this module imports no torch (the pytest plugin imports it).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable


def fitting_names(entries: Iterable[Any]) -> list[str]:
    """The names of ``entries`` whose architectures (``entry.archs``) match the hardware here."""
    from dsv4_numerics.kernels.probe import arch_reason

    return [e.name for e in entries if arch_reason(e.archs) is None]


def no_fit_failure(flag: str, what: str) -> str:
    """The failure line of ``flag`` (require-available) when no ``what`` entry fits the hardware."""
    from dsv4_numerics.kernels.probe import gpu_info

    return f"{flag}: no {what} entry's architectures match the hardware here ({gpu_info().describe()})"


def outcome(required: Iterable[tuple[str, str]], judged: Callable[[str], int], why_not: Callable[[str], str],
            line: str) -> tuple[list[dict[str, Any]], list[str]]:
    """``(records, failures)`` of the ``required`` pairs (duplicates once): ``judged(name)`` is
    the number of the entry's judged cases, ``why_not(name)`` the reason it has none; each unmet
    pair adds ``line.format(require=pattern, entry=name, reason=reason)`` to the failures."""
    records: list[dict[str, Any]] = []
    failures: list[str] = []
    for pat, name in dict.fromkeys(required):
        n = judged(name)
        reason = ""
        if n == 0:
            reason = why_not(name)
            failures.append(line.format(require=pat, entry=name, reason=reason))
        records.append({"require": pat, "entry": name, "judged": n, "ok": n > 0, "reason": reason})
    return records, failures


__all__ = ["fitting_names", "no_fit_failure", "outcome"]
