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

A replayed graph (``fast_graphs``) does not build the padded call: ``write_padded`` writes the caller's
tensors straight into the graph's static inputs, which hold the padded layout, and rewrites only the
padding that the previous call's data covered (the static buffers then equal ``pad_call``'s tensors
exactly; ``tests/attention/test_fast_buckets.py`` checks it over sequences of shapes).
``flat_signature`` gives the padded call's graph signature from the shapes alone.
"""
from __future__ import annotations

import torch

__all__ = ["bucket", "pad_call", "padded_shapes", "flat_signature", "write_padded"]

_FULL: dict = {}  # 0-dim index tensors of a padded row count, per (value, dtype, device)


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


def _row_count(n: int, idx: torch.Tensor) -> torch.Tensor:
    """``n`` as a 0-dim tensor of ``idx``'s dtype and device (kept: a replay moves indices ``>= N`` to
    the padded row count ``N'`` on every call)."""
    key = (n, idx.dtype, idx.device)
    t = _FULL.get(key)
    if t is None:
        t = _FULL[key] = torch.full((), n, dtype=idx.dtype, device=idx.device)
    return t


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
            idx = torch.where(idx >= N, _row_count(Np, idx), idx)
        if Kp != K or Tp != T:
            full = idx.new_full((Tp, Kp), -1)
            full[:T, :K] = idx
            idx = full
        length = None if s.length is None else _pad_rows(s.length, Tp)
        out.append(Segment(_pad_rows(s.rows, Np), idx, length, s.rule))
    return _pad_rows(q, Tp), out


def flat_signature(q: torch.Tensor, sink, segments: list, pad: bool, padded: tuple | None = None) -> tuple:
    """``fast_graphs.signature`` of the flat inputs ``[q, sink, rows_0, idx_0, length_0, ...]`` of the
    padded call (``pad``; else of the call itself), from the shapes alone: no tensor is built.
    ``padded``: ``padded_shapes``' value for this call, where the caller has it."""
    T, H, D = q.shape
    if pad:
        Tp, shapes = padded if padded is not None else padded_shapes(T, segments)
    else:
        Tp, shapes = T, [(s.rows.shape[0], s.idx.shape[1]) for s in segments]
    sig = [((Tp, H, D), q.dtype), None if sink is None else (tuple(sink.shape), sink.dtype)]
    for s, (Np, Kp) in zip(segments, shapes):
        sig += [((Np, *s.rows.shape[1:]), s.rows.dtype), ((Tp, Kp), s.idx.dtype),
                None if s.length is None else ((Tp,), s.length.dtype)]
    return tuple(sig)


def _fill_outside(dst: torch.Tensor, new: tuple, old: tuple, value) -> None:
    """Set ``dst`` to ``value`` where the previous call's data (its leading extents ``old``) lies
    outside this call's (``new``): one ``fill_`` per dimension in which the extent shrank (1-D and
    2-D extents)."""
    if old[0] > new[0]:
        dst[new[0]:old[0]].fill_(value)
    if len(new) == 2 and old[1] > new[1]:
        dst[:min(new[0], old[0]), new[1]:old[1]].fill_(value)


def _copy_all(dst: list, src: list) -> None:
    """``d.copy_(s)`` for each pair, as one ``torch._foreach_copy_`` call where this PyTorch has it
    (the loop runs in C++: a fraction of the host cost of one Python call per tensor)."""
    fe = getattr(torch, "_foreach_copy_", None)
    if fe is not None:
        fe(dst, src)
    else:  # pragma: no cover - PyTorch < 2.1
        for d, s in zip(dst, src):
            d.copy_(s)


def write_padded(static: list, q: torch.Tensor, sink, segments: list, written) -> list:
    """Write a call into the static inputs of its padded layout (``flat_signature``'s order): afterwards
    ``static`` equals ``pad_call``'s tensors of this call element for element. ``written``: what the
    previous call of these buffers returned (the leading extents of its data per input), or None
    (unknown, e.g. just captured: every element outside this call's data is rewritten). Returns this
    call's extents. The copies go by dtype, one ``torch._foreach_copy_`` each (the static regions
    of q, the rows and the lengths are leading slices, hence contiguous); an index block narrower
    than its padded width, or one whose ``>= N_s`` entries move to ``N_s'`` (module docstring), is
    written by its own operation. No device value is read."""
    T = q.shape[0]
    mine = [(T,), None]
    for s in segments:
        mine += [(s.rows.shape[0],), tuple(s.idx.shape), None if s.length is None else (T,)]
    if written is None:
        written = [None if t is None else tuple(t.shape) for t in static]
    groups: dict = {}

    def copy(dst, src):
        if dst.is_contiguous():
            d, s_ = groups.setdefault(dst.dtype, ([], []))
            d.append(dst)
            s_.append(src)
        else:
            dst.copy_(src)

    Tp = static[0].shape[0]
    copy(static[0] if T == Tp else static[0][:T], q)  # (a slice is a host operation: none where it is the whole)
    _fill_outside(static[0], mine[0], written[0], 0)
    if sink is not None:
        copy(static[1], sink)
    for i, s in enumerate(segments):
        rows, idx, length = static[2 + 3 * i:5 + 3 * i]
        N, K = s.rows.shape[0], s.idx.shape[1]
        copy(rows if N == rows.shape[0] else rows[:N], s.rows)
        _fill_outside(rows, mine[2 + 3 * i], written[2 + 3 * i], 0)
        dst = idx if (T, K) == (Tp, idx.shape[1]) else idx[:T, :K]
        if rows.shape[0] > N:  # an index >= N stays out of range: N' (module docstring)
            torch.where(s.idx >= N, _row_count(rows.shape[0], idx), s.idx, out=dst)
        else:
            copy(dst, s.idx)
        _fill_outside(idx, mine[3 + 3 * i], written[3 + 3 * i], -1)
        if length is not None:
            copy(length if T == Tp else length[:T], s.length)
            _fill_outside(length, mine[4 + 3 * i], written[4 + 3 * i], 0)
    for d, s_ in groups.values():
        _copy_all(d, s_)
    return mine
