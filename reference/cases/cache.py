"""Default cases of the cache byte stages: ``swa_write``, ``compressed_write``, ``plain_write``,
``gather`` (datapath 1.1-1.3, 1.6, 2.0-2.4, 2.7, 4.5; hazards H1, H5, H12, H16, H17).

Every case is deterministic (CPU ``torch.Generator`` with a fixed seed per case), small
(N <= 256 rows, a few pages) and named after its geometry and content, e.g.
``bs64-s37440-tiny-ties`` = 64 entries per page, page stride 37 440 bytes, tiny and tie tiles.

Inputs (all CPU tensors / plain values):

swa_write, compressed_write
    ``k``             bfloat16 ``[N, 512]``: already roped rows (SWA) / bf16 pre-quantisation
                      compressed rows (compressor boundary, H7)
    ``slot_mapping``  int64 ``[N]``: distinct global slots in a permuted order, ``-1`` padding
    ``block_size``, ``num_blocks``, ``page_stride``: ints
    ``cache``         uint8 ``[num_blocks, page_stride]``: the initial bytes (deterministic stale
                      garbage: pages are recycled in vLLM, datapath 1.2)
plain_write
    ``k`` bfloat16 ``[N, 512]``, ``slot_mapping``, ``block_size``, ``num_blocks``,
    ``layout`` ("bf16" | "fp8"), ``kv_scale`` (float, 1.0 as in vLLM),
    ``cache`` bfloat16 / uint8 ``[num_blocks, block_size, 512]`` (stale garbage)
gather
    ``cache`` uint8 ``[num_blocks, page_stride]`` written by ``cache_model1.insert`` (AMAX_CLAMP)
    on top of stale garbage, ``block_table`` int32 ``[R, max_blocks]`` (permuted pages),
    ``seq_lens`` int32 ``[R]``, ``gather_lens`` int32 ``[R]`` or None, ``block_size``,
    ``num_blocks``, ``page_stride``, ``written_slots`` int64 (the slots the writer filled; every
    gathered position is among them).

Row content kinds (``params["rows"]`` counts them):
    realistic   RMSNorm(N(0,1)) * U[0.5, 1] (per-dim gain), as the SWA writer sees (datapath 2.8 set F)
    tiny        tiles with amax <= 0.02734375 incl. zero tiles (Q_A != Q_S, H1; set D amaxes)
    boundary    amax at the Q_A/Q_S boundary (+-1..2 bf16 ulps, 0.03, 0.0546875, 0.06)
    ties        amax = +-1.75 * 2**m (H16), and 448 * 2**k tiles (code 0x7E at the peak)
    zeros       +0 / -0 tiles and mixed signed zeros (H17)
    subnormal   a 448 * 2**k peak with elements m * 2**(k-9): E4M3 subnormal codes, ties to zero
    huge        amax up to the largest finite bf16 (scale byte 247)
"""

from __future__ import annotations

import torch

from ..caches.model1 import empty_cache, insert
from ..cases import Case, register_cases
from ..constants import (
    C128_BLOCK_SIZE,
    C4_BLOCK_SIZE,
    HEAD_DIM,
    N_TILES,
    NOPE_DIM,
    RECORD_BYTES,
    SWA_BLOCK_SIZE,
    TILE,
    TINY_TILE_AMAX,
    production_page_stride,
)
from ..policies import ScaleRule

__all__ = ["make_rows", "ROW_KINDS"]

ROW_KINDS = ("realistic", "tiny", "boundary", "ties", "zeros", "subnormal", "huge")

# amax values of datapath 2.8 set D (tiny / zero tiles), bf16-rounded where they are used.
_SET_D = (0.0, 1e-6, 1.0014e-4, 2.0027e-4, 1e-3, 0.02, TINY_TILE_AMAX, 0.03, 0.0546875, 0.06)
_BF16_MAX = float(torch.finfo(torch.bfloat16).max)


def _bf16(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32).to(torch.bfloat16))


def _bf16_step(v: float, k: int) -> float:
    """The bf16 value ``k`` bf16 ulps from the bf16 value ``v`` (v > 0)."""
    bits = torch.tensor(v, dtype=torch.bfloat16).view(torch.int16).item() + k
    return float(torch.tensor(bits, dtype=torch.int16).view(torch.bfloat16))


def _tile_with_amax(g: torch.Generator, amax: float) -> torch.Tensor:
    """fp32 ``[64]`` of bf16 values with ``max |x| == amax`` exactly (amax a bf16 value)."""
    if amax == 0.0:
        return torch.zeros(TILE)
    t = torch.rand(TILE, generator=g) * 2 - 1
    t = (t * amax).to(torch.bfloat16).to(torch.float32).clamp(-amax, amax)
    i = int(torch.randint(0, TILE, (1,), generator=g))
    t[i] = amax if bool(torch.randint(0, 2, (1,), generator=g)) else -amax
    return t


def _row_from_tiles(g: torch.Generator, amaxes: list[float]) -> torch.Tensor:
    nope = torch.cat([_tile_with_amax(g, a) for a in amaxes])
    rope = torch.randn(HEAD_DIM - NOPE_DIM, generator=g).to(torch.bfloat16).to(torch.float32)
    return torch.cat([nope, rope])


def _pick(g: torch.Generator, seq) -> float:
    return seq[int(torch.randint(0, len(seq), (1,), generator=g))]


def make_rows(g: torch.Generator, kinds: list[str], gain: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 ``[len(kinds), 512]``: one row per entry of ``kinds`` (``ROW_KINDS``)."""
    if gain is None:
        gain = torch.rand(HEAD_DIM, generator=g) * 0.5 + 0.5
    rows = []
    for kind in kinds:
        if kind == "realistic":
            x = torch.randn(HEAD_DIM, generator=g)
            x = x * torch.rsqrt((x * x).mean() + 1e-6) * gain
            rows.append(x)
        elif kind == "tiny":
            rows.append(_row_from_tiles(g, [_bf16(_pick(g, _SET_D[:7])) for _ in range(N_TILES)]))
        elif kind == "boundary":
            opts = [_bf16_step(TINY_TILE_AMAX, k) for k in (-2, -1, 0, 1, 2)] + [_bf16(v) for v in _SET_D[7:]]
            rows.append(_row_from_tiles(g, [_pick(g, opts) for _ in range(N_TILES)]))
        elif kind == "ties":
            ams = []
            for _ in range(N_TILES):
                if bool(torch.randint(0, 2, (1,), generator=g)):
                    ams.append(1.75 * 2.0 ** int(torch.randint(-40, 40, (1,), generator=g)))
                else:
                    ams.append(448.0 * 2.0 ** int(torch.randint(-24, 24, (1,), generator=g)))
            rows.append(_row_from_tiles(g, ams))
        elif kind == "zeros":
            nope = torch.zeros(NOPE_DIM)
            nope[TILE : 2 * TILE] = -0.0  # an all -0.0 tile
            mixed = torch.zeros(TILE)
            mixed[::2] = -0.0
            nope[2 * TILE : 3 * TILE] = mixed
            nope[3 * TILE : 4 * TILE] = _tile_with_amax(g, 1.5)
            nope[3 * TILE + 1 : 3 * TILE + 9] = torch.tensor([0.0, -0.0] * 4)
            rope = torch.randn(HEAD_DIM - NOPE_DIM, generator=g).to(torch.bfloat16).to(torch.float32)
            rope[:4] = torch.tensor([0.0, -0.0, 0.0, -0.0])
            rows.append(torch.cat([nope, rope]))
        elif kind == "subnormal":
            ams, tiles = [], []
            for _ in range(N_TILES):
                k = int(torch.randint(-12, 12, (1,), generator=g))
                q = 2.0 ** (k - 9)  # one E4M3 subnormal step at scale 2**k
                t = torch.zeros(TILE)
                t[0] = 448.0 * 2.0**k
                # m * 2**-9 for m = 1..7 (exact subnormal codes), the ties 0.5 and 2.5 steps (-> 0 and
                # 2), just above half a step (-> 1), and negatives of them (signed results)
                vals = [m * q for m in range(1, 8)] + [0.5 * q, 2.5 * q, 0.5 * q * (1 + 2.0**-7)]
                vals = vals + [-v for v in vals]
                t[1 : 1 + len(vals)] = torch.tensor(vals)
                tiles.append(t)
                ams.append(t[0].item())
            rope = torch.randn(HEAD_DIM - NOPE_DIM, generator=g).to(torch.bfloat16).to(torch.float32)
            rows.append(torch.cat(tiles + [rope]))
        elif kind == "huge":
            opts = [_BF16_MAX, _bf16(3e38), _bf16(1e30), _bf16_step(_BF16_MAX, -1)]
            rows.append(_row_from_tiles(g, [_pick(g, opts) for _ in range(N_TILES)]))
        else:
            raise KeyError(f"make_rows: unknown row kind {kind!r} (known: {ROW_KINDS})")
    out = torch.stack(rows)
    bf = out.to(torch.bfloat16)
    # constructed rows hold bf16 values by design (their amaxes are exact); realistic rows are rounded
    constructed = torch.tensor([k != "realistic" for k in kinds])
    if not torch.equal(bf[constructed].to(torch.float32), out[constructed]):
        raise AssertionError("make_rows: a constructed row is not bf16-exact (its amax would move)")
    return bf


def slot_kinds(spec: dict[str, int]) -> list[str]:
    return [k for k, n in spec.items() for _ in range(n)]


def shuffled(g: torch.Generator, x: list) -> list:
    perm = torch.randperm(len(x), generator=g).tolist()
    return [x[i] for i in perm]


def slots_with_padding(g: torch.Generator, capacity: int, n: int, n_pad: int) -> torch.Tensor:
    """``n`` distinct slots from a permutation of ``[0, capacity)`` with ``n_pad`` -1 entries mixed in."""
    slots = torch.randperm(capacity, generator=g)[:n].tolist()
    for _ in range(n_pad):
        slots.insert(int(torch.randint(0, len(slots) + 1, (1,), generator=g)), -1)
    return torch.tensor(slots, dtype=torch.int64)


def garbage_bytes(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=g, dtype=torch.int64).to(torch.uint8)


def _write_case(stage: str, name: str, seed: int, bs: int, stride: int, nb: int,
                rows: dict[str, int], n_pad: int, slots: list[int] | None = None,
                note: str = "") -> Case:
    g = torch.Generator().manual_seed(seed)
    kinds = shuffled(g, slot_kinds(rows))
    k = make_rows(g, kinds)
    n = k.shape[0]
    if slots is None:
        slot_mapping = slots_with_padding(g, nb * bs, n, n_pad)
    else:
        slot_mapping = torch.tensor(slots, dtype=torch.int64)
    # rows of k line up with slot_mapping entries (the -1 entries get rows too, never written)
    n_map = slot_mapping.shape[0]
    if n_map > n:
        k = torch.cat([k, make_rows(g, ["realistic"] * (n_map - n))])
    cache = garbage_bytes(g, (nb, stride))
    params = {
        "seed": seed, "block_size": bs, "page_stride": stride, "num_blocks": nb,
        "n_tokens": int(slot_mapping.shape[0]), "n_written": int((slot_mapping >= 0).sum()),
        "rows": rows, "padded_stride": stride != bs * RECORD_BYTES, "note": note,
    }
    inputs = {"k": k, "slot_mapping": slot_mapping, "block_size": bs, "num_blocks": nb,
              "page_stride": stride, "cache": cache}
    return Case(name, stage, inputs, params)


@register_cases("swa_write")
def swa_write_cases() -> list[Case]:
    bs = SWA_BLOCK_SIZE
    p64 = production_page_stride(bs)  # 37 440
    return [
        _write_case("swa_write", f"bs64-s{p64}-realistic", 101, bs, p64, 2, {"realistic": 96}, 8),
        _write_case("swa_write", f"bs64-s{p64}-tiny-ties", 102, bs, p64, 2,
                    {"tiny": 24, "boundary": 16, "ties": 24, "realistic": 8}, 4),
        _write_case("swa_write", f"bs64-s{bs * RECORD_BYTES}-unpadded-edge", 103, bs, bs * RECORD_BYTES, 2,
                    {"zeros": 6, "subnormal": 16, "huge": 6, "ties": 8, "realistic": 8}, 4),
        _write_case("swa_write", f"bs64-s{p64}-two-slots", 104, bs, p64, 2, {"realistic": 1, "tiny": 1}, 0,
                    slots=[70, 3], note="mixed page: two slots written, the rest stale"),
        _write_case("swa_write", f"bs53-s{53 * RECORD_BYTES}-odd-permuted", 105, 53, 53 * RECORD_BYTES, 2,
                    {"realistic": 40, "tiny": 12, "zeros": 4, "subnormal": 8}, 6),
        _write_case("swa_write", f"bs61-s{production_page_stride(61)}-odd-padded", 106, 61,
                    production_page_stride(61), 2, {"realistic": 30, "boundary": 10, "ties": 10}, 3),
        _write_case("swa_write", f"bs16-s{16 * RECORD_BYTES + 1000}-extra-padding", 107, 16,
                    16 * RECORD_BYTES + 1000, 4, {"realistic": 20, "tiny": 8, "huge": 2}, 5),
    ]


@register_cases("compressed_write")
def compressed_write_cases() -> list[Case]:
    b4, b128 = C4_BLOCK_SIZE, C128_BLOCK_SIZE
    p4, p128 = production_page_stride(b4), production_page_stride(b128)  # 37 440, 1 728
    return [
        _write_case("compressed_write", f"c4-bs64-s{p4}-realistic", 201, b4, p4, 2, {"realistic": 64}, 4),
        _write_case("compressed_write", f"c4-bs64-s{p4}-tiny-ties", 202, b4, p4, 2,
                    {"tiny": 20, "boundary": 12, "ties": 16, "zeros": 4, "subnormal": 8}, 2),
        _write_case("compressed_write", f"c128-bs2-s{p128}-realistic", 203, b128, p128, 16, {"realistic": 24}, 3),
        _write_case("compressed_write", f"c128-bs2-s{p128}-tiny-edge", 204, b128, p128, 12,
                    {"tiny": 8, "boundary": 6, "ties": 4, "zeros": 2, "huge": 2}, 2),
        _write_case("compressed_write", f"c128-bs2-s{b128 * RECORD_BYTES}-unpadded", 205, b128,
                    b128 * RECORD_BYTES, 10, {"realistic": 12, "tiny": 6}, 2),
    ]


def _plain_case(name: str, seed: int, layout: str, bs: int, nb: int, rows: dict[str, int], n_pad: int,
                scale_up: float = 1.0) -> Case:
    g = torch.Generator().manual_seed(seed)
    kinds = shuffled(g, slot_kinds(rows))
    k = make_rows(g, kinds)
    if scale_up != 1.0:  # push some rows past +-448 to exercise the writer's saturation
        k = torch.cat([k, (k[: max(1, k.shape[0] // 4)].to(torch.float32) * scale_up).to(torch.bfloat16)])
    n = k.shape[0]
    slot_mapping = slots_with_padding(g, nb * bs, n, n_pad)
    if slot_mapping.shape[0] > n:
        k = torch.cat([k, make_rows(g, ["realistic"] * (slot_mapping.shape[0] - n))])
    if layout == "bf16":
        cache = garbage_bytes(g, (nb, bs, HEAD_DIM * 2)).view(torch.bfloat16)
        cache = torch.where(torch.isfinite(cache), cache, torch.zeros_like(cache))  # stale but finite
    else:
        cache = garbage_bytes(g, (nb, bs, HEAD_DIM))
    params = {"seed": seed, "layout": layout, "block_size": bs, "num_blocks": nb, "kv_scale": 1.0,
              "n_tokens": int(slot_mapping.shape[0]), "rows": rows, "saturating_rows": scale_up != 1.0}
    inputs = {"k": k, "slot_mapping": slot_mapping, "block_size": bs, "num_blocks": nb,
              "layout": layout, "kv_scale": 1.0, "cache": cache}
    return Case(name, "plain_write", inputs, params)


@register_cases("plain_write")
def plain_write_cases() -> list[Case]:
    return [
        _plain_case("bf16-bs64-realistic", 301, "bf16", 64, 2, {"realistic": 48, "zeros": 2}, 4),
        _plain_case("fp8-bs64-realistic-saturating", 302, "fp8", 64, 2,
                    {"realistic": 40, "zeros": 2, "subnormal": 4}, 4, scale_up=300.0),
        _plain_case("bf16-bs16-edge", 303, "bf16", 16, 3, {"tiny": 8, "huge": 2, "ties": 6}, 3),
        _plain_case("fp8-bs16-tiny-ties", 304, "fp8", 16, 3, {"tiny": 8, "ties": 8, "boundary": 6}, 3),
    ]


def gather_tables(g: torch.Generator, bs: int, seq_lens: list[int], gather_lens: list[int] | None,
                  extra_pages: int) -> tuple[torch.Tensor, list[int], int]:
    """``(block_table int64 [R, max_blocks], gathered slots in output order, num_blocks)`` of a
    gather case: permuted pages, one spare column of garbage page ids (never read)."""
    r = len(seq_lens)
    need = [-(-L // bs) for L in seq_lens]
    max_blocks = max(need) + 1  # one spare column (holds garbage page ids, never read)
    nb = sum(need) + extra_pages
    perm = torch.randperm(nb, generator=g).tolist()
    table = torch.zeros((r, max_blocks), dtype=torch.int64)
    used = 0
    for b in range(r):
        table[b, : need[b]] = torch.tensor(perm[used : used + need[b]])
        used += need[b]
        table[b, need[b] :] = torch.randint(0, nb, (max_blocks - need[b],), generator=g)
    gl = seq_lens if gather_lens is None else gather_lens
    slots = []
    for b in range(r):
        for pos in range(seq_lens[b] - gl[b], seq_lens[b]):
            slots.append(int(table[b, pos // bs]) * bs + pos % bs)
    return table, slots, nb


def gather_rows(g: torch.Generator, slots: list[int], rows_mix: dict[str, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k bf16 [n, 512], slot_mapping int64 [n])`` writing the ``n`` gathered ``slots``: row kinds
    by fraction (``rows_mix``, the rest realistic), in a permuted token order (as a writer sees them)."""
    n = len(slots)
    kinds = []
    for kind, frac in rows_mix.items():
        kinds += [kind] * int(round(frac * n))
    kinds = (kinds + ["realistic"] * n)[:n]
    k = make_rows(g, shuffled(g, kinds))
    order = torch.randperm(n, generator=g)
    return k, torch.tensor(slots, dtype=torch.int64)[order]


def _gather_case(name: str, seed: int, bs: int, stride: int, seq_lens: list[int],
                 gather_lens: list[int] | None, extra_pages: int, rows_mix: dict[str, float]) -> Case:
    g = torch.Generator().manual_seed(seed)
    table, slots, nb = gather_tables(g, bs, seq_lens, gather_lens, extra_pages)
    n = len(slots)
    k, slot_t = gather_rows(g, slots, rows_mix)
    cache = insert(garbage_bytes(g, (nb, stride)), k, slot_t, bs, ScaleRule.AMAX_CLAMP)
    params = {"seed": seed, "block_size": bs, "page_stride": stride, "num_blocks": nb,
              "seq_lens": seq_lens, "gather_lens": gather_lens, "rows": rows_mix,
              "written_by": "cache_model1.insert(rule=amax_clamp)", "n_written": n}
    inputs = {"cache": cache, "block_table": table.to(torch.int32),
              "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
              "gather_lens": None if gather_lens is None else torch.tensor(gather_lens, dtype=torch.int32),
              "block_size": bs, "num_blocks": nb, "page_stride": stride, "written_slots": slot_t}
    return Case(name, "gather", inputs, params)


@register_cases("gather")
def gather_cases() -> list[Case]:
    p64, p2 = production_page_stride(64), production_page_stride(2)
    return [
        _gather_case(f"bs64-s{p64}-2req-full", 401, 64, p64, [100, 37], None, 0, {"tiny": 0.1}),
        _gather_case(f"bs64-s{p64}-window", 402, 64, p64, [70, 20, 3], [64, 20, 3], 0,
                     {"ties": 0.1, "zeros": 0.02}),
        _gather_case(f"bs2-s{p2}-c128", 403, 2, p2, [9, 4, 1], None, 3, {"tiny": 0.2, "subnormal": 0.2}),
        _gather_case(f"bs53-s{53 * RECORD_BYTES}-odd-partial", 404, 53, 53 * RECORD_BYTES, [60, 10],
                     [20, 10], 1, {"boundary": 0.2}),
    ]
