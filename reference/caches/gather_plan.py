"""Which cache slot each output row of a paged dequantise-gather reads (datapath 4.5): the
position arithmetic and argument rules shared by every record's gather (``cache_model1.gather``
for the 584-byte pages, ``cache_v41.gather`` for the V4.1 528/288-byte pages).

For request ``b`` with ``L = seq_lens[b]`` and ``g = gather_lens[b]`` (``L`` when None), output row
``offset + i`` (``0 <= i < g``) reads request position ``pos = L - g + i``, global slot
``block_table[b, pos // bs] * bs + pos % bs`` (vLLM ``V:models/deepseek_v41/common/ops/
cache_utils.py:353-371,529-575,590-640``; the V4 gathers index the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import INDEX_DTYPES, check_dtype, check_int, check_rank, fail

__all__ = ["GatherPlan", "gather_plan"]


@dataclass(frozen=True)
class GatherPlan:
    """``requests`` R, output ``width = offset + max(g)``; per gathered row (int64 CPU tensors of
    one length): its request ``req``, its output row ``row`` and the global ``slot`` it reads."""

    requests: int
    width: int
    req: torch.Tensor
    row: torch.Tensor
    slot: torch.Tensor


def _lengths(fn: str, arg: str, t: torch.Tensor) -> torch.Tensor:
    check_dtype(fn, arg, t, INDEX_DTYPES)
    check_rank(fn, arg, t, 1)
    return t.to(torch.int64).cpu()


def gather_plan(fn: str, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_blocks: int,
                gather_lens: torch.Tensor | None = None, offset: int = 0) -> GatherPlan:
    """The rows a gather writes and the slots they read, after checking the arguments (errors name
    ``fn``): block_table int ``[R, max_blocks]``; seq_lens, gather_lens int ``[R]`` with
    ``0 <= g <= L``; the table must cover every gathered position with pages in
    ``[0, num_blocks)``; ``offset >= 0``."""
    check_dtype(fn, "block_table", block_table, INDEX_DTYPES)
    check_rank(fn, "block_table", block_table, 2)
    bs = check_int(fn, "block_size", block_size, minimum=1)
    seq = _lengths(fn, "seq_lens", seq_lens)
    r = block_table.shape[0]
    if seq.shape[0] != r:
        fail(fn, "seq_lens", f"must have one entry per block_table row ({r})", f"length {seq.shape[0]}")
    if bool((seq < 0).any()):
        fail(fn, "seq_lens", "must be >= 0")
    if gather_lens is None:
        g = seq.clone()
    else:
        g = _lengths(fn, "gather_lens", gather_lens)
        if g.shape[0] != r:
            fail(fn, "gather_lens", f"must have one entry per request ({r})", f"length {g.shape[0]}")
        if bool(((g < 0) | (g > seq)).any()):
            fail(fn, "gather_lens", "must satisfy 0 <= gather_lens[b] <= seq_lens[b]")
    check_int(fn, "offset", offset, minimum=0)
    bt = block_table.to(torch.int64).cpu()
    width = offset + (int(g.max()) if r else 0)
    total = int(g.sum()) if r else 0
    empty = torch.zeros(0, dtype=torch.int64)
    if total == 0:
        return GatherPlan(r, width, empty, empty, empty)
    # Every gathered (request, row) pair at once (the metadata is host-side, like the kernels' own
    # launch arguments): request index, row i within the request, position L - g + i.
    req = torch.repeat_interleave(torch.arange(r, dtype=torch.int64), g)
    start = torch.cumsum(g, 0) - g
    i = torch.arange(total, dtype=torch.int64) - start[req]
    pos = (seq - g)[req] + i
    blk = pos // bs
    cols = bt.shape[1]
    short = (g > 0) & ((seq - 1) // bs >= cols)  # the last gathered position is L - 1
    pages = bt[req, blk.clamp(max=cols - 1)] if cols else torch.full_like(blk, -1)
    bad_page = torch.zeros(r, dtype=torch.bool).index_put_((req,), (pages < 0) | (pages >= num_blocks),
                                                          accumulate=True)
    first = torch.nonzero(short | bad_page).flatten()
    if first.numel():
        b = int(first[0])
        if bool(short[b]):
            L = int(seq[b])
            fail(fn, "block_table", f"row {b} is too short: position {L - 1} needs block index "
                 f"{(L - 1) // bs} but the table has {cols} columns")
        pb = pages[req == b]
        fail(fn, "block_table", f"row {b} must hold pages in [0, num_blocks = {num_blocks}) for the gathered "
             "positions", f"{pb[(pb < 0) | (pb >= num_blocks)][:4].tolist()}")
    return GatherPlan(r, width, req, offset + i, pages * bs + pos % bs)
