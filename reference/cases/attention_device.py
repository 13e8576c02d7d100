"""Decode and prefill cases built where they are judged: drawn parameters become tensors on any
device, with the same bytes on every device (``device_decode_case``, ``device_prefill_case``).

The GPU fuzz (``tests/kernels/test_fuzz_attention_gpu.py``) draws production-shaped decode
parameters (batch up to 128, 64/128 heads, sequences up to 16384 tokens, top-k up to 2048). The
pipeline builder ``attention.decode_case`` simulates a layer's whole history on the CPU (CPU
generators fix its bits): 0.3-1.6 s per batch-128 case on a 16-core host, and its caches then
cross to the GPU. This builder takes the same parameters and builds the case on ``device``
directly; nothing of production size crosses the host (only the RoPE table, a constant of the
layer, is computed on the CPU once per size and kept on the device).

Same bytes on every device: every random value comes from a counter-based integer hash
(``_bits``: 32-bit mixing in int64 arithmetic, every product below ``2**63``), and every float is
assembled from its bit fields (``_bf16``: sign, exponent, 7-bit mantissa as an ``int16`` viewed as
bfloat16), so no float operation of the device's own rounding is involved. Random orders are
``argsort`` of distinct integer keys (one answer on every device). The caches are written by the
reference writer (``caches.model1.insert``: Q_A for SWA rows, Q_S for compressed rows, as
``pipeline.layer.LayerSpec`` sets them) and the indices come from the reference index builders
(``indices.window.compute_swa_indices_and_lens``, ``indices.slots.compute_global_topk_indices_and_lens``,
``indices.window.build_c128a_topk_metadata``), which give the same bytes on every device
(``tests/reference/test_case_build_device.py`` compares every stage byte for byte, CPU against
CUDA where a GPU is present).

What it builds (the inputs of ``attention.decode_case``, same keys, dtypes and conventions):
one decode token per request at position ``seq_len - 1``; SWA pages of ``swa_bs`` entries and
(C4A / C128A) compressed pages of ``64`` / ``comp_bs`` entries, each request's pages at shuffled
physical pages, production page strides, every byte 0xFF before writing (unreferenced slots decode
to NaN). Written rows: each request's SWA window (the last ``min(seq_len, 128)`` positions) and the
compressed entries its token reads (C4A: its top-k, a random subset of the ``seq_len // 4``
visible entries in random order; C128A: every visible entry), so every valid index reads a written
row and every other slot is NaN-poisoned. Row values: bfloat16 with a drawn exponent per element
(magnitudes ``2**-6 .. 2``, 1 in 64 a signed zero) and a drawn exponent per row (``-2 .. 2``);
q likewise (``2**-5 .. 2``) times ``2**q_scale_log2`` (exact); sinks ``2**-3 .. 4`` in magnitude,
head 1 ``+inf`` and head 2 ``-inf``. ``invalid_tokens`` (lonely rows) and ``stale_past_len``
(stale valid ids past the lengths, the rule of ``attention._stale_fill``) as ``decode_case``.

Prefill (``device_prefill_case``): the bf16 workspace of ``attention.prefill_case`` in its
geometry (per request the compressed entries, then the gathered window; ``pipeline.layer.attend``),
every row random bfloat16 as above, the combined indices and lengths from the reference builder
(``indices.prefill.combine_topk_swa_indices``, C4A local top-k as for decode, C128A every visible
entry), rows no valid entry references NaN, ``empty_tokens`` and ``stale_past_len`` as
``prefill_case``: the lengths, widths and poisoned rows of ``prefill_case`` for the same draw.

Differences from ``decode_case`` (a different builder: the draw is the same, the bits are not):
the K rows are random rather than a simulated layer's roped projections, only the rows some index
reads are written, and q is random bfloat16 rather than a roped projection. The pipeline builder
stays the one the default case set and the pipeline-faithful fuzz property use.
"""

from __future__ import annotations

import functools

import torch

from ..caches.model1 import empty_cache, insert
from ..cases import Case
from ..constants import C4_RATIO, C128A_TOPK_ALIGN, HEAD_DIM, production_page_stride
from ..errors import check_int, fail
from ..hashing import mix32, mix32_int
from ..indices.prefill import combine_topk_swa_indices
from ..indices.slots import compute_global_topk_indices_and_lens
from ..indices.window import build_c128a_topk_metadata, compute_swa_indices_and_lens
from ..pipeline.layer import COMPRESS_ROPE_THETA, MAIN_ROPE_THETA, YARN_CONFIG, LayerSpec
from ..pipeline.rope import cos_sin_cache
from ..policies import IndexRule
from .attention import LAYER_RATIOS, CASE_SCALE

__all__ = ["device_decode_case", "device_prefill_case", "decode_stages", "prefill_stages", "STAGES",
           "PREFILL_STAGES"]

_WRITE_ROWS = 1 << 15  # rows generated and written per insert call (bounds the writer's temporaries)
# streams of the hash (one per kind of value)
_S_SWA_BT, _S_COMP_BT, _S_TOPK, _S_SWA_ROWS, _S_COMP_ROWS, _S_Q, _S_SINK, _S_KV = range(8)
# the stages a test compares byte for byte (``decode_stages``)
STAGES = ("swa_block_table", "comp_block_table", "local_topk", "swa_rows", "comp_rows", "swa_cache",
          "extra_cache", "swa_indices", "swa_lens", "extra_indices", "extra_lens", "q", "sink", "cos_sin")
PREFILL_STAGES = ("local_topk", "kv", "indices", "topk_length", "q", "sink", "positions")


def _bits(seed: int, stream: int, n: int, device, start: int = 0) -> torch.Tensor:
    """int64 ``[n]`` of 32-bit hash values: elements ``start .. start + n - 1`` of stream
    ``stream`` of ``seed`` (``start + n <= 2**32``)."""
    k1 = mix32_int(seed * 0x9E3779B1 + stream * 0x85EBCA77 + 0x165667B1)
    k2 = mix32_int(k1 ^ 0x27D4EB2F)
    c = torch.arange(start, start + n, device=device, dtype=torch.int64)
    return mix32(mix32(c ^ k1) ^ k2)


def _bf16(bits: torch.Tensor, e_lo: int, e_hi: int, e_shift: torch.Tensor | int = 0,
          zeros: bool = False) -> torch.Tensor:
    """bfloat16 values assembled from their bit fields (exact, device-independent): mantissa
    ``bits & 127``, sign bit 7, unbiased exponent ``e_lo + (bits >> 8) % (e_hi - e_lo + 1)`` plus
    ``e_shift`` (int64, broadcast; the result must stay a normal number); ``zeros``: 1 in 64 values
    (``(bits >> 26) == 0``) a signed zero."""
    m = bits & 127
    s = (bits >> 7) & 1
    e = e_lo + (bits >> 8) % (e_hi - e_lo + 1) + e_shift
    v = (s << 15) | ((e + 127) << 7) | m
    if zeros:
        v = torch.where((bits >> 26) == 0, s << 15, v)
    v = torch.where(v >= 1 << 15, v - (1 << 16), v)  # two's complement int16
    return v.to(torch.int16).view(torch.bfloat16)


def _perm(seed: int, stream: int, n: int, device) -> torch.Tensor:
    """A permutation of ``0 .. n-1`` (int64): ``argsort`` of distinct keys (hash, then index)."""
    keys = ((_bits(seed, stream, n, device) >> 1) << 31) | torch.arange(n, device=device, dtype=torch.int64)
    return torch.argsort(keys)


def _rows(seed: int, stream: int, n: int, device, start: int = 0) -> torch.Tensor:
    """``n`` cache rows, bfloat16 ``[n, 512]``: per element exponent ``-6 .. 0`` (1 in 64 a signed
    zero), per row a further ``-2 .. 2``."""
    b = _bits(seed, stream, n * (HEAD_DIM + 1), device, start * (HEAD_DIM + 1)).view(n, HEAD_DIM + 1)
    shift = (b[:, :1] >> 8) % 5 - 2
    return _bf16(b[:, 1:], -6, 0, shift, zeros=True)


def _write(cache: torch.Tensor, slots: torch.Tensor, bs: int, rule, seed: int, stream: int) -> torch.Tensor:
    """``cache`` (in place) with row ``i`` of stream ``stream`` written at ``slots[i]`` by the
    reference writer, ``_WRITE_ROWS`` rows per call."""
    for i0 in range(0, slots.numel(), _WRITE_ROWS):
        sl = slots[i0:i0 + _WRITE_ROWS]
        cache = insert(cache, _rows(seed, stream, sl.numel(), cache.device, i0), sl, bs, rule, inplace=True)
    return cache


def _cos_sin(rows: int, compressed: bool, device: str) -> torch.Tensor:
    """The layer's RoPE table rows ``0 .. rows-1`` (``pipeline.layer.make_weights``' table), on
    ``device``: a table of the next power of two of rows (at least 1024; a row does not depend on
    the table's size) computed on the CPU, whose float arithmetic fixes the bits, and kept."""
    return _cos_sin_table(max(1024, 1 << (rows - 1).bit_length()), compressed, device)[:rows]


@functools.lru_cache(maxsize=8)
def _cos_sin_table(rows: int, compressed: bool, device: str) -> torch.Tensor:
    t = cos_sin_cache(rows, theta=COMPRESS_ROPE_THETA, yarn=YARN_CONFIG) if compressed else \
        cos_sin_cache(rows, theta=MAIN_ROPE_THETA)
    return t.to(device)


def _stale_fill(idx: torch.Tensor, length: torch.Tensor, pool: torch.Tensor, salt: int) -> torch.Tensor:
    """``attention._stale_fill`` without a host loop: column ``c >= length[t]`` of row ``t`` takes
    ``pool[(7 c + 13 t + salt) % len(pool)]``."""
    if pool.numel() == 0:
        return idx.clone()
    T, K = idx.shape
    col = torch.arange(K, device=idx.device)
    t = torch.arange(T, device=idx.device)
    pick = (col[None, :] * 7 + t[:, None] * 13 + salt) % pool.numel()
    return torch.where(col[None, :] >= length[:, None].to(torch.int64), pool[pick].to(idx.dtype), idx)


def _valid_pool(idx: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    inpre = torch.arange(idx.shape[1], device=idx.device)[None, :] < length[:, None].to(torch.int64)
    return torch.unique(idx[inpre & (idx >= 0)].to(torch.int64), sorted=True)


def _local_topk(seed: int, vis: torch.Tensor, topk: int) -> torch.Tensor:
    """C4A request-local top-k ``[T, topk]`` int32: per token a random subset of ``[0, vis[t])`` of
    size ``min(vis[t], topk)`` in random order, then ``-1`` (``pipeline.layer.synthetic_topk``'s
    contract, hashed instead of drawn from a CPU generator)."""
    T, dev = vis.shape[0], vis.device
    W = int(vis.max()) if T else 0
    if W == 0:
        return torch.full((T, topk), -1, dtype=torch.int32, device=dev)
    col = torch.arange(W, device=dev, dtype=torch.int64)
    h = _bits(seed, _S_TOPK, T * W, dev).view(T, W)
    keys = torch.where(col[None, :] < vis[:, None], (h >> 1) << 20, torch.full((), 1 << 52, device=dev)) | col[None, :]
    order = torch.argsort(keys, dim=1)[:, :topk]
    k = torch.clamp(vis, max=topk)
    out = torch.where(torch.arange(order.shape[1], device=dev)[None, :] < k[:, None], order,
                      torch.full((), -1, dtype=torch.int64, device=dev))
    if out.shape[1] < topk:
        out = torch.cat([out, torch.full((T, topk - out.shape[1]), -1, dtype=torch.int64, device=dev)], dim=1)
    return out.to(torch.int32)


def _check_draw(fn: str, layer: str, num_heads: int, q_scale_log2: int) -> None:
    """The arguments both device builders share: the layer kind, the head count and the power of
    two q is scaled by (q stays a normal bfloat16)."""
    if layer not in LAYER_RATIOS:
        fail(fn, "layer", f"must be one of {sorted(LAYER_RATIOS)}", layer)
    check_int(fn, "num_heads", num_heads, minimum=1)
    if not -60 <= check_int(fn, "q_scale_log2", q_scale_log2) <= 60:
        fail(fn, "q_scale_log2", "must be in [-60, 60] (q stays a normal bfloat16)", q_scale_log2)


def _check_token_numbers(fn: str, arg: str, tokens, n: int) -> None:
    """Every number in ``tokens`` is a token of the case, in ``[0, n)``."""
    for t in tokens:
        if not 0 <= t < n:
            fail(fn, arg, f"must be token numbers in [0, {n})", t)


def decode_stages(layer: str, num_heads: int, seq_lens: list[int], topk: int = 512, swa_bs: int = 64,
                  comp_bs: int | None = None, seed: int = 0, invalid_tokens: tuple[int, ...] = (),
                  stale_past_len: bool = False, rope_table: bool = False, q_scale_log2: int = 0,
                  device: str | torch.device = "cpu") -> dict:
    """Every stage of ``device_decode_case`` (``STAGES``; None where the layer has none): block
    tables, the local top-k, the written rows, caches, indices and lengths, q, sinks, the RoPE
    table. Arguments as ``device_decode_case``."""
    fn = "device_decode_case"
    _check_draw(fn, layer, num_heads, q_scale_log2)
    if not seq_lens:
        fail(fn, "seq_lens", "must list at least one request")
    for s in seq_lens:
        check_int(fn, "seq_lens", s, minimum=1)
    R = len(seq_lens)
    _check_token_numbers(fn, "invalid_tokens", invalid_tokens, R)
    dev = torch.device(device)
    ratio = LAYER_RATIOS[layer]
    spec = LayerSpec(ratio=ratio, num_heads=num_heads, index_topk=topk, swa_block_size=swa_bs,
                     comp_block_size=comp_bs, scale=CASE_SCALE)
    seq = torch.tensor(seq_lens, dtype=torch.int64).to(dev)  # R small integers: the draw itself
    pos = seq - 1
    req = torch.arange(R, device=dev)
    qsl = torch.arange(R + 1, device=dev)
    valid_tok = torch.ones(R, dtype=torch.bool, device=dev)
    st: dict = dict.fromkeys(STAGES)
    # SWA: pages for every position (the pipeline builder's geometry), the window written
    nbr = -(-max(seq_lens) // swa_bs)
    st["swa_block_table"] = _perm(seed, _S_SWA_BT, R * nbr, dev).to(torch.int32).view(R, nbr)
    win = torch.clamp(seq, max=spec.window)
    n_w = int(sum(min(s, spec.window) for s in seq_lens))
    r_of = torch.repeat_interleave(req, win, output_size=n_w)
    first = torch.cumsum(win, 0) - win
    p_w = seq[r_of] - win[r_of] + (torch.arange(n_w, device=dev) - first[r_of])
    bt = st["swa_block_table"].to(torch.int64)
    swa_slots = bt[r_of, p_w // swa_bs] * swa_bs + p_w % swa_bs
    cache = empty_cache(R * nbr, swa_bs, production_page_stride(swa_bs), fill=0xFF, device=dev)
    st["swa_cache"] = _write(cache, swa_slots, swa_bs, spec.swa_rule, seed, _S_SWA_ROWS)
    st["swa_rows"] = _rows(seed, _S_SWA_ROWS, min(n_w, 64), dev)  # the first rows (the stream's prefix)
    swa_idx, swa_len = compute_swa_indices_and_lens(qsl, seq, req, valid_tok, st["swa_block_table"], swa_bs,
                                                    window_size=spec.window)
    if spec.compressed:
        cbs = spec.comp_bs
        n_vis = [s // ratio for s in seq_lens]
        nc = max(1, -(-max(n_vis) // cbs))
        st["comp_block_table"] = _perm(seed, _S_COMP_BT, R * nc, dev).to(torch.int32).view(R, nc)
        if ratio == C4_RATIO:
            st["local_topk"] = _local_topk(seed, torch.div(pos + 1, ratio, rounding_mode="floor"), topk)
            ex_idx, ex_len = compute_global_topk_indices_and_lens(st["local_topk"], req, st["comp_block_table"], cbs,
                                                                  valid_tok)
        else:
            n = max(n_vis)
            width = max(C128A_TOPK_ALIGN, -(-n // C128A_TOPK_ALIGN) * C128A_TOPK_ALIGN)
            ex_idx, ex_len, _ = build_c128a_topk_metadata(pos, ratio, R, req, st["comp_block_table"], cbs,
                                                          torch.zeros(R, dtype=torch.int64, device=dev), width)
        col = torch.arange(ex_idx.shape[1], device=dev)
        written = ex_idx.to(torch.int64)[(col[None, :] < ex_len[:, None].to(torch.int64)) & (ex_idx >= 0)]
        cache = empty_cache(R * nc, cbs, production_page_stride(cbs), fill=0xFF, device=dev)
        st["extra_cache"] = _write(cache, written, cbs, spec.comp_rule, seed, _S_COMP_ROWS)
        st["comp_rows"] = _rows(seed, _S_COMP_ROWS, min(written.numel(), 64), dev)
    else:
        ex_idx = ex_len = None
    if invalid_tokens:  # lonely rows: every column -1, length 0 in every segment
        bad = torch.tensor(sorted(set(invalid_tokens)), dtype=torch.int64).to(dev)
        swa_idx[bad] = -1
        swa_len[bad] = 0
        if ex_idx is not None:
            ex_idx[bad] = -1
            ex_len[bad] = 0
    if stale_past_len:
        swa_idx = _stale_fill(swa_idx, swa_len, _valid_pool(swa_idx, swa_len), seed)
        if ex_idx is not None:
            ex_idx = _stale_fill(ex_idx, ex_len, _valid_pool(ex_idx, ex_len), seed + 1)
    st.update(swa_indices=swa_idx, swa_lens=swa_len, extra_indices=ex_idx, extra_lens=ex_len)
    qb = _bits(seed, _S_Q, R * num_heads * HEAD_DIM, dev).view(R, num_heads, HEAD_DIM)
    st["q"] = _bf16(qb, -5, 0, q_scale_log2)
    sink = _bf16(_bits(seed, _S_SINK, num_heads, dev), -3, 2).to(torch.float32)
    if num_heads >= 4:  # as pipeline.layer.make_weights: head 1 +inf, head 2 -inf
        inf = torch.tensor([float("inf"), float("-inf")], dtype=torch.float32).to(dev)
        sink[1:3] = inf
    st["sink"] = sink
    if rope_table:
        st["cos_sin"] = _cos_sin(max(seq_lens), spec.compressed, str(dev))
    return st


def device_decode_case(name: str, layer: str, num_heads: int, seq_lens: list[int], topk: int = 512,
                       swa_bs: int = 64, comp_bs: int | None = None, seed: int = 0,
                       invalid_tokens: tuple[int, ...] = (), stale_past_len: bool = False,
                       rope_table: bool = False, q_scale_log2: int = 0, edge: str = "",
                       device: str | torch.device = "cpu") -> Case:
    """A decode case built on ``device`` (module docstring): the parameters of
    ``attention.decode_case`` (less ``drop_extra_for``) plus ``q_scale_log2`` (q times
    ``2**q_scale_log2``, exact) and ``device``. The same bytes on every device."""
    st = decode_stages(layer, num_heads, seq_lens, topk, swa_bs, comp_bs, seed, invalid_tokens, stale_past_len,
                       rope_table, q_scale_log2, device)
    ratio = LAYER_RATIOS[layer]
    cbs = (comp_bs if comp_bs is not None else 256 // ratio) if ratio > 1 else None
    inputs = {"q": st["q"], "scale": CASE_SCALE, "sink": st["sink"],
              "positions": torch.tensor(seq_lens, dtype=torch.int64).to(st["q"].device) - 1,
              "swa_cache": st["swa_cache"], "swa_block_size": swa_bs, "swa_indices": st["swa_indices"],
              "swa_lens": st["swa_lens"]}
    if ratio > 1:
        inputs.update(extra_cache=st["extra_cache"], extra_block_size=cbs, extra_indices=st["extra_indices"],
                      extra_lens=st["extra_lens"])
    if rope_table:
        inputs["cos_sin"] = st["cos_sin"]
    params = {"layer": layer, "num_heads": num_heads, "seq_lens": list(seq_lens), "swa_block_size": swa_bs,
              "extra_block_size": cbs, "topk": topk if layer == "c4a" else None, "scale": CASE_SCALE,
              "sink_infs": [1, 2], "edge": edge, "index_rule": IndexRule.MINUS1_ONLY.value, "seed": seed,
              "builder": "device", "q_scale_log2": q_scale_log2}
    if stale_past_len:
        params["past_len"] = "stale_valid"
    if rope_table:
        params["cos_sin_rows"] = int(inputs["cos_sin"].shape[0])
    return Case(name, "decode", inputs, params)


def prefill_stages(layer: str, num_heads: int, seq_lens: list[int], query_lens: list[int], topk: int = 128,
                   seed: int = 0, stale_past_len: bool = False, empty_tokens: tuple[int, ...] = (),
                   q_scale_log2: int = 0, device: str | torch.device = "cpu") -> dict:
    """Every stage of ``device_prefill_case`` (``PREFILL_STAGES``; ``local_topk`` None on SWA-only
    layers). Arguments as ``device_prefill_case``."""
    fn = "device_prefill_case"
    _check_draw(fn, layer, num_heads, q_scale_log2)
    if not seq_lens or len(query_lens) != len(seq_lens):
        fail(fn, "query_lens", "must give one query length per request (at least one request)")
    for s, q in zip(seq_lens, query_lens):
        check_int(fn, "seq_lens", s, minimum=1)
        check_int(fn, "query_lens", q, minimum=1)
        if q > s:
            fail(fn, "query_lens", "must not exceed the request's seq_len", (q, s))
    T = sum(query_lens)
    _check_token_numbers(fn, "empty_tokens", empty_tokens, T)
    dev = torch.device(device)
    ratio = LAYER_RATIOS[layer]
    spec = LayerSpec(ratio=ratio, num_heads=num_heads, index_topk=topk, swa_block_size=64, scale=CASE_SCALE)
    R, W = len(seq_lens), spec.window
    seq = torch.tensor(seq_lens, dtype=torch.int64).to(dev)
    ql = torch.tensor(query_lens, dtype=torch.int64).to(dev)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), torch.cumsum(ql, 0)])
    req = torch.repeat_interleave(torch.arange(R, device=dev), ql, output_size=T)
    pos = seq[req] - ql[req] + (torch.arange(T, device=dev) - qsl[req])
    # the pipeline builder's workspace geometry (pipeline.layer.attend, form "prefill")
    gather_lens = ql + torch.clamp(seq - ql, min=0, max=W - 1)
    N = max(s // ratio for s in seq_lens) if spec.compressed else 0
    M = N + max(q + min(max(s - q, 0), W - 1) for s, q in zip(seq_lens, query_lens))
    st: dict = dict.fromkeys(PREFILL_STAGES)
    if spec.compressed and ratio == C4_RATIO:
        st["local_topk"] = _local_topk(seed, torch.div(pos + 1, ratio, rounding_mode="floor"), topk)
        local, top = st["local_topk"], topk
    elif spec.compressed:  # C128A: every visible entry, request-local
        n = max(s // ratio for s in seq_lens)
        width = max(C128A_TOPK_ALIGN, -(-n // C128A_TOPK_ALIGN) * C128A_TOPK_ALIGN)
        vis = torch.clamp(torch.div(pos + 1, ratio, rounding_mode="floor"), max=width)
        k = torch.arange(width, device=dev)
        local = torch.where(k[None, :] < vis[:, None], k[None, :], torch.full((), -1, device=dev)).to(torch.int32)
        st["local_topk"], top = local, width
    else:
        local, top = torch.full((T, 1), -1, dtype=torch.int32, device=dev), 0
    idx, ln = combine_topk_swa_indices(local, qsl, seq, gather_lens, W, ratio, top, M, N)
    if empty_tokens:
        bad = torch.tensor(sorted(set(empty_tokens)), dtype=torch.int64).to(dev)
        idx[bad] = -1
        ln[bad] = 0
    S = R * M
    col = torch.arange(idx.shape[1], device=dev)
    i64 = idx.to(torch.int64)
    ok = (col[None, :] < ln[:, None].to(torch.int64)) & (i64 >= 0) & (i64 < S)
    ref = torch.zeros(S, dtype=torch.bool, device=dev)
    ref[i64[ok]] = True
    kv = torch.cat([_rows(seed, _S_KV, min(_WRITE_ROWS, S - i0), dev, i0) for i0 in range(0, S, _WRITE_ROWS)])
    st["kv"] = kv.masked_fill_(~ref[:, None], float("nan"))  # rows no valid entry references: NaN
    if stale_past_len:
        idx = _stale_fill(idx, ln, torch.nonzero(ref).reshape(-1), seed)
    st.update(indices=idx, topk_length=ln)
    qb = _bits(seed, _S_Q, T * num_heads * HEAD_DIM, dev).view(T, num_heads, HEAD_DIM)
    st["q"] = _bf16(qb, -5, 0, q_scale_log2)
    sink = _bf16(_bits(seed, _S_SINK, num_heads, dev), -3, 2).to(torch.float32)
    if num_heads >= 4:
        sink[1:3] = torch.tensor([float("inf"), float("-inf")], dtype=torch.float32).to(dev)
    st["sink"], st["positions"] = sink, pos
    return st


def device_prefill_case(name: str, layer: str, num_heads: int, seq_lens: list[int], query_lens: list[int],
                        topk: int = 128, seed: int = 0, stale_past_len: bool = False,
                        empty_tokens: tuple[int, ...] = (), q_scale_log2: int = 0, edge: str = "",
                        device: str | torch.device = "cpu") -> Case:
    """A prefill case built on ``device`` (module docstring; ``attention.prefill_case``'s inputs on
    the bf16 workspace, its parameters less ``oob_mix``, plus ``q_scale_log2`` and ``device``):
    every workspace row random bfloat16 (the pipeline builder's workspace geometry: per request the
    compressed entries, then the gathered window), the combined indices from the reference
    builder (``indices.prefill.combine_topk_swa_indices``), rows no valid entry references NaN.
    The same bytes on every device."""
    st = prefill_stages(layer, num_heads, seq_lens, query_lens, topk, seed, stale_past_len, empty_tokens,
                        q_scale_log2, device)
    inputs = {"q": st["q"], "kv": st["kv"], "indices": st["indices"], "topk_length": st["topk_length"],
              "scale": CASE_SCALE, "sink": st["sink"], "positions": st["positions"]}
    params = {"layer": layer, "num_heads": num_heads, "seq_lens": list(seq_lens), "query_lens": list(query_lens),
              "topk": topk if layer == "c4a" else None, "width": int(st["indices"].shape[1]), "scale": CASE_SCALE,
              "edge": edge, "seed": seed, "index_rule": IndexRule.MINUS1_ONLY.value, "builder": "device",
              "q_scale_log2": q_scale_log2}
    if stale_past_len:
        params["past_len"] = "stale_valid"
    return Case(name, "prefill", inputs, params)
