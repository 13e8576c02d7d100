"""Validators for index tables: findings that name every broken entry, not exceptions.

Spec: datapath.md 4.1, 4.5, 4.9, 7 H10/H11; attention.md 2.4 (validity per consumer), 2.5
(lengths are prefix lengths). README section 3 "Index sentinels": the reference flags inputs
that break a consumer's rule (interior ``-1``, out-of-range, count != prefix) instead of quietly
agreeing with either side.

A *finding* describes one entry (or one row, ``column=None``) that a consumer would read out of
bounds, silently drop, or misinterpret. Malformed *arguments* (wrong dtype, rank, shapes that do
not match, a block table narrower than the indices need) raise :class:`~.errors.InputError`.

Finding kinds (``Finding.kind``):

``negative_address``     MINUS1_ONLY consumer: a negative value other than ``-1`` inside the read
                         range is used as an address (out-of-bounds read; FlashMLA decode).
``out_of_range_address`` MINUS1_ONLY consumer: a value ``>= num_rows`` inside the read range.
``dropped_negative``     ANY_OUT_OF_RANGE_INVALID consumer: a negative value other than ``-1`` is
                         silently treated as invalid (FlashMLA prefill, ROCm Triton, SM120).
``dropped_out_of_range`` ANY_OUT_OF_RANGE_INVALID consumer: a value ``>= num_rows`` silently dropped.
``interior_invalid``     an invalid entry inside the read range with a valid entry after it
                         (valid entries are not a prefix; harmless for attention, but a length
                         computed as a count then cuts the row short).
``valid_beyond_length``  a valid entry at a column ``>= length``: the consumer never reads it
                         (a key the producer meant to be attended is lost).
``length_is_count``      row: the length equals the number of valid entries of the row although
                         they do not form a prefix (``compute_global_topk_indices_and_lens``, H10).
``length_out_of_range``  row: length ``< 0`` or ``>`` the row width (the consumer reads past it).
``combine_minus1``       common ``combine_topk_swa_indices`` turned a ``-1`` of request ``r >= 1``
                         into ``M*r - 1``, the last workspace row of request ``r-1`` (H10).
``combine_foreign_row``  a combined top-k entry outside its own request's rows ``[M*r, M*r + N)``.
``other_negative``       local top-k: a negative value other than ``-1`` (vLLM treats it as
                         empty, FlashMLA's helper does not).
``not_visible``          local top-k: an entry ``L >= (p+1)//ratio`` (a compressed entry that does
                         not exist yet at position ``p``; causality).
``duplicate_entry``      local top-k: the same local index twice in one row (counted twice by
                         the softmax).
``prefill_len_mismatch`` local top-k: the row's valid count differs from ``min((p+1)//ratio, K)``,
                         the length every prefill combine assumes (H11).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import INDEX_DTYPES, check_dtype, check_enum, check_int, check_rank, fail
from .slots import as_flags, as_index, lookup_slots
from ..policies import IndexRule


@dataclass(frozen=True)
class Finding:
    """One entry (or row, ``column is None``) a consumer would misread.

    kind: one of the kinds in the module docstring. token: row index. column: column index or
    None for row-level findings. value: the offending index value (or the length for row-level
    findings). message: a sentence for humans naming the rule broken.
    """

    kind: str
    token: int | None
    column: int | None
    value: int | None
    message: str


def _pairs(mask: torch.Tensor) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in mask.nonzero().tolist()]


def _rows(mask: torch.Tensor) -> list[int]:
    return [int(a) for a in mask.nonzero().flatten().tolist()]


def _later(mask: torch.Tensor) -> torch.Tensor:
    """``out[t, c]`` = some ``mask[t, c']`` is True with ``c' > c``."""
    if mask.shape[1] == 0:
        return mask.clone()
    rev = torch.cummax(torch.flip(mask.to(torch.int8), [1]), dim=1).values
    incl = torch.flip(rev, [1]) > 0  # some True at c' >= c
    return torch.cat([incl[:, 1:], torch.zeros_like(incl[:, :1])], dim=1)


def validate_indices(
    idx: torch.Tensor,
    lengths: torch.Tensor | None,
    num_rows: int | None,
    rule: IndexRule | str,
    *,
    row_mask: torch.Tensor | None = None,
    max_findings: int | None = None,
) -> list[Finding]:
    """Every entry of a dense index table a consumer with ``rule`` would misread (datapath 4.9).

    idx: int32/int64 ``[T, K]`` (a 3-D ``[T, 1, K]`` is flattened). lengths: ``[T]`` prefix lengths
    as the consumer uses them (``topk_length``, ``sparse_topk_lens``, ``combined_lens``) or None
    (the whole row is read). num_rows: number of addressable rows (slots ``num_blocks * bs``, or
    workspace rows) or None (no upper bound known). rule: :class:`~.policies.IndexRule`.
    row_mask: optional bool ``[T]``; rows where it is False (padding tokens) are skipped.
    max_findings: stop after this many findings (None: all).

    Validity of a value ``v``: MINUS1_ONLY consumers treat only ``-1`` as empty, everything else is
    an address; ANY_OUT_OF_RANGE_INVALID consumers treat ``0 <= v < num_rows`` as valid, the rest
    as empty. Findings are ordered by (token, column) with row-level findings first in a row.
    """
    fn = "validate_indices"
    check_dtype(fn, "idx", idx, INDEX_DTYPES)
    check_rank(fn, "idx", idx, (2, 3))
    x = idx.to(torch.int64).reshape(idx.shape[0], -1)
    t, k = x.shape
    rule = check_enum(fn, "rule", IndexRule, rule)
    if num_rows is not None:
        num_rows = check_int(fn, "num_rows", num_rows, minimum=0)
    if lengths is None:
        ln = torch.full((t,), k, dtype=torch.int64, device=x.device)
    else:
        ln = as_index(fn, "lengths", lengths, rank=1)
        if ln.shape[0] != t:
            fail(fn, "lengths", f"must have one entry per row of idx ({t})", f"{ln.shape[0]} entries")
    rows_on = torch.ones(t, dtype=torch.bool, device=x.device)
    if row_mask is not None:
        rows_on = as_flags(fn, "row_mask", row_mask)
        if rows_on.shape[0] != t:
            fail(fn, "row_mask", f"must have one entry per row of idx ({t})", f"{rows_on.shape[0]} entries")
    cols = torch.arange(k, device=x.device, dtype=torch.int64)[None, :]
    read = (cols < ln.clamp(min=0)[:, None]) & rows_on[:, None]
    high = (x >= num_rows) if num_rows is not None else torch.zeros_like(x, dtype=torch.bool)
    other_neg = x < -1
    if rule is IndexRule.MINUS1_ONLY:
        valid = x != -1
        neg_kind, high_kind = "negative_address", "out_of_range_address"
        neg_msg = "is not -1, so a MINUS1_ONLY consumer uses it as an address: out-of-bounds read"
        high_msg = f"is >= num_rows ({num_rows}); a MINUS1_ONLY consumer reads out of bounds"
    else:
        valid = (x >= 0) & ~high
        neg_kind, high_kind = "dropped_negative", "dropped_out_of_range"
        neg_msg = "is negative but not -1; an ANY_OUT_OF_RANGE_INVALID consumer silently drops it"
        high_msg = f"is >= num_rows ({num_rows}); an ANY_OUT_OF_RANGE_INVALID consumer silently drops it"

    # "meant": an entry the producer evidently meant as a key (non-negative, in range if known)
    meant = (x >= 0) & ~high
    valid = valid & read
    hole = read & ~valid & _later(meant & read)
    beyond = meant & ~read & rows_on[:, None]
    count = meant.sum(dim=1)
    nonprefix = (~meant & _later(meant)).any(dim=1)
    len_is_count = rows_on & nonprefix & (ln == count) & (count > 0)
    len_bad = rows_on & ((ln < 0) | (ln > k))

    entry: dict[tuple[int, int], list[tuple[str, int, str]]] = {}

    def add(mask: torch.Tensor, kind: str, msg: str) -> None:
        for a, b in _pairs(mask):
            entry.setdefault((a, b), []).append((kind, int(x[a, b]), msg))

    add(read & other_neg, neg_kind, neg_msg)
    add(read & high, high_kind, high_msg)
    add(hole, "interior_invalid", "is invalid but a valid entry follows inside the read range "
        "(valid entries are not a prefix)")
    add(beyond, "valid_beyond_length", "is valid but lies at or past the row's length, so the "
        "consumer never reads it")
    row: dict[int, list[tuple[str, int, str]]] = {}
    for a in _rows(len_bad):
        row.setdefault(a, []).append(("length_out_of_range", int(ln[a]),
                                      f"length {int(ln[a])} is outside [0, {k}] (row width)"))
    for a in _rows(len_is_count):
        row.setdefault(a, []).append(("length_is_count", int(ln[a]),
                                      f"length {int(ln[a])} equals the count of valid entries, but they "
                                      "do not form a prefix: the consumer reads the first "
                                      f"{int(ln[a])} columns and misses the rest"))
    findings: list[Finding] = []
    keys = sorted(set(row) | {a for a, _ in entry})
    by_row: dict[int, list[tuple[int, list]]] = {}
    for (a, b), items in entry.items():
        by_row.setdefault(a, []).append((b, items))
    for a in keys:
        for kind, val, msg in row.get(a, []):
            findings.append(Finding(kind, a, None, val, f"token {a}: {msg}"))
        for b, items in sorted(by_row.get(a, []), key=lambda z: z[0]):
            for kind, val, msg in items:
                findings.append(Finding(kind, a, b, val, f"token {a}, column {b}: value {val} {msg}"))
        if max_findings is not None and len(findings) >= max_findings:
            return findings[:max_findings]
    return findings


def find_combine_minus1(
    topk_indices: torch.Tensor,
    combined_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    compress_ratio: int,
    topk: int,
    M: int,  # noqa: N803
    N: int,  # noqa: N803
) -> list[Finding]:
    """Detect the common combine's ``-1 -> M*r - 1`` divergence (datapath 4.5, H10).

    Given the top-k input and the combined output of a ``combine_topk_swa_indices`` call (same
    ``query_start_loc`` / ``seq_lens`` / ``compress_ratio`` / ``topk`` / ``M`` / ``N``), reports
    for every token ``t`` of chunk request ``r`` and column ``k < topk_len = min((p+1)//ratio,
    topk)``: ``combine_minus1`` where ``topk[t, k] == -1`` and ``r >= 1`` and the output holds
    ``M*r - 1`` (a valid row of request ``r-1``); ``combine_foreign_row`` where the output lies
    outside ``[M*r, M*r + N)`` and is not ``-1`` (any other cross-request address). The ROCm form
    writes ``-1`` there and yields no findings.
    """
    fn = "find_combine_minus1"
    topk_i = as_index(fn, "topk_indices", topk_indices, rank=(2, 3))
    topk_i = topk_i.reshape(topk_i.shape[0], -1)
    out = as_index(fn, "combined_indices", combined_indices, rank=2)
    t = topk_i.shape[0]
    if out.shape[0] != t:
        fail(fn, "combined_indices", f"must have one row per top-k row ({t})", f"shape {tuple(out.shape)}")
    sl = as_index(fn, "seq_lens", seq_lens, rank=1)
    qsl = as_index(fn, "query_start_loc", query_start_loc, rank=1, min_len=sl.shape[0] + 1)
    r_ = check_int(fn, "compress_ratio", compress_ratio, minimum=1)
    kk = check_int(fn, "topk", topk, minimum=0)
    m = check_int(fn, "M", M, minimum=0)
    n = check_int(fn, "N", N, minimum=0)
    findings: list[Finding] = []
    base = int(qsl[0])
    for r in range(sl.shape[0]):
        qs, qe = int(qsl[r]) - base, int(qsl[r + 1]) - base
        if qe > t or qs < 0:
            fail(fn, "query_start_loc", f"must stay within the {t} rows", f"request {r}: [{qs}, {qe})")
        for i, tok in enumerate(range(qs, qe)):
            p = int(sl[r]) - (qe - qs) + i
            tl = min((p + 1) // r_, kk)
            tl = min(tl, topk_i.shape[1], out.shape[1])
            for c in range(tl):
                src, got = int(topk_i[tok, c]), int(out[tok, c])
                if src == -1 and r >= 1 and got == m * r - 1:
                    findings.append(Finding(
                        "combine_minus1", tok, c, got,
                        f"token {tok}, column {c}: top-k -1 of request {r} became {got} = M*r - 1, "
                        f"the last workspace row of request {r - 1} (common combine has no validity check)"))
                elif got != -1 and not (m * r <= got < m * r + n):
                    findings.append(Finding(
                        "combine_foreign_row", tok, c, got,
                        f"token {tok}, column {c}: {got} is outside request {r}'s compressed rows "
                        f"[{m * r}, {m * r + n}) (top-k value {src})"))
    return findings


def validate_local_topk(
    topk_indices: torch.Tensor,
    token_to_req_indices: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    block_size: int | None = None,
    *,
    positions: torch.Tensor | None = None,
    compress_ratio: int | None = None,
    is_valid_token: torch.Tensor | None = None,
    max_findings: int | None = None,
) -> list[Finding]:
    """Findings for a request-local top-k table (indexer output, datapath 4.1, 4.2, H10/H11).

    topk_indices ``[T, K]``. Reports ``interior_invalid`` (an empty entry before a valid one: the
    count computed by ``compute_global_topk_indices_and_lens`` is then not a prefix length),
    ``other_negative``, ``duplicate_entry``; with ``positions`` ``[T]`` and ``compress_ratio`` also
    ``not_visible`` and ``prefill_len_mismatch``. Rows with ``is_valid_token`` False are skipped.
    If ``token_to_req_indices``, ``block_table`` and ``block_size`` are given, a block table
    narrower than a valid entry needs raises InputError (production reads past the row).
    """
    fn = "validate_local_topk"
    x = as_index(fn, "topk_indices", topk_indices, rank=2)
    t, k = x.shape
    rows_on = torch.ones(t, dtype=torch.bool, device=x.device)
    if is_valid_token is not None:
        rows_on = as_flags(fn, "is_valid_token", is_valid_token, min_len=t)[:t]
    if block_table is not None or token_to_req_indices is not None or block_size is not None:
        if block_table is None or token_to_req_indices is None or block_size is None:
            fail(fn, "block_table", "token_to_req_indices and block_size must be given together")
        req = as_index(fn, "token_to_req_indices", token_to_req_indices, rank=1, min_len=t)[:t]
        bt = as_index(fn, "block_table", block_table, rank=2)
        bs = check_int(fn, "block_size", block_size, minimum=1)
        lookup_slots(fn, x, req, bt, bs, (x >= 0) & rows_on[:, None], local_arg="topk_indices value")
    valid = (x >= 0) & rows_on[:, None]
    empty = (x < 0) & rows_on[:, None]
    later = _later(valid)
    findings: list[tuple[int, int, Finding]] = []

    def add(mask: torch.Tensor, kind: str, msg: str) -> None:
        for a, b in _pairs(mask):
            v = int(x[a, b])
            findings.append((a, b, Finding(kind, a, b, v, f"token {a}, column {b}: value {v} {msg}")))

    add(empty & later, "interior_invalid", "is empty but a valid entry follows (valid entries are "
        "not a prefix; a count-based length cuts the row short)")
    add((x < -1) & rows_on[:, None], "other_negative", "is negative but not -1 (vLLM treats it as "
        "empty; a MINUS1_ONLY consumer would not)")
    if k > 1:
        srt, order = torch.sort(torch.where(valid, x, torch.full_like(x, -1)), dim=1, stable=True)
        dup_sorted = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        dup = torch.zeros_like(valid)
        dup.scatter_(1, order[:, 1:], dup_sorted)
        add(dup, "duplicate_entry", "repeats an earlier entry of the row (attended twice)")
    if positions is not None or compress_ratio is not None:
        if positions is None or compress_ratio is None:
            fail(fn, "positions", "and compress_ratio must be given together")
        pos = as_index(fn, "positions", positions, rank=1, min_len=t)[:t]
        r = check_int(fn, "compress_ratio", compress_ratio, minimum=1)
        vis = torch.div(pos + 1, r, rounding_mode="floor")
        add(valid & (x >= vis[:, None]), "not_visible", "is >= (p+1)//ratio: that compressed entry "
            "does not exist yet at this position")
        want = torch.minimum(vis.clamp(min=0), torch.full_like(vis, k))
        count = valid.sum(dim=1)
        for a in _rows(rows_on & (count != want)):
            findings.append((a, -1, Finding(
                "prefill_len_mismatch", a, None, int(count[a]),
                f"token {a}: {int(count[a])} valid entries, but the prefill combine assumes "
                f"min((p+1)//ratio, K) = {int(want[a])}")))
    findings.sort(key=lambda z: (z[0], z[1]))
    out = [f for _, _, f in findings]
    return out if max_findings is None else out[:max_findings]
