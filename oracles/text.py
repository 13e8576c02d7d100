"""Short text forms of measured numbers, one rule for every table and summary line.

``format_number``: three significant digits (``f"{v:.3g}"``: ``0.000123`` -> ``"0.000123"``,
``12345.0`` -> ``"1.23e+04"``), ``"inf"`` / ``"-inf"`` / ``"nan"`` for the non-finite, and ``"-"``
for a missing value (``None``: a verdict without a worst-ulp count, a run without a headroom).
"""

from __future__ import annotations

__all__ = ["format_number"]


def format_number(v: float | None) -> str:
    """``v`` to three significant digits; ``"-"`` for ``None`` (module docstring)."""
    return "-" if v is None else f"{float(v):.3g}"
