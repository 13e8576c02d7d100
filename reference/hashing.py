"""A 32-bit integer mixer, the same bits on every device: the counter-based hash behind the cases
built on the GPU (``cases.attention_device``) and the device fingerprint of kernel outputs
(``oracles.digest``).

``mix32`` takes int64 values in ``[0, 2**32)`` and returns int64 values in ``[0, 2**32)``: two
xor-shift / multiply rounds (the multipliers of the "lowbias32" mixer). Both multipliers are below
``2**31``, so no product reaches ``2**63``: no int64 overflow, hence the same bits from PyTorch's
CPU and CUDA integer kernels. ``mix32_int`` is the same function on a Python integer."""
from __future__ import annotations

import torch

__all__ = ["M32", "mix32", "mix32_int"]

M32 = 0xFFFFFFFF  # the low 32 bits
_A, _B = 0x7FEB352D, 0x2C1B3C6D  # the two multipliers (< 2**31)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The mixer on an int64 tensor of values in ``[0, 2**32)`` (elementwise; a new tensor)."""
    x = x ^ (x >> 16)
    x = (x * _A) & M32
    x = x ^ (x >> 15)
    x = (x * _B) & M32
    return x ^ (x >> 16)


def mix32_int(x: int) -> int:
    """The mixer on a Python integer's low 32 bits."""
    x &= M32
    x ^= x >> 16
    x = (x * _A) & M32
    x ^= x >> 15
    x = (x * _B) & M32
    return x ^ (x >> 16)
