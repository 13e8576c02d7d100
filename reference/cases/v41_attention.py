"""Default cases of the DeepSeek-V4.1 attention stages ``v41_sparse_decode``, ``v41_sparse_prefill``
and of the V4.1 query quantiser ``v41_query_quant`` (``attention_v41``, ``query_quant``).

Deterministic, CPU-sized (T <= 5 query tokens, 8 heads, K <= 64 + 64 decode slots, 128 prefill
columns; the query quantiser up to 130 rows). The caches are written by a V4.1 producer's rules
(``cache_v41.PRODUCERS``: vLLM 0.33.0 interleaved by default, FlashInfer 0.7.2 page-footer in the
``*-page-footer`` cases) over rows of ``cases_cache.make_rows`` kinds and E2M1 tie rows
(``cases_v41.e2m1_tie_rows``); every other byte is 0xFF, so an unwritten slot decodes to NaN
(MXFP8 code 0x7F/0xFF and NVFP4 scale 0xFF are NaN): NaN-poisoned unreferenced rows.

Inputs of ``v41_sparse_decode`` (the ``decode`` names, plus the records and byte order):
    ``q`` bf16 ``[T, H, 512]``; ``scale`` (``512**-0.55``, not the default, so a kernel that drops
    it fails); ``sink`` fp32 ``[H]`` (head 1 ``+inf``, head 2 ``-inf``);
    ``swa_cache`` uint8 ``[nb, page_stride]`` MXFP8 528-byte records, ``swa_block_size``,
    ``swa_indices`` int32 ``[T, K]`` global slots (``-1`` empty), ``swa_lens`` int32 ``[T]``;
    optionally ``extra_cache`` (``extra_record``: ``mxfp8_528`` | ``nvfp4_288``),
    ``extra_block_size``, ``extra_indices``, ``extra_lens``;
    ``swa_record`` / ``extra_record`` (``V41Record`` values) and ``v41_layout`` (the byte order
    the caches were WRITTEN in; the reader's order is the entry's ``v41_layout`` policy).
    Index rule: ``-1`` is the only sentinel; columns past a length are ``-1`` or, in
    ``*-stale-past-len`` cases, stale valid slot ids of written rows.
Inputs of ``v41_sparse_prefill``: ``q``, ``scale``, ``sink``, the caches as for decode, and
    ``indices`` int32 ``[T, K]`` (``K % 128 == 0``) / ``topk_length`` int32 ``[T]`` into the
    workspace that vLLM's prefill gathers (``dequantize_and_gather_k_cache``): with one request
    and identity block tables, workspace row ``r < N_extra`` is extra slot ``r`` (the compressed
    region first, offset 0) and row ``N_extra + s`` is SWA slot ``s`` (``N_extra`` = slots of the
    extra cache, 0 without one).
Inputs of ``v41_query_quant``: ``qr`` bf16 ``[T, 1536]``, ``kv`` bf16 ``[T, 512]``, ``q_weight``,
    ``kv_weight`` bf16, ``eps`` = 0.0. Every row is an *exact-norm row* (``query_quant``: squares
    are powers of 4 summing to the width, so the kernel's fp32 norm is exact): ``y = +-2**d * w``
    with ``d in {-1, 0, 1}`` or 0, the weights shaped per 32-group: realistic, E4M3 ties (5
    significant bits), zero, tiny (``2**-125 .. 2**-117``: UE8M0 bytes 0 and 1, the zero-inverse
    groups), huge (``2**100``).
"""

from __future__ import annotations

import torch

from ..caches.v41 import PRODUCERS, empty_cache, insert, record_bytes
from ..cases import Case, register_cases
from .cache import make_rows
from .v41 import e2m1_tie_rows
from ..constants import HEAD_DIM, V41_MXFP8_GROUP
from ..errors import fail
from ..policies import IndexRule, V41Record
from ..pipeline.query_quant import is_exact_norm_row

__all__ = ["exact_norm_rows", "v41_decode_case", "v41_prefill_case", "v41_query_quant_case", "CASE_SCALE"]

CASE_SCALE = 512**-0.55  # as the V4 attention cases: not the production default 512**-0.5
# attention-scale rows (RMS about 1; "tiny"/"boundary" rows put groups at the UE8M0 floors); the
# writer-edge kinds with 2**40-scale tiles ("ties", "subnormal", "huge") would make every softmax one-hot
_ROW_KINDS = ("realistic", "realistic", "realistic", "realistic", "tiny", "boundary", "zeros")
_POISON = 0xFF


def _rows(g: torch.Generator, n: int, record: V41Record) -> torch.Tensor:
    """bf16 ``[n, 512]``: make_rows kinds; for NVFP4 half of them E2M1 tie rows brought to RMS ~1 by
    a power of two per row (a group keeps its exact ties while its scale ``s * 2**k`` stays >= 2**-9)."""
    kinds = [_ROW_KINDS[int(i)] for i in torch.randint(0, len(_ROW_KINDS), (n,), generator=g)]
    rows = make_rows(g, kinds)
    if record is V41Record.NVFP4 and n >= 2:
        ties = e2m1_tie_rows(g, n // 2).to(torch.float64)
        rms = (ties * ties).mean(dim=1).sqrt()
        rows[: n // 2] = (ties * torch.pow(2.0, -torch.round(torch.log2(rms)))[:, None]).to(torch.bfloat16)
    return rows[torch.randperm(n, generator=g)]


def _written_cache(g: torch.Generator, record: V41Record, bs: int, nb: int, tail: int, producer: str,
                   fill: float = 0.75) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache of ``nb`` pages with about ``fill`` of its slots written; ``(cache, written slots)``."""
    p = PRODUCERS[producer]
    cache = empty_cache(nb, bs, record, bs * record_bytes(record) + tail, fill=_POISON)
    n = max(1, int(nb * bs * fill))
    slots = torch.randperm(nb * bs, generator=g)[:n]
    k = _rows(g, n, record)
    nonfinite = p.mxfp8_nonfinite if record is V41Record.MXFP8 else p.nvfp4_nonfinite
    cache = insert(cache, k, slots, bs, record, p.layout, mxfp8_rule=p.mxfp8_rule, nonfinite=nonfinite,
                   nvfp4_rule=p.nvfp4_rule)
    return cache, slots


def _indices(g: torch.Generator, written: torch.Tensor, t: int, k: int, lonely: tuple[int, ...],
             stale: bool, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[t, k]`` int32 indices (written slots + ``offset``, a few interior ``-1``) and ``[t]`` lengths
    in ``[1, k]``; tokens in ``lonely`` get length 0. Past a length: ``-1``, or stale valid ids."""
    idx = torch.full((t, k), -1, dtype=torch.int32)
    ln = torch.zeros(t, dtype=torch.int32)
    for i in range(t):
        if i in lonely:
            n = 0
        else:
            n = int(torch.randint(max(1, k // 4), k + 1, (1,), generator=g))
        pick = written[torch.randint(0, written.numel(), (n,), generator=g)] + offset
        if n >= 4:
            pick[int(torch.randint(0, n, (1,), generator=g))] = -1  # an interior -1
        idx[i, :n] = pick.to(torch.int32)
        ln[i] = n
        if stale and n < k:
            idx[i, n:] = (written[torch.randint(0, written.numel(), (k - n,), generator=g)] + offset).to(torch.int32)
    return idx, ln


def _q_sink(g: torch.Generator, t: int, h: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.randn(t, h, HEAD_DIM, generator=g).clamp(-1, 1).to(torch.bfloat16)
    sink = torch.randn(h, generator=g).to(torch.float32)
    sink[1], sink[2] = float("inf"), float("-inf")
    return q, sink


def _caches(g, t, main_bs, main_nb, extra, producer, lonely, stale, tail, main_k, empty_extra):
    """The decode-form inputs shared by decode and prefill (``extra`` = (record, bs, nb, k) | None)."""
    if producer not in PRODUCERS:
        fail("v41 case builder", "producer", f"must be one of {sorted(PRODUCERS)}", producer)
    main, main_written = _written_cache(g, V41Record.MXFP8, main_bs, main_nb, tail, producer)
    inputs = {"swa_cache": main, "swa_block_size": main_bs, "swa_record": V41Record.MXFP8.value,
              "v41_layout": PRODUCERS[producer].layout.value}
    idx, ln = _indices(g, main_written, t, main_k, lonely, stale)
    inputs.update(swa_indices=idx, swa_lens=ln)
    e_written = None
    if extra is not None:
        rec, bs, nb, k = extra
        ec, e_written = _written_cache(g, rec, bs, nb, tail, producer)
        eidx, eln = _indices(g, e_written, t, k, tuple(lonely) + tuple(empty_extra), stale)
        inputs.update(extra_cache=ec, extra_block_size=bs, extra_record=rec.value, extra_indices=eidx,
                      extra_lens=eln)
    return inputs, main_written, e_written


def v41_decode_case(name: str, seed: int, t: int = 4, heads: int = 8, main_bs: int = 64, main_nb: int = 3,
                    main_k: int = 64, extra: tuple[V41Record, int, int, int] | None = None,
                    producer: str = "vllm_0.33.0", lonely: tuple[int, ...] = (), empty_extra: tuple[int, ...] = (),
                    stale_past_len: bool = False, tail: int = 0, edge: str = "") -> Case:
    """A ``v41_sparse_decode`` case (module docstring). ``extra``: (record, block size, pages, top-k)."""
    g = torch.Generator().manual_seed(seed)
    inputs, _, _ = _caches(g, t, main_bs, main_nb, extra, producer, lonely, stale_past_len, tail, main_k, empty_extra)
    q, sink = _q_sink(g, t, heads)
    inputs.update(q=q, scale=CASE_SCALE, sink=sink)
    params = {"seed": seed, "num_heads": heads, "swa_block_size": main_bs, "producer": producer,
              "v41_layout": inputs["v41_layout"], "extra_record": inputs.get("extra_record"),
              "extra_block_size": inputs.get("extra_block_size"), "page_tail": tail, "scale": CASE_SCALE,
              "sink_infs": [1, 2], "index_rule": IndexRule.MINUS1_ONLY.value, "edge": edge}
    if stale_past_len:
        params["past_len"] = "stale_valid"
    return Case(name, "v41_sparse_decode", inputs, params)


def v41_prefill_case(name: str, seed: int, t: int = 5, heads: int = 8, main_bs: int = 64, main_nb: int = 2,
                     extra: tuple[V41Record, int, int] | None = None, width: int = 128,
                     producer: str = "vllm_0.33.0", empty: tuple[int, ...] = (), oob_mix: bool = False,
                     edge: str = "") -> Case:
    """A ``v41_sparse_prefill`` case: combined indices over the gathered workspace (module docstring).
    ``extra``: (record, block size, pages). ``oob_mix``: values ``{-2**31, S, 2**31-1}`` inside
    the prefix (invalid only for any-out-of-range consumers)."""
    g = torch.Generator().manual_seed(seed)
    ex = None if extra is None else (*extra, 1)
    inputs, main_written, e_written = _caches(g, t, main_bs, main_nb, ex, producer, (), False, 0, 1, ())
    for k in ("swa_indices", "swa_lens", "extra_indices", "extra_lens"):
        inputs.pop(k, None)
    n_extra = 0 if extra is None else extra[1] * extra[2]
    pool = main_written + n_extra  # workspace rows of written slots: [extra region | SWA region]
    if e_written is not None:
        pool = torch.cat([e_written, pool])
    idx, ln = _indices(g, pool, t, width, tuple(empty), False)
    s = n_extra + main_bs * main_nb
    if oob_mix:
        bad = [-(2**31), s, 2**31 - 1]
        for i in range(t):
            if int(ln[i]) >= 2:
                idx[i, int(ln[i]) - 1] = bad[i % 3]
    q, sink = _q_sink(g, t, heads)
    inputs.update(q=q, scale=CASE_SCALE, sink=sink, indices=idx, topk_length=ln)
    params = {"seed": seed, "num_heads": heads, "swa_block_size": main_bs, "producer": producer,
              "v41_layout": inputs["v41_layout"], "extra_record": inputs.get("extra_record"),
              "workspace_rows": s, "width": width, "scale": CASE_SCALE, "edge": edge,
              "index_rule": (IndexRule.ANY_OUT_OF_RANGE_INVALID.value if oob_mix else IndexRule.MINUS1_ONLY.value)}
    return Case(name, "v41_sparse_prefill", inputs, params)


# --------------------------------------------------------------------------- query quantiser

_Q_SIZE = 1536  # DeepSeek-V4 q_lora_rank: the width of qr
_GROUP_KINDS = ("realistic", "ties", "zero", "tiny", "huge")


def exact_norm_rows(g: torch.Generator, t: int, width: int) -> torch.Tensor:
    """bf16 ``[t, width]`` exact-norm rows: per row ``n4`` blocks ``(+-2, 0, 0, 0)`` and ``n5`` blocks
    ``(+-2, +-1/2 x 4)``, the other columns ``+-1`` (squares 4+0, 4+4*1/4 and 1: each block's squares
    sum to its width), shuffled: every square is a power of 4 and the squares sum to ``width``."""
    rows = torch.empty(t, width, dtype=torch.float64)
    for i in range(t):
        n4 = int(torch.randint(0, width // 16, (1,), generator=g))
        n5 = int(torch.randint(0, width // 16, (1,), generator=g))
        parts = [torch.tensor([2.0, 0.0, 0.0, 0.0]).repeat(n4), torch.tensor([2.0, 0.5, 0.5, 0.5, 0.5]).repeat(n5),
                 torch.ones(width - 4 * n4 - 5 * n5, dtype=torch.float64)]
        r = torch.cat(parts).to(torch.float64)[torch.randperm(width, generator=g)]
        rows[i] = torch.where(torch.rand(width, generator=g) < 0.5, -r, r)
    out = rows.to(torch.bfloat16)
    if not bool(is_exact_norm_row(out).all()):
        raise AssertionError("exact_norm_rows: a row is not exact-norm")
    return out


def _weights(g: torch.Generator, width: int, kinds: list[str]) -> torch.Tensor:
    """bf16 ``[width]`` weights, one kind per 32-group (``_GROUP_KINDS``)."""
    w = torch.empty(width, dtype=torch.float64)
    n = V41_MXFP8_GROUP
    for j, kind in enumerate(kinds):
        sl = slice(j * n, (j + 1) * n)
        sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
        if kind == "realistic":
            w[sl] = torch.randn(n, generator=g, dtype=torch.float64) * 0.5
        elif kind == "ties":  # 5 significant bits: E4M3 (4 bits) ties after the power-of-two scaling
            m = torch.randint(16, 32, (n,), generator=g).to(torch.float64)
            w[sl] = sign * m * torch.pow(2.0, torch.randint(-9, -3, (n,), generator=g).to(torch.float64))
        elif kind == "zero":
            w[sl] = 0.0
        elif kind == "tiny":  # amax around 448 * 2**-127: UE8M0 bytes 0 (zero inverse) and 1
            e = float(torch.randint(-125, -116, (1,), generator=g))
            w[sl] = sign * (1 + torch.rand(n, generator=g, dtype=torch.float64)) * 2.0**e
        else:  # huge
            w[sl] = sign * (1 + torch.rand(n, generator=g, dtype=torch.float64)) * 2.0**100
    return w.to(torch.bfloat16)


def v41_query_quant_case(name: str, seed: int, t: int, edge: str = "") -> Case:
    """A ``v41_query_quant`` case of ``t`` exact-norm rows (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    groups = _Q_SIZE // V41_MXFP8_GROUP
    kinds = [_GROUP_KINDS[j % len(_GROUP_KINDS)] for j in range(groups)]
    kinds = [kinds[i] for i in torch.randperm(groups, generator=g).tolist()]
    kv_kinds = ["realistic"] * (HEAD_DIM // V41_MXFP8_GROUP)
    inputs = {"qr": exact_norm_rows(g, t, _Q_SIZE), "kv": exact_norm_rows(g, t, HEAD_DIM),
              "q_weight": _weights(g, _Q_SIZE, kinds), "kv_weight": _weights(g, HEAD_DIM, kv_kinds), "eps": 0.0}
    params = {"seed": seed, "tokens": t, "q_size": _Q_SIZE, "kv_size": HEAD_DIM, "eps": 0.0,
              "group_kinds": sorted(set(kinds)), "edge": edge}
    return Case(name, "v41_query_quant", inputs, params)


@register_cases("v41_sparse_decode")
def v41_decode_cases() -> list[Case]:
    mx, nv = V41Record.MXFP8, V41Record.NVFP4
    return [
        v41_decode_case("mxfp8-swa-bs64-nanpoison-lonely", 501, lonely=(2,),
                        edge="MXFP8 main only (SWA layer); NaN-poisoned unwritten slots; a lonely token"),
        v41_decode_case("mixed-mxfp8-nvfp4-bs64-bs2", 502, t=5, extra=(nv, 2, 40, 64), empty_extra=(3,),
                        edge="nvfp4_ds_mla: MXFP8 SWA + NVFP4 compressed on 2-entry pages, E2M1 tie rows; "
                             "an empty extra segment"),
        v41_decode_case("mxfp8-mxfp8-bs64-tail-stale-past-len", 503, extra=(mx, 64, 2, 64), tail=48,
                        stale_past_len=True, edge="fp8_ds_mla V4.1: MXFP8 main and extra, page tails of 48 "
                                                  "bytes, stale valid ids past every length"),
        v41_decode_case("mixed-mxfp8-nvfp4-page-footer", 504, extra=(nv, 64, 2, 64), producer="flashinfer_0.7.2",
                        edge="caches written in FlashInfer 0.7.2's page-footer order (a reader of the "
                             "interleaved order misreads them, H13)"),
    ]


@register_cases("v41_sparse_prefill")
def v41_prefill_cases() -> list[Case]:
    nv = V41Record.NVFP4
    return [
        v41_prefill_case("mixed-mxfp8-nvfp4-workspace", 511, extra=(nv, 2, 32), empty=(4,),
                         edge="workspace gathered from an NVFP4 compressed cache then an MXFP8 SWA cache; "
                              "a topk_length-0 token"),
        v41_prefill_case("mxfp8-swa-oob-mix", 512, oob_mix=True,
                         edge="SWA-only; out-of-range values inside the prefix (any-oob consumers only)"),
    ]


@register_cases("v41_query_quant")
def v41_query_quant_cases() -> list[Case]:
    return [
        v41_query_quant_case("t3-q1536-kv512-all-groups", 521, 3,
                             edge="realistic, E4M3-tie, zero, tiny (UE8M0 0/1) and 2**100 weight groups"),
        v41_query_quant_case("t130-two-row-tiles", 522, 130,
                             edge="130 rows: two 128-row scale tiles, padding rows 130..255 hold byte 0"),
    ]
