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

Data bytes read as scales fail these tests with overwhelming probability (16 to 32 bytes each
in range, and the code maxima). A slot is *written* when its candidate record is not all zero
(vLLM allocates caches with zeros). The verdict is the candidate with the most plausible written
slots; with one entry per page both V4.1 byte orders put the bytes in the same place and the
verdict says the order cannot be told.
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


@dataclass
class LayoutScore:
    name: str
    record_bytes: int
    written: int  # slots whose candidate record is not all zero
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


def _score(pages: torch.Tensor, bs: int, name: str) -> LayoutScore | None:
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
    return LayoutScore(name, rb, int(written.sum()), int((ok & written).sum()), where)


def detect_layout(cache: torch.Tensor, block_size: int | None = None) -> LayoutVerdict:
    """Score every candidate layout on ``cache`` (2-D ``[num_blocks, page_stride]`` with
    ``block_size``, or 3-D ``[num_blocks, bs, record_bytes]``) and name the most plausible one."""
    pages, bs = _pages(cache, block_size)
    scores = [sc for name in CANDIDATES if (sc := _score(pages, bs, name)) is not None]
    if not scores or max(s.written for s in scores) == 0:
        return LayoutVerdict(None, "no written slot (every candidate record is all zero)", scores)
    top = max(s.fraction for s in scores)
    best = [s for s in scores if s.fraction == top]
    if top < 0.5:
        return LayoutVerdict(None, f"no layout is plausible: best {best[0].name} with {best[0].plausible}/"
                                   f"{best[0].written} written slots", scores)
    if len(best) > 1:
        names = ", ".join(s.name for s in best)
        why = " (with one entry per page both V4.1 byte orders coincide)" if bs == 1 else ""
        return LayoutVerdict(None, f"ambiguous: {names} equally plausible{why}", scores)
    b = best[0]
    rest = sorted((s for s in scores if s is not b), key=lambda s: -s.fraction)
    runner = rest[0] if rest else None
    reason = (f"{b.name}: {b.plausible}/{b.written} written slots have plausible scale bytes ({b.where})"
              + (f"; next best {runner.name}: {runner.plausible}/{runner.written} ({runner.where})" if runner else ""))
    return LayoutVerdict(b.name, reason, scores)


def format_verdict(v: LayoutVerdict) -> str:
    """A short text: the verdict, then one line per candidate."""
    lines = [f"layout: {v.best or 'undetermined'} -- {v.reason}"]
    for s in v.scores:
        lines.append(f"  {s.name:<28} {s.plausible:>6}/{s.written:<6} plausible   scales {s.where}")
    return "\n".join(lines)
