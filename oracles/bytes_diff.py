"""Bit-exact comparison of byte layouts, with every difference decoded and, where possible,
explained by a named policy (datapath 1-3, 7; spec README 3).

What is compared (the *defined* bytes, datapath 7 H5):

* MODEL1 584-byte paged cache (``diff_model1``): the 583 defined bytes (448 FP8 codes, 128 RoPE
  bf16 bytes, 7 UE8M0 scale bytes; the pad byte 7 of the scale row only with ``include_pad``) of
  every written slot. With ``initial`` (the cache before the write) every other byte -- other
  slots, page tails, and the pad bytes unless ``include_pad`` -- must be unchanged: a write
  outside the written slots ("clobber") is reported with its decoded address.
* V3.2 656-byte rows (``diff_v32_rows``), plain bf16 / per-tensor FP8 rows (``diff_plain_rows``),
  the output FP8 codes + UE8M0 exponents of the inverse-RoPE epilogue (``diff_output_fp8``),
  float rows bit for bit (``diff_values``) and index tensors (``diff_index``).

Each difference is reported with its location decoded (slot -> page/entry/byte offset, part:
``code`` dim i / tile b, ``rope`` dim, ``scale`` tile b, ``pad``), expected vs got bytes and
decoded values. Explanations:

* per MODEL1 tile, when the tile's input row is given (``source_rows``): the tile is re-encoded
  under every single-policy change of the reference's policies (``ScaleRule``, ``Fp8Flavour`` incl.
  the gfx942 224 clamp, ``NonFinite`` for non-finite tiles) and under an approximate float32
  ``log2`` exponent; if the got bytes equal one of them, that is the explanation, e.g.
  ``tile 1 (amax 0.0201): bytes match scale_rule=scale_clamp; reference used amax_clamp``;
* per MODEL1 slot: the got record equals the expected record of another slot (slot mapping
  off), or a clobbered slot holds the record of a written token (e.g. ``-1`` written to slot 0);
* per buffer: the got bytes read under another page layout (per-token interleaved records,
  page stride ignored) equal the expected records;
* for any tensor: ``match_alternatives`` names the alternative reference outputs (computed by
  the stage under other policies) that ``got`` equals bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dsv4_numerics.reference.constants import (
    DATA_ROW_BYTES,
    FNUZ_GFX942_CLAMP,
    HEAD_DIM,
    N_TILES,
    NOPE_DIM,
    OUT_GROUP,
    PAD_BYTE_INDEX,
    RECORD_BYTES,
    SCALE_FLOOR_F32,
    SCALE_ROW_BYTES,
    TILE,
    UE8M0_BIAS,
    V32_N_TILES,
    V32_NOPE_DIM,
    V32_ROW_BYTES,
    V32_TILE,
)
from dsv4_numerics.reference.caches.model1 import cache_geometry, page_bytes, slot_addresses
from dsv4_numerics.reference.errors import check_dtype, check_int, check_tensor, fail
from dsv4_numerics.reference.formats.fp8 import decode_fp8, decode_ue8m0, encode_fp8, fp8_max, pow2_f64
from dsv4_numerics.reference.policies import Fp8Flavour, Fp8Subnormals, NonFinite, ScaleRule
from dsv4_numerics.reference.formats.quant import quantize_tiles

ROPE_BYTES_OFFSET = NOPE_DIM  # data-row byte of the first RoPE bf16 (datapath 1.1)
SCALE_OFFSET = DATA_ROW_BYTES  # logical record byte of scale tile 0 (576)
DEFAULT_POLICIES = {"scale_rule": ScaleRule.AMAX_CLAMP.value, "fp8": Fp8Flavour.E4M3FN.value,
                    "nonfinite": NonFinite.FINITE.value, "fp8_clamp": None,
                    "fp8_subnormals": Fp8Subnormals.KEEP.value}


# --------------------------------------------------------------------------- report types


@dataclass
class Difference:
    """One decoded difference: ``where`` (location fields), bytes/values on both sides."""

    where: dict[str, Any]
    expected: Any
    got: Any
    expected_value: Any = None
    got_value: Any = None
    explanation: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = {"where": self.where, "expected": self.expected, "got": self.got}
        if self.expected_value is not None or self.got_value is not None:
            d["expected_value"], d["got_value"] = self.expected_value, self.got_value
        if self.explanation:
            d["explanation"] = self.explanation
        return d

    def line(self) -> str:
        w = " ".join(f"{k}={_short(v)}" for k, v in self.where.items())
        s = f"{w}: expected {_short(self.expected)} got {_short(self.got)}"
        if self.expected_value is not None or self.got_value is not None:
            s += f" (values {_short(self.expected_value)} vs {_short(self.got_value)})"
        return s + (f" -- {self.explanation}" if self.explanation else "")


def _short(v: Any, n: int = 8) -> str:
    if isinstance(v, list):
        body = ", ".join(_short(x) for x in v[:n])
        return "[" + body + (f", ... ({len(v)})" if len(v) > n else "") + "]"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


@dataclass
class BytesReport:
    """Outcome of a bit-exact comparison (module docstring)."""

    layout: str
    passed: bool
    rule: str = "bit_exact"
    message: str = ""
    compared: int = 0  # bytes (or elements) compared
    differing: int = 0  # bytes (or elements) that differ
    differing_records: int = 0  # slots / rows / tokens with a difference
    differing_tiles: int = 0  # MODEL1/V3.2 tiles or output blocks with a difference
    clobbered: int = 0  # bytes changed outside the defined bytes (with ``initial``)
    differences: list[Difference] = field(default_factory=list)
    truncated: int = 0  # differences not listed (beyond max_items)
    explanations: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout, "passed": self.passed, "rule": self.rule, "message": self.message,
                "compared": self.compared, "differing": self.differing,
                "differing_records": self.differing_records, "differing_tiles": self.differing_tiles,
                "clobbered": self.clobbered, "differences": [d.to_dict() for d in self.differences],
                "truncated": self.truncated, "explanations": list(self.explanations)}

    def summary(self, max_lines: int = 6) -> str:
        if self.passed:
            return f"{self.layout}: {self.compared} defined bytes identical"
        head = (f"{self.layout}: {self.differing} of {self.compared} differ in {self.differing_records} "
                f"records / {self.differing_tiles} tiles" + (f"; {self.clobbered} bytes clobbered outside the written slots" if self.clobbered else ""))
        if self.message:
            head += f" -- {self.message}"
        lines = [head] + [f"  explains: {e}" for e in self.explanations]
        lines += ["  " + d.line() for d in self.differences[:max_lines]]
        more = len(self.differences) - max_lines + self.truncated
        if more > 0:
            lines.append(f"  ... {more} more")
        return "\n".join(lines)


class Sink:
    """Collects differences up to ``max_items`` and counts the rest."""

    def __init__(self, max_items: int):
        self.items: list[Difference] = []
        self.max_items = max_items
        self.dropped = 0

    def add(self, d: Difference) -> None:
        if len(self.items) < self.max_items:
            self.items.append(d)
        else:
            self.dropped += 1


def fail_shape(layout: str, what: str) -> BytesReport:
    return BytesReport(layout=layout, passed=False, rule="shape", message=what)


# --------------------------------------------------------------------------- decoding helpers


def _bf16_from_bytes(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """bf16 values (float64) of little-endian byte pairs."""
    bits = (lo.to(torch.int32) | (hi.to(torch.int32) << 8))
    bits = torch.where(bits >= 2**15, bits - 2**16, bits).to(torch.int16)
    return bits.view(torch.bfloat16).to(torch.float64)


def _ordered(bits16: torch.Tensor) -> torch.Tensor:
    """Map bf16 bit patterns (int64 0..65535) to integers ordered like the values."""
    neg = bits16 >= 0x8000
    return torch.where(neg, 0x8000 - bits16, bits16)


def bf16_ulp_distance(a_bits: int, b_bits: int) -> int:
    """Number of bf16 steps between two bf16 bit patterns (0..65535), ignoring NaN semantics."""
    t = _ordered(torch.tensor([a_bits, b_bits], dtype=torch.int64))
    return abs(int(t[0]) - int(t[1]))


def _policies(p: dict | None) -> dict[str, Any]:
    out = dict(DEFAULT_POLICIES)
    p = dict(p or {})
    if "fp8_clamp" not in p and "clamp" in p:  # the kernels' spelling
        p["fp8_clamp"] = p["clamp"]
    for k in DEFAULT_POLICIES:
        if k in p and p[k] not in (None, "", "none"):
            out[k] = p[k].value if hasattr(p[k], "value") else p[k]
    if out["fp8_clamp"] is not None:
        out["fp8_clamp"] = float(out["fp8_clamp"])
    return out


# --------------------------------------------------------------------------- MODEL1 geometry


def model1_flat_bytes(cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
    """``(flat uint8 view of every page byte, page_stride)`` of a 584-byte paged cache in any
    form ``reference.caches.model1`` accepts (geometry validated there; no copy)."""
    _, _, stride = cache_geometry("model1_flat_bytes", cache, block_size)
    return page_bytes(cache, block_size).reshape(-1), stride


def model1_record_offsets(slots: torch.Tensor, block_size: int, page_stride: int,
                          layout: str = "planar") -> torch.Tensor:
    """Absolute byte offsets ``[n, 584]`` (int64) of the logical record bytes of ``slots``.

    Logical record byte ``k``: ``k < 576`` data row byte, ``576 <= k < 584`` scale row byte
    ``k - 576``. ``layout="planar"`` is DSv4 (datapath 1.3): data at ``page*P + e*576 + k``,
    scales at ``page*P + bs*576 + e*8 + b``. The other layouts exist to *explain* a kernel:
    ``"interleaved"`` (V4.1-style per-token records, ``page*P + e*584 + k``) and ``"packed"``
    (planar with the page stride ignored, ``P = bs*584``).
    """
    s = slots.to(torch.int64).reshape(-1, 1)
    page, e = s // block_size, s % block_size
    k = torch.arange(RECORD_BYTES, dtype=torch.int64, device=s.device).reshape(1, -1)
    if layout == "interleaved":
        return page * page_stride + e * RECORD_BYTES + k
    if layout == "packed":
        page_stride = block_size * RECORD_BYTES
    elif layout != "planar":
        fail("model1_record_offsets", "layout", "must be 'planar', 'interleaved' or 'packed'", layout)
    data, scale = slot_addresses(s.reshape(-1), block_size, page_stride)
    return torch.where(k < DATA_ROW_BYTES, data.reshape(-1, 1) + k, scale.reshape(-1, 1) + (k - DATA_ROW_BYTES))


def _decode_offset(off: int, block_size: int, page_stride: int) -> dict[str, Any]:
    """Location fields of an absolute byte offset in a planar MODEL1 buffer (datapath 1.2/1.3)."""
    page, o = divmod(off, page_stride)
    w: dict[str, Any] = {"page": page, "offset": off}
    if o < block_size * DATA_ROW_BYTES:
        e, b = divmod(o, DATA_ROW_BYTES)
        w.update(slot=page * block_size + e, entry=e, **_part_of_record_byte(b))
    elif o < block_size * RECORD_BYTES:
        e, b = divmod(o - block_size * DATA_ROW_BYTES, SCALE_ROW_BYTES)
        w.update(slot=page * block_size + e, entry=e, **_part_of_record_byte(DATA_ROW_BYTES + b))
    else:
        w.update(part="page_tail", tail_byte=o - block_size * RECORD_BYTES)
    return w


def _part_of_record_byte(k: int) -> dict[str, Any]:
    if k < NOPE_DIM:
        return {"part": "code", "dim": k, "tile": k // TILE}
    if k < DATA_ROW_BYTES:
        j = (k - ROPE_BYTES_OFFSET) // 2
        return {"part": "rope", "dim": NOPE_DIM + j, "byte": (k - ROPE_BYTES_OFFSET) % 2}
    b = k - DATA_ROW_BYTES
    return {"part": "pad"} if b == PAD_BYTE_INDEX else {"part": "scale", "tile": b}


# --------------------------------------------------------------------------- tile explanation


def _approx_log2_tile(x: torch.Tensor, rule: str, flavour: str, m: float) -> tuple[torch.Tensor, int]:
    """Codes/scale byte of one finite tile with the exponent from float32 ``torch.log2`` + ceil
    (the fast-math bug class of datapath 2.8 / H2) instead of the exact rule."""
    a = x.to(torch.float32).abs().max().reshape(1)
    floor = torch.tensor([SCALE_FLOOR_F32], dtype=torch.float32)
    if rule == ScaleRule.AMAX_CLAMP.value:
        r = torch.maximum(a, floor) / torch.tensor([m], dtype=torch.float32)
    else:
        r = torch.maximum(a / torch.tensor([m], dtype=torch.float32), floor)
    e = int(torch.ceil(torch.log2(r)).item())
    y = x.to(torch.float64) * pow2_f64(torch.tensor([-e]))
    return encode_fp8(y, flavour, nonfinite=NonFinite.FINITE, clamp=m), e + UE8M0_BIAS


def tile_alternatives(x: torch.Tensor, policies: dict | None) -> list[tuple[str, torch.Tensor, int]]:
    """Single-policy variants of one 64-wide tile ``x`` (bf16 values): ``(label, codes[64], scale byte)``.

    Labels read ``"scale_rule=scale_clamp"``, ``"fp8=e4m3fnuz(clamp 224)"``, ``"nonfinite=triton"``,
    ``"fp8_subnormals=flush"``, ``"approx_log2"``, and the pairs of a scale-rule change with a
    subnormal-handling change (``"scale_rule=scale_clamp, fp8_subnormals=flush"``: one producer
    may differ in both). Variants that raise for this input (e.g. FINITE on a NaN tile) are skipped.
    """
    p = _policies(policies)
    x = x.reshape(1, TILE)
    finite = bool(torch.isfinite(x.to(torch.float32)).all())
    out: list[tuple[str, torch.Tensor, int]] = []
    sub = p["fp8_subnormals"]

    def add(label: str, rule: str, flav: str, nonf: str, clamp: float | None, subn: str = sub) -> None:
        try:
            c, s = quantize_tiles(x, rule, flav, nonf, clamp, subn)
        except ValueError:
            return
        out.append((label, c.reshape(-1), int(s.reshape(-1)[0])))

    for r in ScaleRule:
        if r.value != p["scale_rule"]:
            add(f"scale_rule={r.value}", r.value, p["fp8"], p["nonfinite"], p["fp8_clamp"])
    for f in Fp8Flavour:
        if f.value != p["fp8"]:
            add(f"fp8={f.value}", p["scale_rule"], f.value, p["nonfinite"], None)
            if f is Fp8Flavour.E4M3FNUZ:
                add(f"fp8={f.value}(clamp {FNUZ_GFX942_CLAMP:g})", p["scale_rule"], f.value, p["nonfinite"], FNUZ_GFX942_CLAMP)
    if p["fp8"] == Fp8Flavour.E4M3FNUZ.value and p["fp8_clamp"] is not None:
        add("fp8_clamp=none", p["scale_rule"], p["fp8"], p["nonfinite"], None)
    for sn in Fp8Subnormals:
        if sn.value != sub:
            add(f"fp8_subnormals={sn.value}", p["scale_rule"], p["fp8"], p["nonfinite"], p["fp8_clamp"], sn.value)
            for r in ScaleRule:
                if r.value != p["scale_rule"]:
                    add(f"scale_rule={r.value}, fp8_subnormals={sn.value}", r.value, p["fp8"], p["nonfinite"],
                        p["fp8_clamp"], sn.value)
    if not finite:
        for nf in NonFinite:
            if nf.value not in (p["nonfinite"], NonFinite.FINITE.value):
                add(f"nonfinite={nf.value}", p["scale_rule"], p["fp8"], nf.value, p["fp8_clamp"])
    else:
        m = p["fp8_clamp"] if p["fp8_clamp"] is not None else fp8_max(p["fp8"])
        c, s = _approx_log2_tile(x.reshape(-1), p["scale_rule"], p["fp8"], m)
        out.append(("approx_log2 (float32 log2 then ceil)", c, s))
    return out


def explain_tile(x: torch.Tensor, got_codes: torch.Tensor, got_scale: int, policies: dict | None) -> str:
    """Name the single-policy change under which tile ``x`` encodes to the got bytes, or ''."""
    p = _policies(policies)
    amax = float(x.to(torch.float32).abs().nan_to_num(0.0).max())
    for label, codes, sbyte in tile_alternatives(x, p):
        if sbyte == got_scale and torch.equal(codes.to(got_codes.device), got_codes.reshape(-1)):
            if label.startswith("approx_log2"):
                return f"tile amax {amax:.6g}: bytes match an approximate exponent ({label}); reference computes e exactly"
            keys = [part.split("=")[0].strip() for part in label.split(",")]
            used = ", ".join(f"{k}={p.get(k)}" for k in keys)
            return f"tile amax {amax:.6g}: bytes match {label}; reference used {used}"
    return ""


# --------------------------------------------------------------------------- MODEL1 diff


def diff_model1(
    expected: torch.Tensor,
    got: torch.Tensor,
    *,
    block_size: int,
    slots: torch.Tensor,
    source_rows: torch.Tensor | None = None,
    policies: dict | None = None,
    initial: torch.Tensor | None = None,
    include_pad: bool = False,
    max_items: int = 64,
) -> BytesReport:
    """Compare two 584-byte paged caches over the defined bytes of the written ``slots``.

    expected, got, initial: uint8 caches of the same geometry (``model1_flat_bytes`` forms).
    slots: int tensor ``[N]`` of the slots written (negative entries = skipped tokens, ignored;
    a repeated slot holds the last write). source_rows: ``[N, 512]`` bf16 rows aligned with
    ``slots`` (the quantiser input, RoPE already applied) -- enables per-tile explanations under
    ``policies`` (keys ``scale_rule``, ``fp8``, ``nonfinite``, ``fp8_clamp``).
    initial: the cache before the write; every byte outside the compared ones must be unchanged.
    """
    fn = "diff_model1"
    layout = "model1_584"
    check_tensor(fn, "slots", slots)
    if slots.dtype not in (torch.int32, torch.int64) or slots.dim() != 1:
        fail(fn, "slots", "must be a 1-D int32/int64 tensor", f"{slots.dtype} {tuple(slots.shape)}")
    fe, stride = model1_flat_bytes(expected, block_size)
    if not isinstance(got, torch.Tensor):
        return fail_shape(layout, f"got a {type(got).__name__}, not a cache tensor")
    try:
        fg, stride_g = model1_flat_bytes(got, block_size)
    except ValueError as e:
        return fail_shape(layout, f"got cache has an unusable geometry: {e}")
    if fg.numel() != fe.numel() or stride_g != stride:
        return fail_shape(layout, f"got spans {fg.numel()} bytes with page stride {stride_g}; expected {fe.numel()} / {stride}")
    fe, fg = fe.cpu(), fg.cpu()
    pol = _policies(policies)
    s_all = slots.to(torch.int64).cpu()
    # last write wins: token index of the final write of each slot
    last: dict[int, int] = {}
    for t, s in enumerate(s_all.tolist()):
        if s >= 0:
            last[s] = t
    uniq = torch.tensor(sorted(last), dtype=torch.int64)
    tok_of = torch.tensor([last[s] for s in uniq.tolist()], dtype=torch.int64)
    n_slots = uniq.numel()
    offs = model1_record_offsets(uniq, block_size, stride)
    if n_slots and int(offs.max()) >= fe.numel():
        fail(fn, "slots", "must address slots inside the cache", int(uniq.max()))
    n_def = RECORD_BYTES if include_pad else RECORD_BYTES - 1
    rec_e = fe[offs] if n_slots else torch.zeros(0, RECORD_BYTES, dtype=torch.uint8)
    rec_g = fg[offs] if n_slots else torch.zeros(0, RECORD_BYTES, dtype=torch.uint8)
    neq = rec_e[:, :n_def] != rec_g[:, :n_def]
    rep = BytesReport(layout=layout, passed=True, compared=n_slots * n_def)
    rep.differing = int(neq.sum())
    sink = Sink(max_items)
    flav = pol["fp8"]
    bad_rows = neq.any(dim=1).nonzero().reshape(-1).tolist()
    rep.differing_records = len(bad_rows)
    tiles_bad = 0
    for i in bad_rows:
        slot = int(uniq[i])
        page, entry = divmod(slot, block_size)
        base = {"slot": slot, "token": int(tok_of[i]), "page": page, "entry": entry}
        # another slot's expected record?
        moved = _find_record(rec_g[i, :n_def], rec_e[:, :n_def], exclude=i)
        if moved is not None:
            why = (f"record at slot {slot} equals the one expected at slot {int(uniq[moved])} "
                   f"(token {int(tok_of[moved])}): slot mapping off by {slot - int(uniq[moved])}")
            rep.explanations.append(why)
            sink.add(Difference({**base, "part": "record"}, "", "", explanation=why))
        e_sc, g_sc = rec_e[i, SCALE_OFFSET:SCALE_OFFSET + N_TILES], rec_g[i, SCALE_OFFSET:SCALE_OFFSET + N_TILES]
        for b in range(N_TILES):
            code_bad = neq[i, b * TILE:(b + 1) * TILE].nonzero().reshape(-1)
            scale_bad = bool(neq[i, SCALE_OFFSET + b])
            if code_bad.numel() == 0 and not scale_bad:
                continue
            tiles_bad += 1
            expl = ""
            if source_rows is not None:
                x = source_rows[int(tok_of[i]), b * TILE:(b + 1) * TILE].detach().cpu()
                expl = explain_tile(x, rec_g[i, b * TILE:(b + 1) * TILE], int(g_sc[b]), pol)
            if scale_bad:
                sink.add(Difference({**base, "part": "scale", "tile": b,
                                     "offset": int(offs[i, SCALE_OFFSET + b])},
                                    int(e_sc[b]), int(g_sc[b]),
                                    f"2^{int(e_sc[b]) - UE8M0_BIAS}", f"2^{int(g_sc[b]) - UE8M0_BIAS}", expl))
            if code_bad.numel():
                dims = (code_bad + b * TILE).tolist()
                ce, cg = rec_e[i, dims], rec_g[i, dims]
                ve = (decode_fp8(ce, flav).double() * decode_ue8m0(e_sc[b:b + 1]).double()).tolist()
                vg = (decode_fp8(cg, flav).double() * decode_ue8m0(g_sc[b:b + 1]).double()).tolist()
                sink.add(Difference({**base, "part": "code", "tile": b, "dims": dims,
                                     "offset": int(offs[i, dims[0]])},
                                    [f"0x{c:02X}" for c in ce.tolist()], [f"0x{c:02X}" for c in cg.tolist()],
                                    ve, vg, "" if scale_bad else expl))
        rope_bad = neq[i, ROPE_BYTES_OFFSET:DATA_ROW_BYTES].nonzero().reshape(-1)
        if rope_bad.numel():
            js = sorted({int(k) // 2 for k in rope_bad.tolist()})
            lo = ROPE_BYTES_OFFSET + 2 * torch.tensor(js)
            be = (rec_e[i, lo].long() | (rec_e[i, lo + 1].long() << 8)).tolist()
            bg = (rec_g[i, lo].long() | (rec_g[i, lo + 1].long() << 8)).tolist()
            ve = _bf16_from_bytes(rec_e[i, lo], rec_e[i, lo + 1]).tolist()
            vg = _bf16_from_bytes(rec_g[i, lo], rec_g[i, lo + 1]).tolist()
            dist = max(bf16_ulp_distance(a, c) for a, c in zip(be, bg))
            sink.add(Difference({**base, "part": "rope", "dims": [NOPE_DIM + j for j in js],
                                 "offset": int(offs[i, int(lo[0])])},
                                [f"0x{v:04X}" for v in be], [f"0x{v:04X}" for v in bg], ve, vg,
                                "1 bf16 ulp apart: RoPE rounding (RopeArithmetic fma vs separate, H6)" if dist == 1 else ""))
        if include_pad and bool(neq[i, SCALE_OFFSET + PAD_BYTE_INDEX]):
            sink.add(Difference({**base, "part": "pad", "offset": int(offs[i, SCALE_OFFSET + PAD_BYTE_INDEX])},
                                int(rec_e[i, SCALE_OFFSET + PAD_BYTE_INDEX]), int(rec_g[i, SCALE_OFFSET + PAD_BYTE_INDEX])))
    rep.differing_tiles = tiles_bad
    # clobber check
    if initial is not None:
        fi, stride_i = model1_flat_bytes(initial, block_size)
        if fi.numel() != fe.numel() or stride_i != stride:
            fail(fn, "initial", "must have the geometry of 'expected'", f"{fi.numel()} bytes, stride {stride_i}")
        fi = fi.cpu()
        mask = torch.ones(fe.numel(), dtype=torch.bool)
        if n_slots:  # all 584 bytes of a written slot belong to its writer (pad byte included)
            mask[offs.reshape(-1)] = False
        changed = (fg != fi) & mask
        rep.clobbered = int(changed.sum())
        if rep.clobbered:
            where = changed.nonzero().reshape(-1)
            slots_hit: dict[Any, list[int]] = {}
            for off in where.tolist():
                w = _decode_offset(off, block_size, stride)
                slots_hit.setdefault(w.get("slot", ("tail", w["page"])), []).append(off)
            for key, offs_hit in slots_hit.items():
                w = _decode_offset(offs_hit[0], block_size, stride)
                expl = ""
                if isinstance(key, int):
                    r = model1_record_offsets(torch.tensor([key]), block_size, stride)[0, :n_def]
                    if int(r.max()) < fg.numel():
                        src = _find_record(fg[r], rec_e[:, :n_def])
                        if src is not None:
                            expl = f"slot {key} (not written by the reference) holds the record expected at slot {int(uniq[src])} (token {int(tok_of[src])})"
                            rep.explanations.append(expl)
                    w = {k: v for k, v in w.items() if k in ("slot", "page", "entry")}
                    w["part"] = "unwritten_slot"
                sink.add(Difference({**w, "bytes_changed": len(offs_hit)},
                                    [int(fi[o]) for o in offs_hit[:8]], [int(fg[o]) for o in offs_hit[:8]],
                                    explanation=expl or "bytes outside the written slots changed"))
    rep.passed = rep.differing == 0 and rep.clobbered == 0
    if not rep.passed and n_slots:
        for alt in ("interleaved", "packed"):
            ao = model1_record_offsets(uniq, block_size, stride, alt)
            if int(ao.max()) < fg.numel() and torch.equal(fg[ao][:, :n_def], rec_e[:, :n_def]):
                what = "per-token interleaved records (data+scales adjacent, V4.1 style)" if alt == "interleaved" else "pages packed at bs*584 bytes (page stride ignored)"
                rep.explanations.append(f"got bytes match the expected records read as {what}")
    rep.differences, rep.truncated = sink.items, sink.dropped
    if not rep.passed:
        rep.message = first_explanation(rep)
    return rep


def _find_record(rec: torch.Tensor, table: torch.Tensor, exclude: int | None = None) -> int | None:
    if table.numel() == 0:
        return None
    hit = (table == rec.reshape(1, -1)).all(dim=1)
    if exclude is not None:
        hit[exclude] = False
    idx = hit.nonzero().reshape(-1)
    return int(idx[0]) if idx.numel() else None


def first_explanation(rep: BytesReport) -> str:
    if rep.explanations:
        return rep.explanations[0]
    for d in rep.differences:
        if d.explanation:
            return d.explanation
    return ""


# --------------------------------------------------------------------------- other layouts


def diff_v32_rows(expected: torch.Tensor, got: torch.Tensor, *, max_items: int = 64) -> BytesReport:
    """Compare V3.2 656-byte rows ``[..., 656]`` (datapath 1.5): codes (4 tiles of 128), four
    little-endian fp32 scales, 64 bf16 RoPE values -- every byte is defined."""
    fn = "diff_v32_rows"
    layout = "v32_656"
    check_dtype(fn, "expected", expected, (torch.uint8,))
    check_tensor(fn, "got", got)
    if expected.shape[-1] != V32_ROW_BYTES:
        fail(fn, "expected", f"must have last dimension {V32_ROW_BYTES}", tuple(expected.shape))
    if got.dtype != torch.uint8 or tuple(got.shape) != tuple(expected.shape):
        return fail_shape(layout, f"got {got.dtype}{tuple(got.shape)}, expected uint8{tuple(expected.shape)}")
    from dsv4_numerics.reference.caches.v32 import unpack_v32_rows

    e = expected.reshape(-1, V32_ROW_BYTES).cpu()
    g = got.reshape(-1, V32_ROW_BYTES).cpu()
    neq = e != g
    rep = BytesReport(layout=layout, passed=not bool(neq.any()), compared=e.numel(), differing=int(neq.sum()))
    sink = Sink(max_items)
    ce, se, re_ = unpack_v32_rows(e)
    cg, sg, rg = unpack_v32_rows(g)
    scale_off = V32_NOPE_DIM
    rope_off = V32_NOPE_DIM + 4 * V32_N_TILES
    tiles = 0
    for i in neq.any(dim=1).nonzero().reshape(-1).tolist():
        rep.differing_records += 1
        for t in range(V32_N_TILES):
            cb = neq[i, t * V32_TILE:(t + 1) * V32_TILE].nonzero().reshape(-1)
            sb = bool(neq[i, scale_off + 4 * t:scale_off + 4 * t + 4].any())
            if cb.numel() == 0 and not sb:
                continue
            tiles += 1
            if sb:
                sink.add(Difference({"row": i, "part": "scale", "tile": t, "byte": scale_off + 4 * t},
                                    float(se[i, t]), float(sg[i, t])))
            if cb.numel():
                dims = (cb + t * V32_TILE).tolist()
                sink.add(Difference({"row": i, "part": "code", "tile": t, "dims": dims},
                                    [f"0x{c:02X}" for c in ce[i, dims].tolist()], [f"0x{c:02X}" for c in cg[i, dims].tolist()],
                                    (decode_fp8(ce[i, dims]).double() * float(se[i, t])).tolist(),
                                    (decode_fp8(cg[i, dims]).double() * float(sg[i, t])).tolist()))
        rb = neq[i, rope_off:].nonzero().reshape(-1)
        if rb.numel():
            js = sorted({int(k) // 2 for k in rb.tolist()})
            sink.add(Difference({"row": i, "part": "rope", "dims": [V32_NOPE_DIM + j for j in js]},
                                re_[i, js].double().tolist(), rg[i, js].double().tolist()))
    rep.differing_tiles = tiles
    rep.differences, rep.truncated = sink.items, sink.dropped
    return rep


def dim_part(d: int) -> dict[str, Any]:
    """Location fields of latent dim ``d`` of a 512-wide DSv4 row."""
    if d < NOPE_DIM:
        return {"dim": d, "part": "nope", "tile": d // TILE}
    return {"dim": d, "part": "rope", "pair": (d - NOPE_DIM) // 2}


def diff_values(
    expected: torch.Tensor,
    got: torch.Tensor,
    *,
    layout: str = "values",
    describe: Callable[[tuple[int, ...]], dict[str, Any]] | None = None,
    alternatives: dict[str, torch.Tensor] | None = None,
    max_items: int = 64,
) -> BytesReport:
    """Bit-for-bit comparison of two float tensors of equal dtype/shape (e.g. gathered bf16 rows).

    Each differing element is listed with its index (``describe(index)`` adds location fields;
    for 512-wide rows the default names the NoPE tile / RoPE pair), both values and bit
    patterns, and the distance in steps of the dtype. ``alternatives``: named tensors computed by
    the reference under other policies; those ``got`` equals are reported as explanations.
    """
    fn = "diff_values"
    check_tensor(fn, "expected", expected)
    check_tensor(fn, "got", got)
    if got.dtype != expected.dtype or tuple(got.shape) != tuple(expected.shape):
        return fail_shape(layout, f"got {got.dtype}{tuple(got.shape)}, expected {expected.dtype}{tuple(expected.shape)}")
    e = expected.detach().cpu().contiguous()
    g = got.detach().cpu().contiguous()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    eb = e.view(ints[e.element_size()]) if e.dtype.is_floating_point else e
    gb = g.view(ints[g.element_size()]) if g.dtype.is_floating_point else g
    neq = eb != gb
    rep = BytesReport(layout=layout, passed=not bool(neq.any()), compared=e.numel(), differing=int(neq.sum()))
    if describe is None and e.dim() >= 1 and e.shape[-1] == HEAD_DIM:
        describe = lambda idx: dim_part(idx[-1])  # noqa: E731
    sink = Sink(max_items)
    for idx in _first_differences(neq, sink):
        where = {"index": list(idx), **(describe(idx) if describe else {})}
        ev, gv = e[idx].item(), g[idx].item()
        sink.add(Difference(where, _hex(eb[idx].item(), e.element_size()), _hex(gb[idx].item(), g.element_size()), ev, gv))
    rep.differing_records = _records_with_differences(neq)
    rep.differences, rep.truncated = sink.items, sink.dropped
    if not rep.passed and alternatives:
        rep.explanations.extend(match_alternatives(got, alternatives))
        rep.message = first_explanation(rep)
    return rep


def _first_differences(neq: torch.Tensor, sink: Sink) -> list[tuple[int, ...]]:
    """The indices (row-major order) of the first ``sink.max_items`` True elements of ``neq``; the
    others are counted into ``sink.dropped`` without being visited one by one (a kernel that
    differs everywhere differs in every one of ~10^5-10^6 elements)."""
    flat = neq.reshape(-1).nonzero().reshape(-1)
    keep = flat[: max(0, sink.max_items - len(sink.items))]
    sink.dropped += flat.numel() - keep.numel()
    if neq.dim() == 0:
        return [()] * keep.numel()
    return [tuple(int(i) for i in idx) for idx in torch.stack(torch.unravel_index(keep, neq.shape), dim=1).tolist()]


def _records_with_differences(neq: torch.Tensor) -> int:
    """How many records (every index but the last) hold a differing element; a tensor of rank 0 or
    1 is one record."""
    if neq.dim() <= 1:
        return int(bool(neq.any()))
    return int(neq.reshape(-1, neq.shape[-1]).any(dim=1).sum())


def _hex(v: int, nbytes: int) -> str:
    return f"0x{v & ((1 << (8 * nbytes)) - 1):0{2 * nbytes}X}"


def diff_plain_rows(expected: torch.Tensor, got: torch.Tensor, *, fp8_scale: float | None = None,
                    max_items: int = 64) -> BytesReport:
    """Plain 512-wide rows (datapath 1.6, 2.7): bf16 rows bit for bit, or per-tensor FP8 rows
    (uint8 E4M3FN codes; ``fp8_scale`` decodes them as ``code * fp8_scale``)."""
    fn = "diff_plain_rows"
    check_tensor(fn, "expected", expected)
    if expected.dtype == torch.uint8:
        if got.dtype != torch.uint8 or tuple(got.shape) != tuple(expected.shape):
            return fail_shape("plain_fp8", f"got {got.dtype}{tuple(got.shape)}, expected uint8{tuple(expected.shape)}")
        scale = 1.0 if fp8_scale is None else float(fp8_scale)
        e, g = expected.cpu(), got.cpu()
        neq = e != g
        rep = BytesReport(layout="plain_fp8", passed=not bool(neq.any()), compared=e.numel(), differing=int(neq.sum()))
        sink = Sink(max_items)
        for idx in _first_differences(neq, sink):
            sink.add(Difference({"index": list(idx), **dim_part(idx[-1])}, f"0x{int(e[idx]):02X}", f"0x{int(g[idx]):02X}",
                                float(decode_fp8(e[idx].reshape(1))) * scale, float(decode_fp8(g[idx].reshape(1))) * scale))
        rep.differing_records = _records_with_differences(neq)
        rep.differences, rep.truncated = sink.items, sink.dropped
        return rep
    check_dtype(fn, "expected", expected, (torch.bfloat16,))
    return diff_values(expected, got, layout="plain_bf16", max_items=max_items)


def diff_output_fp8(
    expected_codes: torch.Tensor,
    got_codes: torch.Tensor,
    expected_exponents: torch.Tensor,
    got_exponents: torch.Tensor,
    *,
    heads_per_group: int,
    group: int = OUT_GROUP,
    max_items: int = 64,
) -> BytesReport:
    """Output epilogue bytes in canonical form (attention 3.3): codes ``[T, G, hpg*512]`` uint8
    E4M3FN, exponents ``[T, G, hpg*512 // group]`` int (UE8M0 byte = exponent + 127).

    Each difference names token, group, head (``g*hpg + d // 512``), head dim and 128-block."""
    fn = "diff_output_fp8"
    layout = "output_fp8"
    check_dtype(fn, "expected_codes", expected_codes, (torch.uint8,))
    check_dtype(fn, "expected_exponents", expected_exponents, (torch.int32, torch.int64))
    check_int(fn, "heads_per_group", heads_per_group, minimum=1)
    if expected_codes.dim() != 3 or expected_codes.shape[-1] != heads_per_group * HEAD_DIM:
        fail(fn, "expected_codes", f"must be [T, G, heads_per_group*512 = {heads_per_group * HEAD_DIM}]", tuple(expected_codes.shape))
    want_e = (*expected_codes.shape[:2], expected_codes.shape[2] // group)
    if tuple(expected_exponents.shape) != want_e:
        fail(fn, "expected_exponents", f"must have shape {list(want_e)}", tuple(expected_exponents.shape))
    if got_codes.dtype != torch.uint8 or tuple(got_codes.shape) != tuple(expected_codes.shape):
        return fail_shape(layout, f"got codes {got_codes.dtype}{tuple(got_codes.shape)}, expected uint8{tuple(expected_codes.shape)}")
    if tuple(got_exponents.shape) != want_e or got_exponents.dtype.is_floating_point:
        return fail_shape(layout, f"got exponents {got_exponents.dtype}{tuple(got_exponents.shape)}, expected int{list(want_e)}")
    ec, gc = expected_codes.cpu(), got_codes.cpu()
    ee, ge = expected_exponents.cpu().to(torch.int64), got_exponents.cpu().to(torch.int64)
    code_neq = ec != gc
    exp_neq = ee != ge
    rep = BytesReport(layout=layout, passed=not (bool(code_neq.any()) or bool(exp_neq.any())),
                      compared=ec.numel() + ee.numel(), differing=int(code_neq.sum()) + int(exp_neq.sum()))
    blk_bad = code_neq.reshape(*want_e, group).any(-1) | exp_neq
    rep.differing_tiles = int(blk_bad.sum())
    rep.differing_records = int(blk_bad.any(-1).any(-1).sum())
    sink = Sink(max_items)
    for t, g, k in blk_bad.nonzero().tolist():
        d0 = k * group
        head, hd = g * heads_per_group + d0 // HEAD_DIM, d0 % HEAD_DIM
        base = {"token": t, "group": g, "head": head, "block": hd // group, "dims": f"{hd}..{hd + group - 1}"}
        if bool(exp_neq[t, g, k]):
            sink.add(Difference({**base, "part": "scale"}, int(ee[t, g, k]) + UE8M0_BIAS, int(ge[t, g, k]) + UE8M0_BIAS,
                                f"2^{int(ee[t, g, k])}", f"2^{int(ge[t, g, k])}"))
        bad = code_neq[t, g, d0:d0 + group].nonzero().reshape(-1)
        if bad.numel():
            ds = (bad + d0).tolist()
            sink.add(Difference({**base, "part": "code", "n": len(ds), "first_dim": ds[0] % HEAD_DIM},
                                [f"0x{c:02X}" for c in ec[t, g, ds].tolist()], [f"0x{c:02X}" for c in gc[t, g, ds].tolist()],
                                (decode_fp8(ec[t, g, ds]).double() * math.ldexp(1.0, int(ee[t, g, k]))).tolist(),
                                (decode_fp8(gc[t, g, ds]).double() * math.ldexp(1.0, int(ge[t, g, k]))).tolist()))
    rep.differences, rep.truncated = sink.items, sink.dropped
    return rep


def diff_index(expected: torch.Tensor, got: torch.Tensor, *, name: str = "indices",
               alternatives: dict[str, torch.Tensor] | None = None, max_items: int = 64) -> BytesReport:
    """Exact comparison of integer index tensors (values compared as int64; int32 and int64
    results with equal values are equal). Differences are listed per ``(token, column)`` (or per
    token for 1-D lengths) with expected and got values."""
    fn = "diff_index"
    check_tensor(fn, "expected", expected)
    if expected.dtype.is_floating_point or expected.dtype == torch.bool:
        fail(fn, "expected", "must be an integer tensor", str(expected.dtype))
    layout = f"index:{name}"
    if not isinstance(got, torch.Tensor) or got.dtype.is_floating_point or tuple(got.shape) != tuple(expected.shape):
        desc = f"{got.dtype}{tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
        return fail_shape(layout, f"{name}: got {desc}, expected int{tuple(expected.shape)}")
    e = expected.detach().cpu().to(torch.int64)
    g = got.detach().cpu().to(torch.int64)
    neq = e != g
    rep = BytesReport(layout=layout, passed=not bool(neq.any()), compared=e.numel(), differing=int(neq.sum()))
    sink = Sink(max_items)
    for idx in _first_differences(neq, sink):
        where = {"token": idx[0]} if len(idx) == 1 else {"token": idx[0], "column": idx[1]} if len(idx) == 2 else {"index": list(idx)}
        sink.add(Difference(where, int(e[idx]), int(g[idx])))
    # records: the tokens (first index) with a differing entry; a rank-0 tensor is one token
    rep.differing_records = (int(bool(neq.any())) if neq.dim() == 0 else
                             int(neq.reshape(neq.shape[0], -1).any(dim=1).sum()) if neq.numel() else 0)
    rep.differences, rep.truncated = sink.items, sink.dropped
    if not rep.passed:
        bad_e = e[neq]
        bad_g = g[neq]
        if bool((bad_e == -1).all()) and bad_g.unique().numel() == 1:
            rep.explanations.append(f"every differing entry should be the -1 sentinel; got {int(bad_g[0])} instead")
        elif bool((bad_g == -1).all()):
            rep.explanations.append("got -1 (empty) where the reference has a valid entry")
        if alternatives:
            rep.explanations.extend(match_alternatives(got, alternatives))
        rep.message = first_explanation(rep)
    return rep


def match_alternatives(got: torch.Tensor, alternatives: dict[str, torch.Tensor],
                       mask: torch.Tensor | None = None) -> list[str]:
    """Names of the alternative reference outputs that ``got`` equals bit for bit (on ``mask``)."""
    hits = []
    g = got.detach().cpu()
    for name, alt in alternatives.items():
        a = alt.detach().cpu()
        if a.shape != g.shape or a.dtype != g.dtype:
            continue
        if g.dtype.is_floating_point:
            ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
            eq = g.contiguous().view(ints[g.element_size()]) == a.contiguous().view(ints[a.element_size()])
        else:
            eq = g == a
        if mask is not None:
            eq = eq | ~mask.cpu()
        if bool(eq.all()):
            hits.append(f"got matches the reference under {name}")
    return hits


__all__ = [
    "BytesReport", "Difference", "bf16_ulp_distance", "diff_index", "diff_model1", "diff_output_fp8",
    "diff_plain_rows", "diff_v32_rows", "diff_values", "explain_tile", "match_alternatives",
    "model1_flat_bytes", "model1_record_offsets", "tile_alternatives",
]
