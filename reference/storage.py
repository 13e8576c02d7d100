"""Layout-keeping copies of strided tensors.

A paged KV cache is often a view with gaps: ``[num_blocks, block_size, record]`` whose page stride
is larger than ``block_size * record`` (the scale rows and the page tail sit after the data rows),
or a view at a storage offset. ``Tensor.clone()`` compacts such a view and drops every byte outside
it; a writer's reference or an adapter that mutates a copy must keep the whole storage instead, so
the bytes it did not write (page tails, other layers' pages) compare equal to the original.
"""

from __future__ import annotations

import torch

__all__ = ["clone_storage"]


def clone_storage(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with identical dtype, device, sizes, strides and storage offset over a copy
    of its whole storage (bytes outside the view copied too), so a writer can mutate it while the
    caller's tensor stays untouched."""
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    out.set_(t.untyped_storage().clone(), t.storage_offset(), t.size(), t.stride())
    return out
