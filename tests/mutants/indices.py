"""Mutants of the index plumbing and the V4.1 compressor / indexer stores."""

from __future__ import annotations

from typing import Any, Callable

import torch

from dsv4_numerics.oracles import stages as st
from dsv4_numerics.reference.cases import Case

from .machinery import MutantEntry, mutant, reference_entry


def _index(case: Case, **override: Any) -> dict:
    from dsv4_numerics.reference.cases.index import INDEX_BUILDERS

    fn, names = INDEX_BUILDERS[override.pop("_builder", case.params["builder"])]
    res = fn(**{**case.inputs, **override})
    return dict(zip(names, res if isinstance(res, tuple) else (res,)))


def _topk_minus1_as_local0(case: Case) -> dict:
    """``-1`` local indices mapped through the block table as local index 0 (no sentinel check,
    datapath 4.1 / H10: a valid slot of the request appears where the row is empty)."""
    if case.params["builder"] != "compute_global_topk_indices_and_lens":
        return _index(case)
    out = _index(case)
    topk = case.inputs["topk_indices"].to(torch.int64)
    zero = _index(case, topk_indices=torch.zeros_like(case.inputs["topk_indices"]))
    out["global_topk_indices"] = torch.where(topk == -1, zero["global_topk_indices"], out["global_topk_indices"])
    return out


def _topk_wrong_request_row(case: Case) -> dict:
    """Block-table row chosen by the token index instead of ``token_to_req_indices``."""
    if "token_to_req_indices" not in case.inputs:
        return _index(case)
    t2r = case.inputs["token_to_req_indices"]
    R = case.inputs["block_table"].shape[0]
    return _index(case, token_to_req_indices=(torch.arange(t2r.shape[0]) % R).to(t2r.dtype))


def _swa_lens_forced_to_window(case: Case) -> dict:
    """``swa_lens`` forced to the window size for every valid token (vLLM#41757, H18)."""
    out = _index(case)
    if "swa_lens" in out:
        ln = out["swa_lens"]
        out["swa_lens"] = torch.where(ln > 0, torch.full_like(ln, case.inputs["window_size"]), ln)
    return out


def _swa_window_off_by_one(case: Case) -> dict:
    """Window start ``p - W`` instead of ``p - (W - 1)``: one stale token in, the newest one out."""
    W = case.inputs["window_size"]
    out = _index(case, window_size=W + 1)
    if "swa_indices" in out:
        out["swa_indices"] = out["swa_indices"][:, :W]
        out["swa_lens"] = torch.clamp(out["swa_lens"], max=W)
    return out


def _combine_without_request_offset(case: Case) -> dict:
    """Request ``r``'s workspace offset ``M * r`` forgotten (every request reads request 0's rows)."""
    out = _index(case)
    if case.params["builder"] not in ("combine_topk_swa_indices", "combine_topk_swa_indices_rocm"):
        return out
    qsl = case.inputs["query_start_loc"].to(torch.int64)
    M = case.inputs["M"]
    idx = out["combined_indices"].to(torch.int64).clone()
    for r in range(qsl.shape[0] - 1):
        rows = slice(int(qsl[r]), int(qsl[r + 1]))
        idx[rows] = torch.where(idx[rows] >= 0, idx[rows] - M * r, idx[rows])
    out["combined_indices"] = idx.to(out["combined_indices"].dtype)
    return out


def _combine_common_validates(case: Case) -> dict:
    """The common combine validating ``-1`` like the ROCm twin: it must not (datapath 4.5, H10:
    the common kernel turns an interior ``-1`` into ``M*r - 1``)."""
    if case.params["builder"] == "combine_topk_swa_indices":
        return _index(case, _builder="combine_topk_swa_indices_rocm")
    return _index(case)


def _builder_with(builder: str, **override: str) -> Callable[[Case], dict]:
    """The index reference with ``override`` (named policies of ``builder``) on ``builder``'s cases;
    every other builder's cases as the reference builds them."""

    def call(case: Case) -> dict:
        return _index(case, **override) if case.params["builder"] == builder else _index(case)

    return call


def _mixed_replay_start_dropped(case: Case) -> dict:
    """vLLM's V4.1 mixed-table builder with ``replay_start`` dropped: every prefill window starts at
    ``max(p - (W-1), 0)`` as in V4, reading window KV below the request's replay start."""
    return _index(Case(case.name, case.stage, {k: v for k, v in case.inputs.items() if k != "replay_start"},
                       case.params))


def _v41_compress(case: Case, ring_head: bool = False, first_without_ring: bool = False,
                  rope_at_last: bool = False) -> dict:
    """vLLM V4.1's fused compressor (``compressor_v41``) with one rule broken: ``ring_head`` stores
    the chunk's FIRST ``capacity`` rows to the ring instead of its last; ``first_without_ring``
    pools a chunk's first group from its current row only (the ring predecessor dropped);
    ``rope_at_last`` rotates at the group's last position ``p`` instead of ``p // r * r``."""
    from dsv4_numerics.oracles.stages import v41_compress as sc
    from dsv4_numerics.reference.pipeline.compressor import compress_windows
    from dsv4_numerics.reference.pipeline.rope import cos_sin_cache

    spec = st.get("v41_compress_insert")
    pol = spec.policies({})
    e = spec.expected(case, pol)
    inp = case.inputs
    out = {"latent": e["latent"].clone(), "cache": e["cache"]}
    if "state" in e:
        out["state"] = e["state"]
    if ring_head and inp["compress_ratio"] == 2:
        state, cap = inp["state_cache"].clone(), inp["state_cache"].shape[1]
        qsl, slots = inp["query_start_loc"].tolist(), inp["state_slots"].tolist()
        for r in range(len(qsl) - 1):
            a, b = qsl[r], qsl[r + 1]
            if a < b and slots[a] >= 0:
                for u in range(a, a + min(b - a, cap)):
                    if slots[u] >= 0:
                        state[slots[u] // cap, slots[u] % cap] = inp["kv_score"][u]
        out["state"] = state
    if first_without_ring and inp["compress_ratio"] == 2:
        tok = e["_tokens"]
        first = torch.tensor([int(t) == int(inp["query_start_loc"][int(inp["token_to_req_indices"][t])])
                              for t in tok.tolist()], dtype=torch.bool)
        if bool(first.any()):
            cur = inp["kv_score"][tok[first]]
            kv = torch.stack((torch.zeros_like(cur[:, :512]), cur[:, :512]), dim=1)  # row 0 masked below
            sc_ = torch.stack((torch.zeros_like(cur[:, 512:]), cur[:, 512:]), dim=1)
            valid = torch.tensor([[False, True]]).expand(kv.shape[0], 2)
            normed = compress_windows(kv.contiguous(), sc_.contiguous(), valid.contiguous(), inp["norm_weight"],
                                      inp["eps"])
            out["latent"][tok[first]] = normed.to(torch.bfloat16)
            out["cache"] = sc.v41_compress_expected_cache(case, out["latent"], pol)
    if rope_at_last:
        shifted = Case(case.name, case.stage, dict(inp, cos_sin=cos_sin_cache(inp["cos_sin"].shape[0] + 1)[1:]),
                       case.params)
        out["cache"] = sc.v41_compress_expected_cache(shifted, out["latent"], pol)
    return out


def _v41_indexer(case: Case, rope_at_last: bool = False, nibbles_swapped: bool = False) -> dict:
    """vLLM V4.1's indexer K store (``caches.indexer_v41``) with one rule broken: RoPE at the
    group's last position instead of its first; MXFP4 nibbles swapped (even element high)."""
    from dsv4_numerics.reference.caches.indexer_v41 import insert_indexer_k
    from dsv4_numerics.reference.pipeline.rope import cos_sin_cache

    i = dict(case.inputs)
    if rope_at_last:
        i["cos_sin"] = cos_sin_cache(i["cos_sin"].shape[0] + 1)[1:]
    out = insert_indexer_k(i["cache"], i["k_pre"], i["positions"], i["cos_sin"], i["weight"], i["eps"], i["slots"],
                           i["compress_ratio"], i["record"])
    if nibbles_swapped and i["record"] == "mxfp4":
        nb, bs, rb = out.shape
        vw = rb - 4
        pages = out.reshape(nb, bs * rb)
        new = pages[:, :bs * vw] != i["cache"].reshape(nb, bs * rb)[:, :bs * vw]  # bytes the store changed
        vals = pages[:, :bs * vw]
        pages[:, :bs * vw] = torch.where(new, (vals >> 4) | (vals << 4), vals)
    return {"cache": out}


def _ring_not_wrapped(case: Case) -> dict:
    """SGLang's paged-decode SWA prefix without the ring wrap (``slot * ring_stride + abs_pos``
    instead of ``+ abs_pos % ring_stride``): reads another sequence's ring once ``pos >= ring_stride``."""
    if case.params["builder"] != "v4_paged_decode_indices":
        return _index(case)
    big = case.inputs["ring_stride"] * 1000  # no wrap for any position of the default cases
    out = _index(case, ring_stride=big)
    slots = case.inputs["state_slot_per_seq"].to(torch.int64)
    for k in ("swa_indices", "csa_indices", "hca_indices"):
        v = out[k].to(torch.int64)
        written = v >= 0
        # slot * big + abs_pos  ->  slot * ring_stride + abs_pos
        v = torch.where(written, (v // big) * case.inputs["ring_stride"] + v % big, v)
        out[k] = v.to(torch.int32)
    assert slots.numel()
    return out


MUTANTS: list[MutantEntry] = [
    mutant("topk_minus1_as_local0", "topk_global", "-1 local index mapped through the block table (H10)", _topk_minus1_as_local0),
    mutant("topk_wrong_request_row", "topk_global", "block-table row by token index, not token_to_req", _topk_wrong_request_row),
    mutant("swa_lens_forced_to_window", "swa_indices", "decode_swa_lens = window_size (vLLM#41757, H18)", _swa_lens_forced_to_window),
    mutant("swa_window_off_by_one", "swa_indices", "window start p-W instead of p-(W-1)", _swa_window_off_by_one),
    mutant("combine_missing_request_offset", "combine_prefill", "workspace offset M*r not added (datapath 4.5)",
           _combine_without_request_offset),
    mutant("combine_common_validates_minus1", "combine_prefill", "common combine modelled with the ROCm twin's -1 "
           "validation; production turns an interior -1 into M*r-1 (H10)", _combine_common_validates),
    mutant("sglang_combine_minus1_shifted", "combine_prefill", "SGLang combine shifting an interior -1 to M*r-1 like "
           "vLLM's common form; SGLang 0.5.23 writes -1 (CombineInvalidTopk)",
           _builder_with("combine_topk_swa_indices_sglang", invalid_topk="shifted_by_base"),
           invalid_topk="kept_minus1"),
    mutant("v41_combine_out_of_pool_shifted", "combine_prefill", "V4.1 combine shifting a top-k entry outside [0, N) "
           "by the request base; vLLM 0.33.0 V4.1 writes -1 (CombineInvalidTopk.BOUNDED_MINUS1)",
           _builder_with("combine_topk_swa_indices", invalid_topk="shifted_by_base", window_start="gathered"),
           invalid_topk="bounded_minus1", window_start="gathered"),
    mutant("v41_combine_window_before_gather", "combine_prefill", "V4.1 combine window not clamped to gather_start "
           "(CombineWindowStart.GATHERED, bounded replay)",
           _builder_with("combine_topk_swa_indices", invalid_topk="bounded_minus1", window_start="sequence"),
           invalid_topk="bounded_minus1", window_start="gathered"),
    mutant("v41_mixed_replay_start_dropped", "flashinfer_mixed", "V4.1 mixed table built without the SWA bounded "
           "replay (cache_utils.py:1519-1520 'no window KV exists below the request's replay start')",
           _mixed_replay_start_dropped),
    mutant("v41_compress_ring_head_stored", "v41_compress_insert", "ring keeps the chunk's first capacity rows instead "
           "of its last (fused_compress_quant_cache.py:230-244 'stores the chunk's last capacity rows to the ring')",
           lambda c: _v41_compress(c, ring_head=True)),
    mutant("v41_compress_ring_predecessor_dropped", "v41_compress_insert", "a chunk's first group pooled without the "
           "open row its predecessor left in the ring (fused_compress_quant_cache.py:186-190)",
           lambda c: _v41_compress(c, first_without_ring=True)),
    mutant("v41_compress_rope_at_group_end", "v41_compress_insert", "compressed entry rotated at the group's last "
           "position p instead of p // ratio * ratio (fused_compress_quant_cache.py:453)",
           lambda c: _v41_compress(c, rope_at_last=True)),
    mutant("v41_indexer_rope_at_group_end", "v41_indexer_k_store", "indexer key rotated at the group's last position "
           "instead of (p // ratio) * ratio (indexer_k_store.py:197-199 'group j takes position j * compress_ratio')",
           lambda c: _v41_indexer(c, rope_at_last=True)),
    mutant("v41_indexer_mxfp4_nibbles_swapped", "v41_indexer_k_store", "MXFP4 key with the even element in the high "
           "nibble (_fp32x2_to_fp4x2 operand order)", lambda c: _v41_indexer(c, nibbles_swapped=True)),
    mutant("v41_nvfp4_zero_sign", "v41_gather", "NVFP4 code 0x8 read as +0 where the entry declares -0 (E2m1Zero)",
           reference_entry("v41_gather", {"e2m1_zero": "positive"}).call),
    mutant("sglang_decode_ring_not_wrapped", "swa_indices", "SGLang paged-decode SWA offsets without the ring wrap "
           "(abs_pos % ring_stride dropped, paged_decode_indices.py:104-106)", _ring_not_wrapped),
]
