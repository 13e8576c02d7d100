"""Typed views of the canonical attention-case inputs that the attention adapters share.

The ``decode`` and ``prefill`` stages' cases (``reference/cases/attention.py``) carry their
inputs in a dict; this module reads that dict once, validates it (``InputError`` naming the key
and the rule), and hands adapters a small dataclass, so that every adapter maps the *same*
canonical meaning onto its kernel (attention.md 5, "Abstract call"):

decode   ``q [T, H, 512]`` bf16; ``scale``; ``sink [H]`` fp32 or None; segment 0 (SWA) and an
         optional segment 1 (compressed), each a 584-byte paged cache (any accepted form,
         ``reference.caches.model1``) + ``block_size`` + global slot indices ``[T, K]`` (``-1`` =
         empty) + prefix lengths ``[T]`` or None; optional ``positions [T]`` (query positions,
         for epilogues that need them).
prefill  ``q [T, H, 512]`` bf16; ``kv [S, 512]`` bf16 gathered rows; one combined index table
         ``[T, K]`` into them + lengths ``[T]`` or None; ``scale``; ``sink``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from dsv4_numerics.reference.caches.model1 import cache_geometry
from dsv4_numerics.reference.constants import HEAD_DIM
from dsv4_numerics.reference.errors import INDEX_DTYPES, InputError, check_dtype, fail

# Accepted spellings of each canonical key, first match wins. The attention cases module is the
# authority; the aliases keep adapters working with the oracle's Segment vocabulary too.
_KEYS = {
    "q": ("q",),
    "scale": ("scale", "softmax_scale", "sm_scale"),
    "sink": ("sink", "attn_sink", "sinks"),
    "positions": ("positions", "position_ids"),
    "main_cache": ("swa_cache", "main_cache", "k_cache"),
    "main_block_size": ("swa_block_size", "main_block_size", "block_size"),
    "main_idx": ("swa_indices", "main_indices", "indices"),
    "main_len": ("swa_lens", "main_lens", "topk_length", "swa_length"),
    "extra_cache": ("extra_cache", "compressed_cache", "extra_k_cache"),
    "extra_block_size": ("extra_block_size", "compressed_block_size"),
    "extra_idx": ("extra_indices", "compressed_indices", "extra_indices_in_kvcache"),
    "extra_len": ("extra_lens", "compressed_lens", "extra_topk_length", "extra_length"),
    "kv": ("kv", "rows", "kv_rows", "workspace"),
    "idx": ("indices", "combined_indices", "idx"),
    "len": ("topk_length", "combined_lens", "lens", "length"),
}


def _get(inp: dict, key: str, required: bool = True) -> Any:
    for name in _KEYS[key]:
        if name in inp:
            return inp[name]
    if required:
        raise InputError(f"attention adapter: case input '{_KEYS[key][0]}' is missing "
                         f"(accepted names: {list(_KEYS[key])}; got keys {sorted(inp)})")
    return None


@dataclass(frozen=True)
class PagedSegment:
    """One segment read from a 584-byte paged cache (global slot = block * bs + offset)."""

    cache: torch.Tensor
    block_size: int
    idx: torch.Tensor  # [T, K] int32/int64
    length: torch.Tensor | None  # [T] or None (= K)

    @property
    def num_slots(self) -> int:
        nb, bs, _ = cache_geometry("PagedSegment", self.cache, self.block_size)
        return nb * bs


@dataclass(frozen=True)
class DecodeInputs:
    q: torch.Tensor  # [T, H, 512] bf16
    scale: float
    sink: torch.Tensor | None  # [H] float32
    main: PagedSegment
    extra: PagedSegment | None
    positions: torch.Tensor | None  # [T] or None


@dataclass(frozen=True)
class PrefillInputs:
    q: torch.Tensor  # [T, H, 512] bf16
    kv: torch.Tensor  # [S, 512] bf16
    idx: torch.Tensor  # [T, K]
    length: torch.Tensor | None
    scale: float
    sink: torch.Tensor | None


def _q(fn: str, q: Any) -> torch.Tensor:
    check_dtype(fn, "q", q, (torch.bfloat16,))
    if q.dim() == 4 and q.shape[1] == 1:  # [T, 1, H, D] (s_q = 1 per token) is accepted
        q = q[:, 0]
    if q.dim() != 3 or q.shape[-1] != HEAD_DIM:
        fail(fn, "q", f"must have shape [T, H, {HEAD_DIM}]", tuple(q.shape))
    return q


def _scale(fn: str, v: Any) -> float:
    if isinstance(v, torch.Tensor):
        v = float(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        fail(fn, "scale", "must be a finite number > 0", v)
    return float(v)


def _sink(fn: str, s: Any, h: int) -> torch.Tensor | None:
    if s is None:
        return None
    check_dtype(fn, "sink", s, (torch.float32, torch.float64, torch.bfloat16))
    if tuple(s.shape) != (h,):
        fail(fn, "sink", f"must have shape [H={h}]", tuple(s.shape))
    return s.to(torch.float32)


def _idx(fn: str, arg: str, idx: Any, t: int) -> torch.Tensor:
    check_dtype(fn, arg, idx, INDEX_DTYPES)
    if idx.dim() == 3 and idx.shape[1] == 1:  # [T, 1, K] (FlashMLA's h_kv / s_q axis)
        idx = idx[:, 0]
    if idx.dim() != 2 or idx.shape[0] != t:
        fail(fn, arg, f"must have shape [T={t}, K]", tuple(idx.shape))
    return idx


def _len(fn: str, arg: str, ln: Any, t: int, k: int) -> torch.Tensor | None:
    if ln is None:
        return None
    check_dtype(fn, arg, ln, INDEX_DTYPES)
    if tuple(ln.shape) != (t,):
        fail(fn, arg, f"must have shape [T={t}]", tuple(ln.shape))
    if t and (int(ln.min()) < 0 or int(ln.max()) > k):
        fail(fn, arg, f"must lie in [0, K={k}]", (int(ln.min()), int(ln.max())))
    return ln


def decode_inputs(case, fn: str = "decode adapter") -> DecodeInputs:
    inp = case.inputs
    q = _q(fn, _get(inp, "q"))
    t, h = q.shape[0], q.shape[1]
    main_idx = _idx(fn, "swa_indices", _get(inp, "main_idx"), t)
    main = PagedSegment(_get(inp, "main_cache"), int(_get(inp, "main_block_size")), main_idx,
                        _len(fn, "swa_lens", _get(inp, "main_len", False), t, main_idx.shape[1]))
    extra = None
    ec = _get(inp, "extra_cache", False)
    if ec is not None:
        eidx = _idx(fn, "extra_indices", _get(inp, "extra_idx"), t)
        extra = PagedSegment(ec, int(_get(inp, "extra_block_size")), eidx,
                             _len(fn, "extra_lens", _get(inp, "extra_len", False), t, eidx.shape[1]))
    pos = _get(inp, "positions", False)
    if pos is not None:
        check_dtype(fn, "positions", pos, INDEX_DTYPES)
        if tuple(pos.shape) != (t,):
            fail(fn, "positions", f"must have shape [T={t}]", tuple(pos.shape))
    return DecodeInputs(q, _scale(fn, _get(inp, "scale")), _sink(fn, _get(inp, "sink", False), h),
                        main, extra, pos)


def prefill_inputs(case, fn: str = "prefill adapter") -> PrefillInputs:
    inp = case.inputs
    q = _q(fn, _get(inp, "q"))
    t, h = q.shape[0], q.shape[1]
    kv = _get(inp, "kv")
    check_dtype(fn, "kv", kv, (torch.bfloat16,))
    if kv.dim() == 3 and kv.shape[1] == 1:
        kv = kv[:, 0]
    if kv.dim() != 2 or kv.shape[1] != HEAD_DIM:
        fail(fn, "kv", f"must have shape [S, {HEAD_DIM}]", tuple(kv.shape))
    idx = _idx(fn, "indices", _get(inp, "idx"), t)
    return PrefillInputs(q, kv, idx, _len(fn, "topk_length", _get(inp, "len", False), t, idx.shape[1]),
                         _scale(fn, _get(inp, "scale")), _sink(fn, _get(inp, "sink", False), h))
