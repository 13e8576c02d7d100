"""Shrink a failing case while the same output still fails by the same rule.

``shrink(still_fails, case) -> (case, steps)``: greedy reduction of the canonical inputs of a
``decode``, ``prefill`` or ``swa_write`` case (other stages are returned unchanged). A candidate
is kept when ``still_fails(candidate)`` is true -- the caller's test: same verdict ``fail``,
same output and rule (``judge.Signature``), and, for a contract reproducer, still passing under
the kernel's declared policies, so the reduced case shows the same finding and nothing else.

Dimensions reduced, in order (each by halves, then one at a time when few are left):

* query tokens / written rows (``T`` / ``N``: every per-token tensor sliced alike);
* heads (``H``: ``q`` and ``sink``);
* the compressed segment (dropped), the sink (dropped), positions and the RoPE table (dropped
  or cut to one row at position 0);
* top-k columns of each index table (a prefix kept, lengths clamped), then single columns;
* pages and page size: the cache rows the indices reach (or the slots written) are re-laid into
  a cache of as few entries as possible, page size 1 tried first (indices / slot mapping
  remapped, other cache bytes zero); for ``prefill`` the workspace rows likewise;
* ``rope``: rows of ``x`` (with their positions), the cos/sin table cut to the rows used;
* values: ``q`` zeroed, or kept on one 64-dim tile; cache records kept on one FP8 tile (the other
  tiles' codes and the RoPE bytes zero); written rows kept on one tile (the rest zero).

``size(case)``: the figures reported before and after (shapes of the tensor inputs, their
bytes, their non-zero elements).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from dsv4_numerics.reference.caches import model1
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.constants import DATA_ROW_BYTES, HEAD_DIM, N_TILES, NOPE_DIM, RECORD_BYTES, TILE

MAX_TRIALS = 400  # judge calls one shrink may make (each candidate is one kernel call + one reference)

Inputs = dict[str, Any]

# per-token tensors of the attention stages (dim 0 = query token)
_TOKEN_KEYS = ("q", "positions", "swa_indices", "swa_lens", "extra_indices", "extra_lens", "indices", "topk_length")
_SEGMENTS = (("swa_cache", "swa_block_size", "swa_indices", "swa_lens"),
             ("extra_cache", "extra_block_size", "extra_indices", "extra_lens"))


def size(case: Case) -> dict[str, Any]:
    """``{"shapes": {input: [dims]}, "bytes": total tensor bytes, "nonzero": non-zero elements}``."""
    shapes, nbytes, nonzero = {}, 0, 0
    for k, v in case.inputs.items():
        if isinstance(v, torch.Tensor):
            shapes[k] = list(v.shape)
            nbytes += v.numel() * v.element_size()
            nonzero += int(torch.count_nonzero(v.view(torch.uint8) if v.dtype == torch.bool else v))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            shapes[k] = v
    return {"shapes": shapes, "bytes": nbytes, "nonzero": nonzero}


def size_line(s: dict) -> str:
    dims = " ".join(f"{k}={'x'.join(map(str, v)) if isinstance(v, list) else v}" for k, v in s["shapes"].items())
    return f"{dims}; {s['bytes']} bytes of tensors, {s['nonzero']} non-zero elements"


# --------------------------------------------------------------------------- subset helpers


def _subsets(n: int) -> Iterator[list[int]]:
    """Index subsets of ``range(n)`` to try: halves, then each single index (when ``n <= 16``)."""
    if n <= 1:
        return
    half = n // 2
    yield list(range(half))
    yield list(range(half, n))
    if n <= 16:
        for i in range(n):
            yield [i]


def _take(inp: Inputs, keys: tuple[str, ...], keep: list[int], dim: int = 0) -> Inputs:
    out = dict(inp)
    idx = torch.tensor(keep, dtype=torch.int64)
    for k in keys:
        v = out.get(k)
        if isinstance(v, torch.Tensor) and v.dim() > dim:
            out[k] = v.index_select(dim, idx.to(v.device)).contiguous()
    return out


# --------------------------------------------------------------------------- attention stages


def _tokens(inp: Inputs) -> Iterator[Inputs]:
    for keep in _subsets(inp["q"].shape[0]):
        yield _take(inp, _TOKEN_KEYS, keep)


def _heads(inp: Inputs) -> Iterator[Inputs]:
    for keep in _subsets(inp["q"].shape[1]):
        out = _take(inp, ("q",), keep, dim=1)
        if isinstance(inp.get("sink"), torch.Tensor):
            out = _take(out, ("sink",), keep)
        yield out


def _drops(inp: Inputs) -> Iterator[Inputs]:
    if "extra_cache" in inp:
        yield {k: v for k, v in inp.items() if not k.startswith("extra_")}
    if inp.get("sink") is not None:
        yield {k: v for k, v in inp.items() if k != "sink"}
    if "cos_sin" in inp or "positions" in inp:
        yield {k: v for k, v in inp.items() if k not in ("cos_sin", "positions")}
    if isinstance(inp.get("cos_sin"), torch.Tensor) and inp["cos_sin"].shape[0] > 1 and "positions" in inp:
        yield dict(inp, cos_sin=inp["cos_sin"][:1].contiguous(), positions=torch.zeros_like(inp["positions"]))


def _columns(inp: Inputs) -> Iterator[Inputs]:
    tables = [(i, l) for _, _, i, l in _SEGMENTS if i in inp] + ([("indices", "topk_length")] if "indices" in inp else [])
    for ik, lk in tables:
        idx = inp[ik]
        k = idx.shape[1]
        lens = inp.get(lk)
        for n in ([k // 2] if k > 1 else []) + ([1] if k > 2 else []):
            out = dict(inp)
            out[ik] = idx[:, :n].contiguous()
            if isinstance(lens, torch.Tensor):
                out[lk] = lens.clamp(max=n)
            yield out
        if 1 < k <= 16:
            for c in range(k):
                out = dict(inp)
                out[ik] = idx[:, c:c + 1].contiguous()
                if isinstance(lens, torch.Tensor):
                    out[lk] = (lens > c).to(lens.dtype)
                yield out


def _remap(idx: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(used slots, remapped indices)``: every value in ``[0, num_slots)`` renumbered densely
    in increasing order; negative values kept; values past the pool shifted to stay past it."""
    flat = idx.to(torch.int64)
    live = (flat >= 0) & (flat < num_slots)
    used = torch.unique(flat[live])
    new = flat.clone()
    if used.numel():
        new[live] = torch.searchsorted(used, flat[live])
    over = flat >= num_slots
    new[over] = flat[over] - num_slots + used.numel()
    return used, new.to(idx.dtype)


def _relayout(cache: torch.Tensor, bs: int, slots: torch.Tensor, new_bs: int) -> torch.Tensor:
    """A cache of block size ``new_bs`` (page stride ``new_bs * 584``) whose slot ``i`` holds the
    record of ``slots[i]`` of ``cache`` (every other byte zero)."""
    n = max(1, slots.numel())
    nb = -(-n // new_bs)
    out = model1.empty_cache(nb, new_bs, page_stride=new_bs * RECORD_BYTES)
    if slots.numel():
        src = _records(cache, bs, slots)
        _put_records(out, new_bs, torch.arange(slots.numel()), src)
    return out


def _records(cache: torch.Tensor, bs: int, slots: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, 584]``: data row (576) + scale row (8) of each slot."""
    p = cache.stride(0)
    flat = torch.as_strided(cache, (cache.shape[0] * p,), (1,), cache.storage_offset())
    data, scale = model1.slot_addresses(slots.to(torch.int64), bs, p)
    d = flat[data.unsqueeze(1) + torch.arange(DATA_ROW_BYTES)]
    s = flat[scale.unsqueeze(1) + torch.arange(RECORD_BYTES - DATA_ROW_BYTES)]
    return torch.cat([d, s], dim=1)


def _put_records(cache: torch.Tensor, bs: int, slots: torch.Tensor, recs: torch.Tensor) -> None:
    p = cache.stride(0)
    flat = torch.as_strided(cache, (cache.shape[0] * p,), (1,), cache.storage_offset())
    data, scale = model1.slot_addresses(slots.to(torch.int64), bs, p)
    flat[data.unsqueeze(1) + torch.arange(DATA_ROW_BYTES)] = recs[:, :DATA_ROW_BYTES]
    flat[scale.unsqueeze(1) + torch.arange(RECORD_BYTES - DATA_ROW_BYTES)] = recs[:, DATA_ROW_BYTES:]


def _num_slots(cache: torch.Tensor, bs: int) -> int:
    return cache.shape[0] * bs


def _pages(inp: Inputs) -> Iterator[Inputs]:
    for ck, bk, ik, _ in _SEGMENTS:
        if ck not in inp:
            continue
        cache, bs, idx = inp[ck], int(inp[bk]), inp[ik]
        used, new_idx = _remap(idx, _num_slots(cache, bs))
        for new_bs in sorted({1, min(bs, 16), bs}):
            yield dict(inp, **{ck: _relayout(cache, bs, used, new_bs), bk: new_bs, ik: new_idx})
    if "kv" in inp and "indices" in inp:
        used, new_idx = _remap(inp["indices"], inp["kv"].shape[0])
        if used.numel() < inp["kv"].shape[0]:
            kv = inp["kv"].index_select(0, used) if used.numel() else inp["kv"][:1] * 0
            yield dict(inp, kv=kv.contiguous(), indices=new_idx)


def _one_tile(x: torch.Tensor, j: int) -> torch.Tensor:
    out = torch.zeros_like(x)
    out[..., j * TILE:(j + 1) * TILE] = x[..., j * TILE:(j + 1) * TILE]
    return out


def _values_attention(inp: Inputs) -> Iterator[Inputs]:
    q = inp["q"]
    if bool(q.any()):
        yield dict(inp, q=torch.zeros_like(q))
        yield dict(inp, q=_one_tile(q, 0))
    for ck, bk, _, _ in _SEGMENTS:
        if ck not in inp:
            continue
        cache, bs = inp[ck], int(inp[bk])
        slots = torch.arange(_num_slots(cache, bs))
        recs = _records(cache, bs, slots)
        for j in range(N_TILES):
            keep = recs.clone()
            keep[:, :NOPE_DIM] = 0
            keep[:, j * TILE:(j + 1) * TILE] = recs[:, j * TILE:(j + 1) * TILE]
            keep[:, NOPE_DIM:DATA_ROW_BYTES] = 0
            if torch.equal(keep, recs):
                continue
            new = cache.clone()
            _put_records(new, bs, slots, keep)
            yield dict(inp, **{ck: new})
    if "kv" in inp and bool(inp["kv"].any()):
        for j in range(HEAD_DIM // TILE):
            yield dict(inp, kv=_one_tile(inp["kv"], j))


# --------------------------------------------------------------------------- swa_write


def _rows(inp: Inputs) -> Iterator[Inputs]:
    k, sm = inp["k"], inp["slot_mapping"]
    n = sm.shape[0]
    if k.shape[0] > n:  # padding rows past the slot mapping are never written
        yield dict(inp, k=k[:n].contiguous())
    for keep in _subsets(n):
        idx = torch.tensor(keep, dtype=torch.int64)
        yield dict(inp, k=k[:n].index_select(0, idx).contiguous(), slot_mapping=sm.index_select(0, idx).contiguous())


def _write_pages(inp: Inputs) -> Iterator[Inputs]:
    cache, bs, sm = inp["cache"], int(inp["block_size"]), inp["slot_mapping"]
    written = sm[sm >= 0].to(torch.int64)
    n = max(1, int(written.numel()))
    for new_bs in sorted({1, min(bs, 16), bs}):
        nb = -(-n // new_bs)
        new_sm = sm.clone()
        new_sm[sm >= 0] = torch.arange(written.numel(), dtype=sm.dtype)
        cand = dict(inp, cache=torch.zeros((nb, new_bs * RECORD_BYTES), dtype=torch.uint8), block_size=new_bs,
                    slot_mapping=new_sm)
        for key, value in (("num_blocks", nb), ("page_stride", new_bs * RECORD_BYTES)):
            if key in cand:  # informational copies of the geometry some cases carry
                cand[key] = value
        yield cand
    if bool(cache.any()):
        yield dict(inp, cache=torch.zeros_like(cache))


def _values_rows(inp: Inputs) -> Iterator[Inputs]:
    k = inp["k"]
    for j in range(HEAD_DIM // TILE):
        cand = _one_tile(k, j)
        if not torch.equal(cand, k):
            yield dict(inp, k=cand)


def _rope_rows(inp: Inputs) -> Iterator[Inputs]:
    for keep in _subsets(inp["x"].shape[0]):
        yield _take(inp, ("x", "positions"), keep)


def _rope_table(inp: Inputs) -> Iterator[Inputs]:
    """The cos/sin table cut to the rows the positions use (positions renumbered)."""
    pos, cs = inp.get("positions"), inp.get("cos_sin")
    if isinstance(pos, torch.Tensor) and isinstance(cs, torch.Tensor) and pos.numel():
        used, new = torch.unique(pos.to(torch.int64), return_inverse=True)
        if used.numel() < cs.shape[0] and int(used.max()) < cs.shape[0]:
            yield dict(inp, cos_sin=cs.index_select(0, used).contiguous(), positions=new.to(pos.dtype))


TRANSFORMS: dict[str, list[tuple[str, Callable[[Inputs], Iterator[Inputs]]]]] = {
    "decode": [("tokens", _tokens), ("heads", _heads), ("drop", _drops), ("columns", _columns),
               ("pages", _pages), ("values", _values_attention)],
    "prefill": [("tokens", _tokens), ("heads", _heads), ("drop", _drops), ("columns", _columns),
                ("pages", _pages), ("values", _values_attention)],
    "swa_write": [("rows", _rows), ("pages", _write_pages), ("values", _values_rows)],
    "rope": [("rows", _rope_rows), ("table", _rope_table)],
}


def same_inputs(a: Inputs, b: Inputs) -> bool:
    """Whether two input dicts hold the same keys, values and tensors (shape, dtype, bytes)."""
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.shape != y.shape \
                    or x.dtype != y.dtype or x.stride() != y.stride():
                return False
            if not torch.equal(x.contiguous().flatten().view(torch.uint8) if x.numel() else x,
                               y.contiguous().flatten().view(torch.uint8) if y.numel() else y):
                return False
        elif x != y:
            return False
    return True


def shrink(still_fails: Callable[[Case], bool], case: Case,
           max_trials: int = MAX_TRIALS) -> tuple[Case, list[str]]:
    """The smallest case reached from ``case`` by the stage's transforms (module docstring) on
    which ``still_fails`` holds, and the accepted steps (one line each)."""
    transforms = TRANSFORMS.get(case.stage)
    if not transforms:
        return case, [f"no shrinker for stage {case.stage!r}: the case is written as it is"]
    current, steps, trials, serial = case, [], 0, 0
    progress = True
    while progress and trials < max_trials:
        progress = False
        for label, fn in transforms:
            for cand_inputs in fn(dict(current.inputs)):
                if trials >= max_trials:
                    break
                if same_inputs(cand_inputs, current.inputs):
                    continue
                trials += 1
                serial += 1
                cand = Case(f"{case.name}~{serial}", case.stage, cand_inputs,
                            dict(case.params, shrunk_from=case.name))
                try:
                    ok = still_fails(cand)
                except Exception:  # noqa: BLE001 - a candidate the adapter or reference rejects
                    ok = False
                if ok:
                    steps.append(f"{label}: {size_line(size(cand))}")
                    current, progress = cand, True
                    break
    final = Case(f"{case.name}-min", case.stage, current.inputs, dict(case.params, shrunk_from=case.name))
    steps.append(f"{trials} candidate(s) judged")
    return final, steps


__all__ = ["MAX_TRIALS", "TRANSFORMS", "same_inputs", "shrink", "size", "size_line"]
