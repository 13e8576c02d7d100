"""Kernels of a user's own, importable by dotted path, for the reproducer tests (pure torch)."""

from __future__ import annotations

import torch

ROPE_OFFSET = 448  # the 64 RoPE dims of a 512-dim row start here (GPT-J interleaved pairs)


def rope_sign_swapped(inputs: dict) -> dict:
    """A GPT-J RoPE that rotates the wrong way (``e*cos + o*sin``: the inverse) on forward cases."""
    x, pos, cs = inputs["x"], inputs["positions"], inputs["cos_sin"]
    out = x.to(torch.float32).clone()
    rows = cs[pos.to(torch.int64)]
    cos, sin = rows[:, :32], rows[:, 32:]
    while cos.dim() < out.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    e, o = out[..., ROPE_OFFSET::2].clone(), out[..., ROPE_OFFSET + 1::2].clone()
    out[..., ROPE_OFFSET::2] = e * cos + o * sin
    out[..., ROPE_OFFSET + 1::2] = o * cos - e * sin
    return {"out": out}
