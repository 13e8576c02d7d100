"""Shape buckets for the fast oracle: pad a call so that calls of nearby shapes share one CUDA graph.

A captured graph (``fast_graphs``) fixes every input shape, so the matrix's cases and hypothesis's
draws -- each a new batch, top-k or pool size -- would all run eagerly. ``pad_call`` pads a
call's tokens ``T``, each segment's columns ``K_s`` and rows ``N_s`` up to the grid ``bucket``
(``1, 2, 3, 4, 6, 8, 12, ...``: powers of two and 1.5 times them, so at most 1.5x the work per
padded dimension, and at most ~2 log2(n) buckets up to ``n``), with entries that are invalid by
every convention of ``attention.py``:

* padded columns hold ``-1`` (the empty sentinel under both ``IndexRule`` values);
* padded tokens have all-``-1`` columns and length 0 (lonely rows: output 0, ``lse = -inf``),
  and zero ``q`` rows;
* padded rows are zeros, referenced by no valid slot: an index ``>= N_s`` (out of range in the
  original call: invalid under ``any_out_of_range_invalid``, an input error under ``minus1_only``)
  is moved to ``N_s'`` (out of range of the padded table), so it keeps its meaning.

Why the result is the same (the bound's claim, ``fast_bound``'s module docstring): the ordered
oracle of the padded call equals the ordered oracle of the original call bit for bit on the
original tokens -- invalid slots are zeroed and masked before any arithmetic, each token is
independent, and the padded columns come after the real ones, so the sequential row sum and P.V
loop only add exact zeros (``x + 0 = x``; ``L >= 1``) and the max ignores ``-inf``. The fast
oracle of the padded call is within its returned bound ``B'`` of that ordered result, so the
bucketed outputs (the original tokens' slice) are within ``B'`` of the original call's ordered
oracle. ``B'`` is the bound for ``K' = sum K_s'`` slots (``g_K'`` instead of ``g_K``: at most
1.5x larger in those terms) and the same per-row features (invalid slots read the table's zero
row). Not bit-identical to the unbucketed fast call (the unordered reductions see other
lengths); ``tests/attention/test_fast_buckets.py`` checks the bound on every default case.

Validation is unchanged: ``attention_fast`` checks the original arguments on the host, and the
deferred device checks (lengths in ``[0, K_s]``, ``-1``-only indices) compare the padded call's
values with the original ``K_s`` (a length in ``(K_s, K_s']`` is still an error).
"""
from __future__ import annotations

import torch

__all__ = ["bucket", "pad_call", "padded_shapes"]


def bucket(n: int) -> int:
    """The smallest value of ``{2**k} | {3 * 2**k}`` that is ``>= n`` (``0`` for ``n <= 0``)."""
    if n <= 0:
        return 0
    p = 1 << (n - 1).bit_length()  # the power of two >= n
    return 3 * p // 4 if p >= 4 and 3 * p // 4 >= n else p


def padded_shapes(T: int, segments: list) -> tuple[int, list[tuple[int, int]]]:
    """``(T', [(N_s', K_s')])``: the bucketed token count and per segment row and column counts.
    The row count of a non-empty table is bucketed; a segment of 0 columns keeps 0."""
    return bucket(T), [(bucket(s.rows.shape[0]), bucket(s.idx.shape[1])) for s in segments]


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` with zero rows appended up to ``n`` rows (``x`` itself when it has them)."""
    if x.shape[0] == n:
        return x
    out = x.new_zeros((n, *x.shape[1:]))
    out[:x.shape[0]] = x
    return out


def pad_call(q: torch.Tensor, segments: list) -> tuple[torch.Tensor, list]:
    """The padded ``q`` ``[T', H, D]`` and segments (module docstring). Device-side only: no value
    is read on the host. Returns the inputs themselves where nothing needs padding."""
    from .ordered import Segment

    T = q.shape[0]
    Tp, shapes = padded_shapes(T, segments)
    out = []
    for s, (Np, Kp) in zip(segments, shapes):
        N, K = s.rows.shape[0], s.idx.shape[1]
        idx = s.idx
        if Np > N:  # an index >= N stays out of range (module docstring)
            idx = torch.where(idx >= N, torch.full((), Np, dtype=idx.dtype, device=idx.device), idx)
        if Kp != K or Tp != T:
            full = idx.new_full((Tp, Kp), -1)
            full[:T, :K] = idx
            idx = full
        length = None if s.length is None else _pad_rows(s.length, Tp)
        out.append(Segment(_pad_rows(s.rows, Np), idx, length, s.rule))
    return _pad_rows(q, Tp), out
