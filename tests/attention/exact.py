"""Independent exact-arithmetic helpers for the attention-area tests (fractions, no torch)."""

from __future__ import annotations

import math
import struct
from fractions import Fraction


def f32(x: float) -> float:
    """The float32 value nearest to the Python float ``x`` (via struct: IEEE RNE)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _round_fraction(x: Fraction, mant_bits: int, emin: int, emax: int) -> float:
    """Round the exact rational ``x`` to a binary format with ``mant_bits`` significant bits,
    minimum normal exponent ``emin`` and maximum exponent ``emax``, ties to even."""
    if x == 0:
        return 0.0
    sign = -1 if x < 0 else 1
    a = abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    assert Fraction(2) ** e <= a < Fraction(2) ** (e + 1)
    e = max(e, emin)
    quantum = Fraction(2) ** (e - (mant_bits - 1))
    m = a / quantum
    fl = m.numerator // m.denominator
    rem = m - fl
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and fl % 2 == 1):
        fl += 1
    r = fl * quantum
    if r >= Fraction(2) ** (emax + 1):
        return sign * math.inf
    return sign * float(r)


def rn32(x: Fraction) -> float:
    """IEEE binary32 round-to-nearest-even of an exact rational (subnormals, overflow)."""
    return _round_fraction(x, 24, -126, 127)


def rnbf16(x: Fraction) -> float:
    """bfloat16 round-to-nearest-even of an exact rational."""
    return _round_fraction(x, 8, -126, 127)


def F(x: float) -> Fraction:
    return Fraction(x)
