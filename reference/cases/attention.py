"""Default cases of the attention stages: ``decode``, ``prefill``, ``rope``, ``inv_rope_fp8``
(attention 1.3-1.4, 2, 3.2-3.3, 7 "Input domain"; datapath 2.1, H6).

Deterministic (CPU ``torch.Generator`` seeds fixed per case), CPU-sized (T <= 8 query tokens,
K <= 128 + 512 slots) and JSON-describable (``params``). Built with the reference writers
(``cache_model1.insert``: Q_A for SWA rows, Q_S for compressed rows) and index builders through
``layer`` (write history, then one step), so the index tensors are what vLLM would pass.

Inputs (CPU tensors / plain values), the key names of ``kernels/canonical.py``:

decode   ``q`` bf16 ``[T, H, 512]`` (roped); ``scale`` float (``512**-0.55``, not the default);
         ``sink`` fp32 ``[H]`` (head 1 ``+inf``, head 2 ``-inf``); ``positions`` int64 ``[T]``;
         ``swa_cache`` uint8 ``[nb, page_stride]``, ``swa_block_size`` int, ``swa_indices`` int32
         ``[T, 128]`` global slots (``-1`` empty), ``swa_lens`` int32 ``[T]``; on C4A/C128A
         layers also ``extra_cache``, ``extra_block_size``, ``extra_indices`` int32 ``[T, K2]``,
         ``extra_lens`` int32 ``[T]``. Every unwritten cache byte is 0xFF, so every slot no
         valid index references decodes to NaN (NaN-poisoned unreferenced rows); block tables
         are shuffled. Index rule: ``-1`` is the only sentinel (FlashMLA decode). Columns past a
         length are ``-1``, except in ``*-stale-past-len`` cases, where they hold stale VALID
         slot ids of written rows (vLLM reuses index buffers, vLLM#36616): only the lengths
         exclude them. Some cases also carry ``cos_sin`` fp32 ``[max(positions)+1, 64]`` (the
         layer's RoPE table) for consumers that inverse-rope their output (ROCm decode
         epilogue, FlashInfer RopeQuant; ``output_inv_roped``, attention 3.3).
prefill  ``q`` bf16 ``[T, H, 512]``; ``kv`` bf16 ``[S, 512]`` workspace rows (rows no valid index
         references are NaN); ``indices`` int32 ``[T, K]`` combined rows (``K % 128 == 0``),
         ``topk_length`` int32 ``[T]``; ``scale``; ``sink``; ``positions``. Columns past
         ``topk_length`` are ``-1`` or (``*-stale-past-len``) stale valid row ids. Some cases put
         out-of-range values ``{-2**31, -1, S, 2**31-1}`` inside the prefix: only for
         ``index_rule = any_out_of_range_invalid`` consumers (``params["index_rule"]``).
rope     ``x`` bf16 ``[N, 512]`` (or ``[T, H, 512]``), ``positions`` int64 (prefix of x's shape),
         ``cos_sin`` fp32 ``[max_pos, 64]``, ``inverse`` bool.
inv_rope_fp8  ``o`` bf16 ``[T, H, 512]`` attention output, ``positions`` int64 ``[T]``,
         ``cos_sin`` fp32 ``[max_pos, 64]``, ``heads_per_group`` int (8).
compressor ``state`` fp32 ``[P, 2*coff*512]`` (state rows of positions ``0..P-1`` of one request,
         ``compressor.build_state``), ``positions`` int64 ``[M]`` boundary positions, ``ratio``
         (4 | 128), ``norm_weight`` bf16 ``[512]``, ``eps`` float, ``cos_sin`` fp32 table.
         Reference: ``compressor.compressor_boundary`` (fp32 ``normed`` is a tolerance check, H7;
         ``row_bf16`` from it is the byte boundary). Also the production kernel's contract
         (``compress_norm_rope_store_triton`` via ``kernels/vllm_triton.compressor_args``), for
         step tokens = the boundary ``positions`` of request 0: ``state_cache`` fp32
         ``[pages, block_size, 2*coff*512]`` (shuffled ``block_table`` int32 ``[1, B]``, a spare
         garbage page), ``block_size`` (4 | 8), ``token_to_req_indices``, ``slot_mapping`` (state
         slots), ``compressed_slot_mapping``, ``cache`` uint8 584-byte pages (stale random bytes)
         with ``kv_block_size`` (64 | 2), and the aliases ``cos_sin_cache``, ``rms_norm_weight``,
         ``rms_norm_eps``, ``compress_ratio``. Expected ``cache``: judged by the compressor tier.

``params``: ``layer`` ("swa"|"c4a"|"c128a"), ``num_heads``, ``seq_lens``, ``edge`` (the edge case
exercised), ``index_rule``, ``seed``.
"""

from __future__ import annotations

import torch

from ..cases import Case, register_cases
from ..constants import C4_RATIO, C128_RATIO, HEAD_DIM, OUT_HEADS_PER_GROUP, ROPE_OFFSET
from ..pipeline.layer import BatchLayout, LayerSpec, attend, init_layer_state, make_weights, synthetic_history, write_tokens
from ..policies import IndexRule
from ..pipeline.compressor import build_state
from .attention_sweep import default_sweep_decode, default_sweep_prefill
from ..pipeline.rope import YarnConfig, cos_sin_cache

__all__ = ["decode_case", "prefill_case"]

CASE_SCALE = 512**-0.55  # FlashMLA decode test scale (attention 4.2): not the production default
LAYER_RATIOS = {"swa": 1, "c4a": C4_RATIO, "c128a": C128_RATIO}


def _step(layer: str, num_heads: int, seq_lens: list[int], query_lens: list[int], topk: int, swa_bs: int,
          comp_bs: int | None, seed: int, form: str):
    ratio = LAYER_RATIOS[layer]
    spec = LayerSpec(ratio=ratio, num_heads=num_heads, index_topk=topk, swa_block_size=swa_bs,
                     comp_block_size=comp_bs, scale=CASE_SCALE)
    layout = BatchLayout(tuple(seq_lens), tuple(query_lens))
    weights = make_weights(spec, max(seq_lens) + 1, seed)
    st = init_layer_state(spec, seq_lens, seed, poison=True)
    # donate: each intermediate state is discarded, so the caches are updated in place (same bytes)
    st = synthetic_history(spec, weights, st, [s - q for s, q in zip(seq_lens, query_lens)], seed, donate=True)
    g = torch.Generator().manual_seed(seed + 7)
    T = layout.num_tokens
    kv = torch.randn(T, HEAD_DIM, generator=g).mul(0.3).to(torch.bfloat16)
    coff = 2 if ratio == C4_RATIO else 1
    ks = torch.randn(T, 2 * coff * HEAD_DIM, generator=g) if ratio > 1 else None
    q = torch.randn(T, num_heads, HEAD_DIM, generator=g).clamp(-1, 1).to(torch.bfloat16)
    st, _ = write_tokens(spec, weights, st, layout, kv, ks, donate=True)
    res = attend(spec, weights, st, layout, q, form=form, seed=seed, run_oracle=False, build_segments=False)
    return spec, weights, st, res


def _stale_fill(idx: torch.Tensor, length: torch.Tensor, pool: torch.Tensor, salt: int) -> torch.Tensor:
    """``idx`` with every column ``>= length[t]`` replaced by a *stale valid* id from ``pool``
    (ids some valid entry of the case references, so their rows are written, finite values):
    what a reused index buffer holds past the current length (vLLM#36616). Deterministic."""
    out = idx.clone()
    if pool.numel() == 0:
        return out
    T, K = idx.shape
    col = torch.arange(K)
    for t in range(T):
        past = col >= int(length[t])
        if bool(past.any()):
            pick = (col[past] * 7 + t * 13 + salt) % pool.numel()
            out[t, past] = pool[pick].to(out.dtype)
    return out


def _valid_pool(idx: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """Sorted unique ids of the valid entries (column < length, id >= 0) of ``idx``."""
    inpre = torch.arange(idx.shape[1])[None, :] < length[:, None].to(torch.int64)
    ok = inpre & (idx >= 0)
    return torch.unique(idx[ok].to(torch.int64), sorted=True)


def decode_case(name: str, layer: str, num_heads: int, seq_lens: list[int], topk: int = 512, swa_bs: int = 64,
                comp_bs: int | None = None, seed: int = 0, invalid_tokens: tuple[int, ...] = (),
                drop_extra_for: tuple[int, ...] = (), stale_past_len: bool = False, rope_table: bool = False,
                edge: str = "") -> Case:
    """A decode case: one new token per request at ``seq_len - 1``. ``invalid_tokens``: tokens
    turned into padding rows (all ``-1``, length 0 in every segment: lonely queries);
    ``drop_extra_for``: tokens whose compressed segment is emptied (all ``-1``, length 0).
    ``stale_past_len``: every column past a segment's length (including every column of a
    length-0 row) holds a stale *valid* slot id of a written row instead of ``-1`` (vLLM reuses
    its index buffers, vLLM#36616): only the lengths exclude them. ``rope_table``: also carry
    ``cos_sin`` (the layer's RoPE table, rows ``0..max(positions)``) for consumers that
    inverse-rope their output (ROCm decode epilogue, FlashInfer RopeQuant; attention 3.3)."""
    spec, weights, st, res = _step(layer, num_heads, seq_lens, [1] * len(seq_lens), topk, swa_bs, comp_bs,
                                   seed, "decode")
    ix = res.indices
    swa_idx, swa_len = ix["swa_indices"].clone(), ix["swa_lens"].clone()
    inputs = {"q": res.q_roped, "scale": CASE_SCALE, "sink": weights.sink.to(torch.float32),
              "positions": res.positions, "swa_cache": st.swa_cache, "swa_block_size": spec.swa_block_size,
              "swa_indices": swa_idx, "swa_lens": swa_len}
    if spec.compressed:
        ex_idx, ex_len = ix["comp_indices"].clone(), ix["comp_lens"].clone()
        for t in drop_extra_for:
            ex_idx[t] = -1
            ex_len[t] = 0
        inputs.update(extra_cache=st.comp_cache, extra_block_size=spec.comp_bs, extra_indices=ex_idx,
                      extra_lens=ex_len)
    for t in invalid_tokens:
        swa_idx[t] = -1
        swa_len[t] = 0
        if spec.compressed:
            inputs["extra_indices"][t] = -1
            inputs["extra_lens"][t] = 0
    if stale_past_len:
        inputs["swa_indices"] = _stale_fill(swa_idx, swa_len, _valid_pool(swa_idx, swa_len), seed)
        if spec.compressed:
            ex_idx, ex_len = inputs["extra_indices"], inputs["extra_lens"]
            inputs["extra_indices"] = _stale_fill(ex_idx, ex_len, _valid_pool(ex_idx, ex_len), seed + 1)
    if rope_table:
        inputs["cos_sin"] = weights.cos_sin[: int(res.positions.max()) + 1].clone()
    params = {"layer": layer, "num_heads": num_heads, "seq_lens": list(seq_lens), "swa_block_size": swa_bs,
              "extra_block_size": spec.comp_bs if spec.compressed else None, "topk": topk if layer == "c4a" else None,
              "scale": CASE_SCALE, "sink_infs": [1, 2], "edge": edge, "index_rule": IndexRule.MINUS1_ONLY.value,
              "seed": seed}
    if stale_past_len:
        params["past_len"] = "stale_valid"
    if rope_table:
        params["cos_sin_rows"] = int(inputs["cos_sin"].shape[0])
    return Case(name, "decode", inputs, params)


def prefill_case(name: str, layer: str, num_heads: int, seq_lens: list[int], query_lens: list[int],
                 topk: int = 128, seed: int = 0, oob_mix: bool = False, stale_past_len: bool = False,
                 empty_tokens: tuple[int, ...] = (), edge: str = "") -> Case:
    """A prefill case on the bf16 workspace. ``oob_mix``: replace some in-prefix entries by
    ``{-2**31, -1, S, 2**31-1}`` (invalid under ANY_OUT_OF_RANGE_INVALID only). ``empty_tokens``:
    tokens given ``topk_length = 0`` (lonely queries). ``stale_past_len``: every column past
    ``topk_length`` (every column of an empty token) holds a stale *valid* workspace row id (a
    row some valid entry references: finite values) instead of ``-1`` (vLLM#36616)."""
    spec, weights, st, res = _step(layer, num_heads, seq_lens, query_lens, topk, 64, None, seed, "prefill")
    ix = res.indices
    rows = ix["workspace"].clone()
    idx = ix["combined_indices"].clone()
    ln = ix["combined_lens"].clone()
    for t in empty_tokens:
        idx[t] = -1
        ln[t] = 0
    # NaN-poison every workspace row that no valid prefix entry references
    S = rows.shape[0]
    col = torch.arange(idx.shape[1])
    inpre = col[None, :] < ln[:, None]
    ref = torch.zeros(S, dtype=torch.bool)
    ok = inpre & (idx >= 0) & (idx < S)
    ref[idx[ok].long()] = True
    rows[~ref] = float("nan")
    if stale_past_len:
        idx = _stale_fill(idx, ln, torch.nonzero(ref).reshape(-1), seed)
    if oob_mix:
        bad = [-(2**31), -1, S, 2**31 - 1]
        for t in range(idx.shape[0]):
            if int(ln[t]) >= 2:
                idx[t, int(ln[t]) - 1] = bad[t % 4]  # last prefix entry
                idx[t, 0] = bad[(t + 1) % 4]
    inputs = {"q": res.q_roped, "kv": rows, "indices": idx, "topk_length": ln, "scale": CASE_SCALE,
              "sink": weights.sink.to(torch.float32), "positions": res.positions}
    params = {"layer": layer, "num_heads": num_heads, "seq_lens": list(seq_lens), "query_lens": list(query_lens),
              "topk": topk if layer == "c4a" else None, "width": int(idx.shape[1]), "scale": CASE_SCALE,
              "edge": edge, "seed": seed,
              "index_rule": (IndexRule.ANY_OUT_OF_RANGE_INVALID.value if oob_mix else IndexRule.MINUS1_ONLY.value)}
    if stale_past_len:
        params["past_len"] = "stale_valid"
    return Case(name, "prefill", inputs, params)


@register_cases("decode")
def decode_cases() -> list[Case]:
    return [
        decode_case("h64-swa-bs64-nanpoison", "swa", 64, [5, 200, 129], seed=1,
                    edge="SWA-only; short and full windows; NaN-poisoned unreferenced slots"),
        decode_case("h128-c4a-top512-bs64-permuted", "c4a", 128, [700, 2051, 9, 1500], topk=512, seed=2,
                    rope_table=True,
                    edge="C4A top-512 (partially filled rows), shuffled block tables, sinks +-inf; cos_sin "
                         "for inverse-roping consumers"),
        decode_case("h64-c128a-bs2", "c128a", 64, [130, 520, 1000], comp_bs=2, seed=3,
                    edge="C128A on 2-entry compressed pages"),
        decode_case("h64-c4a-lonely-and-empty-extra", "c4a", 64, [300, 40, 64, 260], topk=64, seed=4,
                    invalid_tokens=(1,), drop_extra_for=(2,),
                    edge="a padding token (all -1, zero lengths: lonely) and an empty extra segment"),
        decode_case("h128-swa-bs256", "swa", 128, [1, 255, 257], swa_bs=256, seed=5, rope_table=True,
                    edge="FlashMLA MODEL1 SWA page 256; a first token (window of 1); cos_sin for "
                         "inverse-roping consumers"),
        decode_case("h64-c4a-stale-past-len", "c4a", 64, [90, 33, 120, 17, 61], topk=64, seed=6,
                    invalid_tokens=(3,), stale_past_len=True, rope_table=True,
                    edge="columns past swa_lens / extra_lens hold stale VALID slot ids (reused index "
                         "buffers, vLLM#36616); a length-0 row whose columns are all stale-valid"),
    ] + default_sweep_decode()  # page sizes, long top-k, empty main segments, magnitudes (sweep module)


@register_cases("prefill")
def prefill_cases() -> list[Case]:
    return [
        prefill_case("h64-c4a-top128-chunked", "c4a", 64, [300, 20], [3, 2], topk=128, seed=11,
                     edge="two requests with prefixes; combined compressed ++ window rows"),
        prefill_case("h128-swa-only", "swa", 128, [140, 6], [4, 3], seed=12, edge="SWA-only combined rows"),
        prefill_case("h64-c128a-oob-mix", "c128a", 64, [400, 260], [2, 3], seed=13, oob_mix=True,
                     edge="out-of-range values inside the prefix (any-oob consumers only)"),
        prefill_case("h64-c4a-stale-past-len", "c4a", 64, [100, 40, 9], [3, 2, 2], topk=128, seed=14,
                     stale_past_len=True, empty_tokens=(4,),
                     edge="columns past topk_length hold stale VALID workspace row ids (reused index "
                          "buffers, vLLM#36616); a topk_length-0 row whose columns are all stale-valid"),
    ] + default_sweep_prefill()


@register_cases("rope")
def rope_cases() -> list[Case]:
    g = torch.Generator().manual_seed(21)
    plain = cos_sin_cache(4096, theta=10000.0)
    yarn = cos_sin_cache(70000, theta=160000.0, yarn=YarnConfig(16.0, 65536))
    x1 = torch.randn(2048, HEAD_DIM, generator=g).to(torch.bfloat16)
    p1 = torch.randint(0, 4096, (2048,), generator=g)
    x2 = (torch.randn(512, HEAD_DIM, generator=g) * 3).to(torch.bfloat16)
    p2 = torch.randint(60000, 70000, (512,), generator=g)
    x3 = torch.randn(4, 8, HEAD_DIM, generator=g).to(torch.bfloat16)
    p3 = torch.tensor([0, 1, 2047, 4095])
    x4 = x1[:256].clone()
    x4[:, ROPE_OFFSET::2] = 0.0  # e = 0: e' = -o*sin exactly; also signed zeros
    x4[:8, ROPE_OFFSET:] = -0.0
    return [
        Case("plain-theta1e4-2048rows", "rope", {"x": x1, "positions": p1, "cos_sin": plain, "inverse": False},
             {"theta": 10000.0, "yarn": None, "rows": 2048, "edge": "random bf16 rows, plain table"}),
        Case("yarn-theta1.6e5-far-positions", "rope", {"x": x2, "positions": p2, "cos_sin": yarn, "inverse": False},
             {"theta": 160000.0, "yarn": [16.0, 65536], "rows": 512, "edge": "YaRN table, positions >= 60000"}),
        Case("plain-per-head-broadcast", "rope", {"x": x3, "positions": p3, "cos_sin": plain, "inverse": False},
             {"theta": 10000.0, "shape": [4, 8, 512], "edge": "[T, H, 512] with per-token positions incl. 0"}),
        Case("plain-inverse", "rope", {"x": x1[:512], "positions": p1[:512], "cos_sin": plain, "inverse": True},
             {"theta": 10000.0, "inverse": True, "edge": "inverse rotation (output epilogue form)"}),
        Case("plain-zero-lanes", "rope", {"x": x4, "positions": p1[:256], "cos_sin": plain, "inverse": False},
             {"theta": 10000.0, "edge": "zero even lanes and signed-zero rows"}),
    ]


def _o_rows(g: torch.Generator, T: int, H: int, kind: str) -> torch.Tensor:
    o = (torch.randn(T, H, HEAD_DIM, generator=g) * 0.05).to(torch.bfloat16)
    if kind == "edges":
        o[0, 0] = 0.0  # zero head: amax -> eps 1e-10 (exponent -42)
        o[0, 1] = -0.0
        o[0, 2, :128] = 1e-20  # tiny group
        o[0, 3, :128] = 0.0
        o[0, 3, 5] = 448.0 * 2.0**-6  # exact tie: a * fl32(1/448) rounds to 2**-6
        o[0, 4, 128:256] = 3.0e38 / 2**8  # huge group
        if T > 1:
            o[1, 5] = torch.linspace(-1, 1, HEAD_DIM).to(torch.bfloat16)
    return o


@register_cases("inv_rope_fp8")
def inv_rope_fp8_cases() -> list[Case]:
    g = torch.Generator().manual_seed(31)
    tab = cos_sin_cache(70000, theta=160000.0, yarn=YarnConfig(16.0, 65536))
    cases = []
    for T, H, kind, name in ((1, 64, "random", "t1-h64"), (5, 128, "random", "t5-h128-padded-scales"),
                             (3, 64, "edges", "t3-h64-zero-tiny-tie-huge"), (8, 128, "random", "t8-h128")):
        o = _o_rows(g, T, H, kind)
        pos = torch.randint(0, 70000, (T,), generator=g)
        cases.append(Case(name, "inv_rope_fp8",
                          {"o": o, "positions": pos, "cos_sin": tab, "heads_per_group": OUT_HEADS_PER_GROUP},
                          {"T": T, "H": H, "heads_per_group": OUT_HEADS_PER_GROUP, "content": kind,
                           "token_align_pad": (-T) % 4}))
    return cases


def _compressor_contract(state: torch.Tensor, positions: torch.Tensor, ratio: int, g: torch.Generator) -> dict:
    """The production compressor's paged inputs for one request whose dense ``state`` holds
    positions ``0..P-1`` and whose step tokens are the boundary ``positions`` (every token
    fires): the argument set of ``compress_norm_rope_store_triton`` as
    ``kernels/vllm_triton.compressor_args`` reads it (``V:models/deepseek_v4/compressor.py:429-523``).

    State pages of vLLM's geometry (4 entries for C4, 8 for C128) on a shuffled block table with
    one spare page of stale garbage; compressed pages of 64 (C4) / 2 (C128) entries on a shuffled
    table with one spare page, every byte initially stale (random): the kernel must write exactly
    the records of its tokens and nothing else."""
    from ..constants import production_page_stride

    P = state.shape[0]
    sbs, cbs = (4, 64) if ratio == C4_RATIO else (8, 2)
    npages = -(-P // sbs)
    perm = torch.randperm(npages + 1, generator=g)
    bt = perm[:npages].to(torch.int32).reshape(1, npages)
    state_cache = torch.randn(npages + 1, sbs, state.shape[1], generator=g) * 100.0  # stale garbage
    u = torch.arange(P)
    state_cache[bt[0, u // sbs].long(), u % sbs] = state
    pos = positions.to(torch.int64)
    ents = int(pos.max()) // ratio + 1
    cpages = -(-ents // cbs)
    cperm = torch.randperm(cpages + 1, generator=g)
    cbt = cperm[:cpages].to(torch.int64)
    cache = torch.randint(0, 256, (cpages + 1, production_page_stride(cbs)), generator=g,
                          dtype=torch.int64).to(torch.uint8)
    j = pos // ratio
    return {"state_cache": state_cache, "block_size": sbs, "block_table": bt,
            "token_to_req_indices": torch.zeros(pos.shape[0], dtype=torch.int32),
            "slot_mapping": bt[0, pos // sbs].to(torch.int64) * sbs + pos % sbs,
            "compressed_slot_mapping": cbt[j // cbs] * cbs + j % cbs,
            "cache": cache, "kv_block_size": cbs}


@register_cases("compressor")
def compressor_cases() -> list[Case]:
    g = torch.Generator().manual_seed(41)
    tab = cos_sin_cache(1024, theta=160000.0, yarn=YarnConfig(16.0, 65536))
    cases = []
    for name, ratio, P, pos, scale in (("c4-first-boundaries-masked-rows", 4, 40, [3, 7, 39], 1.0),
                                       ("c4-tiny-tile0-qa-ne-qs", 4, 24, [11, 23], 0.002),
                                       ("c128-two-entries", 128, 256, [127, 255], 1.0)):
        coff = 2 if ratio == 4 else 1
        kv = torch.randn(P, coff * HEAD_DIM, generator=g)
        for half in range(coff):  # tile 0 of every kv half scaled: small tiles after RMSNorm (H1)
            kv[:, half * HEAD_DIM: half * HEAD_DIM + 64] *= scale
        score = torch.randn(P, coff * HEAD_DIM, generator=g) * 2
        ape = torch.randn(ratio, coff * HEAD_DIM, generator=g) * 0.1
        state = build_state(kv, score, torch.arange(P), ape, ratio)
        w = (0.5 + 0.5 * torch.rand(HEAD_DIM, generator=g)).to(torch.bfloat16)
        positions = torch.tensor(pos)
        cs = tab[: max(pos) + 1].clone()  # the rows the RoPE positions p - ratio + 1 use (and more)
        inputs = {"state": state, "positions": positions, "ratio": ratio, "norm_weight": w, "eps": 1e-6,
                  "cos_sin": cs}
        kg = torch.Generator().manual_seed(4100 + len(cases))  # kernel contract: its own stream
        inputs.update(_compressor_contract(state, positions, ratio, kg))
        inputs.update(cos_sin_cache=cs, rms_norm_weight=w, rms_norm_eps=1e-6, compress_ratio=ratio)
        cases.append(Case(name, "compressor", inputs,
                          {"ratio": ratio, "rows": P, "boundaries": pos, "tile0_scale": scale, "seed": 41,
                           "state_block_size": inputs["block_size"], "kv_block_size": inputs["kv_block_size"]}))
    return cases
