"""Tell which paged layout a KV-cache dump was written in: V4 584-byte MODEL1 pages, or a V4.1
528-byte MXFP8 / 288-byte NVFP4 cache in the interleaved (vLLM 0.33.0, vendored FlashMLA) or
page-footer (FlashInfer 0.7.2) byte order (datapath 1.6, hazard H13), and say why.

Each candidate predicts where every written slot's scale bytes are. Read there, a candidate is
*plausible* for a slot when the bytes could have come from a finite-input producer:

- UE8M0 scales (MODEL1 tiles of 64, MXFP8 groups of 32): every byte in [105, 247] (the range of
  both scale rules, datapath 2.0), and each group consistent with its codes: the largest
  ``|code|`` is at least 224 (``e = ceil(log2(amax / 448))`` puts ``amax / 2**e`` in (224, 448], which
  rounds to a code >= 224) unless
  the byte is a floor exponent (105 vLLM, 114 FlashInfer); MODEL1's pad byte is 0.
- E4M3 scales (NVFP4 groups of 16): every byte a positive finite E4M3 in [0x01, 0x7E], and the
  group's largest E2M1 magnitude 4 or 6 (``amax / s`` lies in [5.6, 6.4] for a normal scale),
  unless the scale is a subnormal (<= 0x07) or clamped at 448 (0x7E).

A dump carries no list of the slots that were written, and a pool reused by a server holds stale
bytes in every slot, so "not all zero" cannot tell written slots from the rest (the reference's
own NVFP4 write case fills 78 of its 128 slots with stale bytes). Plausibility is the evidence
instead: stale or random bytes almost never pass (16 to 32 scale bytes each in range, and the
code maxima), a written record always does under its own layout. The verdict is the candidate
with the most plausible slots, if it clearly dominates every other candidate that finds any:

- the other byte order of the same record: slot by slot, at least :data:`MIN_EVIDENCE` slots are
  plausible only under the winner, and more than ``windows`` times the slots plausible only
  under the other (``windows``: how many scale windows of one order one record of the other
  holds, ``ceil(R / S) + 1``: 10 for NVFP4, 34 for MXFP8) -- a wrong reading finds written bytes
  plausible where its scale windows fall on the writer's scale bytes (8 of every 64 NVFP4 slots
  line up) or on a constant row's codes, at most that many per written record;
- another record size (its slot ``e`` of page ``p`` is other bytes): more than ``windows`` times
  the other's plausible slots, and at least :data:`MIN_EVIDENCE`.

Otherwise the verdict names the two candidates, the counts, and what would settle it. With one
entry per page both V4.1 byte orders put the bytes in the same place and the verdict says the
order cannot be told. On 1 500 random dumps (both orders, both records and MODEL1, page sizes
1-64 with odd ones, 1 to all slots written, zero or stale fill, realistic, tiny, tie and constant
rows) no verdict named a wrong layout; 36% were left undetermined, mostly one entry per page,
three or fewer written slots, or constant rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4_numerics.reference.caches import model1 as cache_model1

from dsv4_numerics.reference.caches import v41 as cache_v41
from dsv4_numerics.reference.constants import (
    AMAX_CLAMP_SCALE_BYTE_RANGE,
    N_TILES,
    NOPE_DIM,
    RECORD_BYTES,
    SCALE_CLAMP_SCALE_BYTE_RANGE,
    TILE,
    V41_MXFP8_DATA_BYTES,
    V41_MXFP8_RECORD_BYTES,
    V41_NVFP4_DATA_BYTES,
    V41_NVFP4_RECORD_BYTES,
)
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.formats.fp4 import unpack_e2m1
from dsv4_numerics.reference.formats.fp8 import decode_fp8
from dsv4_numerics.reference.policies import V41Layout, V41Record

__all__ = ["CANDIDATES", "LayoutScore", "LayoutVerdict", "detect_layout", "format_verdict"]

_FN = "detect_layout"
# name -> (record bytes, V41Record or None for MODEL1, V41Layout or None)
CANDIDATES = {
    "model1_584": (RECORD_BYTES, None, None),
    **{f"v41_{r.value}_{lay.value}": (cache_v41.record_bytes(r), r, lay) for r in V41Record for lay in V41Layout},
}
_FLOORS = (AMAX_CLAMP_SCALE_BYTE_RANGE[0], SCALE_CLAMP_SCALE_BYTE_RANGE[0])
_HALF_E4M3_MAX = 224.0
_NVFP4_SUBNORMAL_MAX, _NVFP4_CLAMP_BYTE, _E2M1_CODE_4 = 0x07, 0x7E, 6
MIN_EVIDENCE = 4  # slots only the winner explains (module docstring)
_SCALE_BYTES = {None: N_TILES + 1,  # MODEL1: 7 UE8M0 + the pad byte
                V41Record.MXFP8: V41_MXFP8_RECORD_BYTES - V41_MXFP8_DATA_BYTES,
                V41Record.NVFP4: V41_NVFP4_RECORD_BYTES - V41_NVFP4_DATA_BYTES}


def windows(reading: str, writer: str) -> int:
    """At most how many of ``reading``'s scale windows one record of ``writer`` holds: its record
    bytes over the reading's scale bytes, plus one straddling window. A wrong reading can find
    that many plausible slots in one written record (a constant row's codes read as scales)."""
    rb, record, _ = CANDIDATES[reading]
    scale_bytes = _SCALE_BYTES[record]
    return -(-CANDIDATES[writer][0] // scale_bytes) + 1


@dataclass
class LayoutScore:
    name: str
    record_bytes: int
    written: int  # slots whose candidate record is not all zero (stale bytes count: no written-slot list)
    plausible: int  # of those, slots whose scale bytes pass the candidate's tests
    where: str  # where the candidate reads the scale bytes

    @property
    def fraction(self) -> float:
        return self.plausible / self.written if self.written else 0.0


@dataclass
class LayoutVerdict:
    best: str | None
    reason: str
    scores: list[LayoutScore] = field(default_factory=list)


def _ue8m0_plausible(codes: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    lo, hi = AMAX_CLAMP_SCALE_BYTE_RANGE
    sb = scales.to(torch.int64)
    in_range = (sb >= lo) & (sb <= hi)
    cmax = decode_fp8(codes).abs().reshape(codes.shape[0], -1, group).amax(dim=-1)  # NaN codes -> NaN -> False
    floor = (sb == _FLOORS[0]) | (sb == _FLOORS[1])
    return (in_range & ((cmax >= _HALF_E4M3_MAX) | floor)).all(dim=1)


def _nvfp4_plausible(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    sb = scales.to(torch.int64)
    in_range = (sb >= 0x01) & (sb <= _NVFP4_CLAMP_BYTE)
    mag = (unpack_e2m1(data) & 7).reshape(data.shape[0], scales.shape[1], -1).amax(dim=-1)
    exempt = (sb <= _NVFP4_SUBNORMAL_MAX) | (sb == _NVFP4_CLAMP_BYTE)
    return (in_range & ((mag >= _E2M1_CODE_4) | exempt)).all(dim=1)


def _pages(cache: torch.Tensor, block_size: int | None) -> tuple[torch.Tensor, int]:
    if not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8:
        raise InputError(f"{_FN}: argument 'cache' must be a uint8 torch.Tensor")
    if cache.dim() == 3:
        if block_size is not None and block_size != cache.shape[1]:
            raise InputError(f"{_FN}: argument 'block_size' {block_size} contradicts the cache shape {tuple(cache.shape)}")
        return cache.contiguous().reshape(cache.shape[0], -1), cache.shape[1]
    if cache.dim() != 2:
        raise InputError(f"{_FN}: argument 'cache' must be [num_blocks, page_stride] or [num_blocks, bs, record] (got {tuple(cache.shape)})")
    if block_size is None or isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise InputError(f"{_FN}: argument 'block_size' (--page-size) must be an int >= 1 for a 2-D dump (got {block_size!r})")
    return cache.contiguous(), block_size


def _score(pages: torch.Tensor, bs: int, name: str) -> tuple[LayoutScore, torch.Tensor] | None:
    """The candidate's score and its per-slot plausibility mask ``[num_blocks * bs]`` (bool), or
    None when a page is too short for ``bs`` of its records."""
    rb, record, layout = CANDIDATES[name]
    nb, p = pages.shape
    if p < bs * rb:
        return None
    slots = torch.arange(nb * bs)
    if record is None:
        data, scales = cache_model1.read_records(pages, slots, bs)
        written = (data != 0).any(dim=1) | (scales != 0).any(dim=1)
        ok = _ue8m0_plausible(data[:, :NOPE_DIM], scales[:, :N_TILES], TILE) & (scales[:, N_TILES] == 0)
        where = "footer at bs*576 + e*8 (7 UE8M0 + pad 0)"
    else:
        data, scales = cache_v41.read_records(pages, slots, bs, record, layout)
        written = (data != 0).any(dim=1) | (scales != 0).any(dim=1)
        d = data.shape[1]
        s = scales.shape[1]
        kind = "UE8M0" if record is V41Record.MXFP8 else "E4M3"
        where = (f"{s} {kind} at e*{rb} + {d}" if layout is V41Layout.INTERLEAVED else f"{s} {kind} at bs*{d} + e*{s}")
        ok = _ue8m0_plausible(data, scales, d // s) if record is V41Record.MXFP8 else _nvfp4_plausible(data, scales)
    ok = ok & written
    return LayoutScore(name, rb, int(written.sum()), int(ok.sum()), where), ok


def _same_record_orders(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` are the two V4.1 byte orders of one record."""
    ra, rb = CANDIDATES[a][1], CANDIDATES[b][1]
    return ra is not None and ra is rb


def detect_layout(cache: torch.Tensor, block_size: int | None = None) -> LayoutVerdict:
    """Score every candidate layout on ``cache`` (2-D ``[num_blocks, page_stride]`` with
    ``block_size``, or 3-D ``[num_blocks, bs, record_bytes]``) and name the one that clearly
    dominates (module docstring), or say what is missing to tell."""
    pages, bs = _pages(cache, block_size)
    scored = [r for name in CANDIDATES if (r := _score(pages, bs, name)) is not None]
    scores = [sc for sc, _ in scored]
    if not scored:
        sizes = ", ".join(f"{n} {rb} B" for n, (rb, _, _) in CANDIDATES.items())
        return LayoutVerdict(None, f"no candidate fits: a page of {pages.shape[1]} bytes is shorter than {bs} "
                                   f"records of every candidate ({sizes}); check --page-size and the page stride",
                             scores)
    if max(s.written for s in scores) == 0:
        return LayoutVerdict(None, "no written slot (every candidate record is all zero)", scores)
    masks = {sc.name: m for sc, m in scored}
    looks = torch.stack(list(masks.values())).any(dim=0)
    total = pages.shape[0] * bs
    if not bool(looks.any()):
        return LayoutVerdict(None, f"no written slot found: no slot of the {total} ({pages.shape[0]} pages of {bs}) "
                                   f"has plausible scale bytes under any candidate -- stale bytes only, or a page "
                                   f"size ({bs}) or page stride ({pages.shape[1]} B) that is not the writer's", scores)
    ranked = sorted(scores, key=lambda s: -s.plausible)
    b = ranked[0]
    mb = masks[b.name]
    if b.plausible < MIN_EVIDENCE:
        return LayoutVerdict(None, f"too little evidence: at most {b.plausible} slots have plausible scale bytes "
                                   f"(under {b.name}); a verdict needs at least {MIN_EVIDENCE} -- a dump with more "
                                   f"written entries per page would tell", scores)
    for o in ranked[1:]:
        if o.plausible == 0:
            continue
        if CANDIDATES[o.name][0] != CANDIDATES[b.name][0]:
            # another record: its slot e of page p is other bytes, so slots are not compared one by
            # one; the winner needs DOMINANCE x its plausible slots (a record's bytes read as a
            # smaller record's can make several of them plausible: constant FP8 rows as NVFP4)
            w = windows(b.name, o.name)
            if b.plausible < MIN_EVIDENCE or b.plausible <= w * o.plausible:
                return LayoutVerdict(None, f"undetermined between {b.name} and {o.name} (records of {b.record_bytes} "
                                           f"and {o.record_bytes} bytes): {b.plausible} and {o.plausible} slots have "
                                           f"plausible scale bytes; a verdict needs at least {MIN_EVIDENCE} and more "
                                           f"than {w}x the other's (one {o.record_bytes}-byte record can hold {w} "
                                           f"scale windows of the first) -- a dump with more written slots would tell",
                                     scores)
            continue
        mo = masks[o.name]
        only_b, only_o = int((mb & ~mo).sum()), int((mo & ~mb).sum())
        if only_b == only_o == 0:
            if bs == 1 and _same_record_orders(b.name, o.name):
                return LayoutVerdict(None, f"ambiguous: {b.name}, {o.name} equally plausible on the same {b.plausible} "
                                           f"slots (with one entry per page both V4.1 byte orders coincide: the record "
                                           f"is {CANDIDATES[b.name][0]} bytes; a dump of --page-size >= 2 tells the "
                                           f"orders apart)", scores)
            return LayoutVerdict(None, f"ambiguous: {b.name}, {o.name} equally plausible on the same {b.plausible} "
                                       f"slots: no slot tells them apart", scores)
        w = windows(b.name, o.name)
        if only_b < MIN_EVIDENCE or only_b <= w * only_o:
            return LayoutVerdict(None, f"undetermined between {b.name} and {o.name}: {only_b} slots are plausible "
                                       f"only as {b.name} ({b.where}), {only_o} only as {o.name} ({o.where}); "
                                       f"a verdict needs at least {MIN_EVIDENCE} slots that only one of them explains "
                                       f"and more than {w}x as many as the other explains alone (one record holds "
                                       f"{w} scale windows of the other order) -- a dump with more written entries "
                                       f"per page would tell", scores)
    runner = next((o for o in ranked[1:]), None)
    reason = f"{b.name}: {b.plausible} slots have plausible scale bytes ({b.where})"
    if runner is not None:
        mo = masks[runner.name]
        reason += (f"; {int((mb & ~mo).sum())} of them are implausible as the next best, {runner.name} "
                   f"({runner.where}), which alone explains {int((mo & ~mb).sum())} slots")
    stale = int(looks.numel() - looks.sum())
    if stale:
        reason += f"; the other {stale} of {total} slots look unwritten under every candidate"
    return LayoutVerdict(b.name, reason, scores)


def format_verdict(v: LayoutVerdict) -> str:
    """A short text: the verdict, then one line per candidate."""
    lines = [f"layout: {v.best or 'undetermined'} -- {v.reason}"]
    for s in v.scores:
        lines.append(f"  {s.name:<28} {s.plausible:>6}/{s.written:<6} plausible   scales {s.where}")
    return "\n".join(lines)
