"""Default cases of the index stages (``topk_global``, ``swa_indices``, ``c128a_indices``,
``compressed_slots``, ``combine_prefill``, ``flashinfer_mixed``, ``rocm_ragged``).

Every case is small, deterministic and hand-readable. ``inputs`` uses the production argument
names, so ``builder(**case.inputs)`` runs the reference and an adapter can feed the same values to
the real kernel. ``params`` (JSON-serialisable) always holds:

- ``builder``: the name of the reference function in :data:`INDEX_BUILDERS` (one stage can have
  several production functions, e.g. the common and ROCm combine);
- ``outputs``: the names of the returned tensors, in order (production's names);
- ``edge_cases``: the edge cases exercised (``permuted-block-table``, ``odd-block-size``,
  ``padding-token``, ``window-starts-at-0``, ``interior-minus1``, ``nonzero-query-base`` ...).

:func:`run_index_case` runs the reference for a case and returns ``{output name: tensor}``.
Block tables are permutations of physical pages (never the identity), so a wrong row or column
cannot pass by accident.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..cases import Case, register_cases
from ..constants import C4_BLOCK_SIZE, C4_RATIO, C128_BLOCK_SIZE, C128_RATIO, SWA_BLOCK_SIZE, SWA_WINDOW
from ..indices.flashinfer import build_flashinfer_mixed_sparse_indices
from ..indices.prefill import (
    combine_topk_swa_indices,
    combine_topk_swa_indices_rocm,
    compute_prefill_gather_lens,
    get_prefill_chunk_plan,
    prefill_workspace_rows,
)
from ..indices.rocm import (
    build_indptr_from_lengths,
    build_prefill_topk_ragged_indices,
    build_ragged_indices_from_dense,
    compute_global_topk_ragged_indices_and_indptr,
)
from ..indices.slots import (
    abs_indices2indices_in_kvcache,
    compute_global_topk_indices_and_lens,
    get_compressed_slot_mapping,
    slots_to_request_positions,
)
from ..indices.window import build_c128a_topk_metadata, compute_swa_indices_and_lens, fill_short_context_topk_indices
from ..indices.sglang import build_swa_token_ids, combine_topk_swa_indices_sglang, v4_paged_decode_indices


def _chunk_plan_tensor(**kw: Any) -> torch.Tensor:
    """The chunk plan as an int64 ``[chunks, 4]`` tensor on the device of the inputs."""
    return torch.tensor(get_prefill_chunk_plan(**kw), dtype=torch.int64,
                        device=kw["prefill_seq_lens"].device).reshape(-1, 4)


INDEX_BUILDERS: dict[str, tuple[Callable[..., Any], tuple[str, ...]]] = {
    "compute_global_topk_indices_and_lens": (compute_global_topk_indices_and_lens,
                                             ("global_topk_indices", "topk_lens")),
    "abs_indices2indices_in_kvcache": (abs_indices2indices_in_kvcache, ("indices_in_kvcache",)),
    "slots_to_request_positions": (slots_to_request_positions, ("req", "pos")),
    "compute_swa_indices_and_lens": (compute_swa_indices_and_lens, ("swa_indices", "swa_lens")),
    "fill_short_context_topk_indices": (fill_short_context_topk_indices, ("topk_indices",)),
    "build_c128a_topk_metadata": (build_c128a_topk_metadata,
                                  ("global_decode", "decode_lens", "prefill_local")),
    "get_compressed_slot_mapping": (get_compressed_slot_mapping, ("compressed_slot_mapping",)),
    "compute_prefill_gather_lens": (compute_prefill_gather_lens, ("prefill_gather_lens",)),
    "get_prefill_chunk_plan": (_chunk_plan_tensor, ("chunk_plan",)),
    "prefill_workspace_rows": (prefill_workspace_rows, ("compressed_local", "swa_position")),
    "combine_topk_swa_indices": (combine_topk_swa_indices, ("combined_indices", "combined_lens")),
    "combine_topk_swa_indices_rocm": (combine_topk_swa_indices_rocm,
                                      ("combined_indices", "combined_lens")),
    "build_flashinfer_mixed_sparse_indices": (build_flashinfer_mixed_sparse_indices,
                                              ("sparse_indices", "sparse_topk_lens")),
    "compute_global_topk_ragged_indices_and_indptr": (
        compute_global_topk_ragged_indices_and_indptr,
        ("global_topk_ragged", "topk_indptr", "topk_lens")),
    "build_ragged_indices_from_dense": (build_ragged_indices_from_dense, ("ragged_indices", "indptr")),
    "build_prefill_topk_ragged_indices": (build_prefill_topk_ragged_indices,
                                          ("ragged_indices", "indptr")),
    "build_indptr_from_lengths": (build_indptr_from_lengths, ("indptr",)),
    "combine_topk_swa_indices_sglang": (combine_topk_swa_indices_sglang, ("combined_indices", "combined_lens")),
    "build_swa_token_ids": (build_swa_token_ids, ("swa_token_ids", "swa_first_pos", "swa_gather_lens", "swa_offsets")),
    "v4_paged_decode_indices": (v4_paged_decode_indices, ("swa_indices", "csa_indices", "hca_indices")),
}

# Builder keyword arguments that are named policies: run_index_case passes an entry's declared
# value for them (the builder's default otherwise).
INDEX_POLICY_ARGS: dict[str, tuple[str, ...]] = {
    "combine_topk_swa_indices_sglang": ("invalid_topk",),
    "combine_topk_swa_indices": ("invalid_topk", "window_start"),
}


def run_index_case(case: Case, policies: dict | None = None) -> dict[str, torch.Tensor]:
    """Run the reference builder named by ``case.params['builder']``; ``{output name: tensor}``.
    ``policies``: an entry's declared policies; those in ``INDEX_POLICY_ARGS`` of the builder are
    passed to it."""
    builder = case.params["builder"]
    fn, names = INDEX_BUILDERS[builder]
    kw = {k: str(policies[k]) for k in INDEX_POLICY_ARGS.get(builder, ()) if policies and k in policies}
    res = fn(**case.inputs, **kw)
    if isinstance(res, torch.Tensor):
        res = (res,)
    return dict(zip(names, res))


def _i32(rows: Any) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)


def _i64(rows: Any) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def _b(rows: Any) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


def _pad(row: list[int], width: int) -> list[int]:
    return row + [-1] * (width - len(row))


def _case(name: str, stage: str, builder: str, inputs: dict, edge: list[str], **params: Any) -> Case:
    p = {"builder": builder, "outputs": list(INDEX_BUILDERS[builder][1]), "edge_cases": edge}
    p.update(params)
    return Case(name, stage, inputs, p)


# --------------------------------------------------------------------------- topk_global


@register_cases("topk_global")
def topk_global_cases() -> list[Case]:
    b = "compute_global_topk_indices_and_lens"
    cases = [
        _case("c4-bs64-permuted-3req-padding", "topk_global", b, dict(
            topk_indices=_i32([
                _pad([0, 63, 64, 130], 8),
                _pad([65, 1], 8),
                _pad([200, 191, 128, 0, 255], 8),
                _pad([1, 2], 8),  # padding token: mapped, length 0
            ]),
            token_to_req_indices=_i32([0, 1, 2, 0]),
            block_table=_i32([[7, 2, 9, 0], [4, 11, 1, 0], [5, 3, 8, 6]]),
            block_size=C4_BLOCK_SIZE,
            is_valid_token=_b([True, True, True, False]),
        ), ["permuted-block-table", "padding-token", "page-boundary"], block_size=C4_BLOCK_SIZE),
        _case("c128-bs2-permuted", "topk_global", b, dict(
            topk_indices=_i32([[0, 1, 2, 3], [0, 1, 2, -1], [5, 4, -1, -1]]),
            token_to_req_indices=_i32([1, 0, 1]),
            block_table=_i32([[5, 0, 3, 8], [2, 7, 1, 4]]),
            block_size=C128_BLOCK_SIZE,
            is_valid_token=_b([True, True, True]),
        ), ["permuted-block-table", "odd-block-size"], block_size=C128_BLOCK_SIZE),
        _case("bs53-odd-permuted", "topk_global", b, dict(
            topk_indices=_i64([[52, 53, 105, 106, -1, -1, -1, -1], [0, 159, -1, -1, -1, -1, -1, -1]]),
            token_to_req_indices=_i64([0, 1]),
            block_table=_i64([[4, 0, 2, 1], [3, 6, 5, 7]]),
            block_size=53,
            is_valid_token=_b([True, True]),
        ), ["permuted-block-table", "odd-block-size", "int64-inputs"], block_size=53),
        _case("bs61-odd-permuted", "topk_global", b, dict(
            topk_indices=_i32([[60, 61, 122, -1], [121, 0, -1, -1]]),
            token_to_req_indices=_i32([0, 1]),
            block_table=_i32([[2, 5, 3], [1, 0, 4]]),
            block_size=61,
            is_valid_token=_b([True, True]),
        ), ["permuted-block-table", "odd-block-size"], block_size=61),
        _case("bs256-permuted", "topk_global", b, dict(
            topk_indices=_i32([[255, 256, 511, 0], [300, -1, -1, -1]]),
            token_to_req_indices=_i32([0, 1]),
            block_table=_i32([[3, 1], [0, 2]]),
            block_size=256,
            is_valid_token=_b([True, True]),
        ), ["permuted-block-table", "page-boundary"], block_size=256),
        _case("interior-minus1-count-not-prefix", "topk_global", b, dict(
            topk_indices=_i32([[3, -1, 70, -1], [-1, 5, -1, -1], [9, 10, -1, -1]]),
            token_to_req_indices=_i32([0, 0, 1]),
            block_table=_i32([[6, 2], [1, 4]]),
            block_size=C4_BLOCK_SIZE,
            is_valid_token=_b([True, True, True]),
        ), ["interior-minus1", "length-is-count", "permuted-block-table"], block_size=C4_BLOCK_SIZE),
        _case("negative-not-minus1-treated-empty", "topk_global", b, dict(
            topk_indices=_i32([[4, -2, 5, -1], [-7, -1, -1, -1]]),
            token_to_req_indices=_i32([1, 0]),
            block_table=_i32([[3], [2]]),
            block_size=C4_BLOCK_SIZE,
            is_valid_token=_b([True, True]),
        ), ["other-negative", "interior-minus1"], block_size=C4_BLOCK_SIZE),
        _case("flashmla-helper-bs61-permuted", "topk_global", "abs_indices2indices_in_kvcache", dict(
            abs_indices=_i32([[[0, 60, 61, -1], [122, -1, -1, -1]], [[5, 70, -1, -1], [-1, -1, -1, -1]]]),
            block_table=_i32([[4, 1, 6], [0, 5, 2]]),
            block_size=61,
        ), ["permuted-block-table", "odd-block-size", "flashmla-helper"], block_size=61),
    ]
    return cases


# --------------------------------------------------------------------------- swa_indices


@register_cases("swa_indices")
def swa_indices_cases() -> list[Case]:
    return _vllm_swa_indices_cases() + _sglang_swa_cases()


def _sglang_swa_cases() -> list[Case]:
    """SGLang 0.5.23's SWA builders (``reference.indices.sglang``)."""
    return [
        _case("sglang-swa-token-ids-3req", "swa_indices", "build_swa_token_ids", dict(
            # req 0: seq 5, extend 5 -> all 5 positions; req 1: seq 300, extend 2 -> 129 positions
            # from 171; req 2: seq 1 (decode) -> position 0; pool rows permuted
            seq_lens=_i32([5, 300, 1]),
            extend_seq_lens=_i32([5, 2, 1]),
            req_pool_indices=_i32([2, 0, 3]),
            req_to_token=(torch.arange(4 * 300, dtype=torch.int32).reshape(4, 300) * 7 + 3) % 1201,
            full_to_swa=(torch.arange(1201, dtype=torch.int64) * 5 + 11) % 997,
            swa_window=SWA_WINDOW,
        ), ["window-starts-at-0", "permuted-pool-rows", "decode-request"]),
        _case("sglang-paged-decode-ring-w8", "swa_indices", "v4_paged_decode_indices", dict(
            # ring of 10 slots per sequence (window 8 + 2 speculative); token 1 wraps the ring,
            # token 2 is short (n = 3), token 3 is CUDA-graph padding (batch id -1, untouched)
            state_slot_per_seq=_i32([4, 1, 7]),
            batch_id_per_token=_i32([0, 2, 1, -1]),
            positions=_i64([20, 13, 2, 0]),
            swa_indptr=_i32([0, 8, 16, 19, 19]),
            csa_indptr=_i32([0, 10, 20, 25, 25]),
            hca_indptr=_i32([0, 9, 17, 21, 21]),
            swa_indices=torch.full((24,), -2, dtype=torch.int32),
            csa_indices=torch.full((30,), -2, dtype=torch.int32),
            hca_indices=torch.full((26,), -2, dtype=torch.int32),
            T=4,
            win=8,
            ring_stride=10,
        ), ["ring-wrap", "window-starts-at-0", "padding-token", "ragged-indptr"]),
    ]


def _vllm_swa_indices_cases() -> list[Case]:
    b = "compute_swa_indices_and_lens"
    return [
        _case("decode-bs64-w128-window-starts-at-0-padding", "swa_indices", b, dict(
            query_start_loc=_i32([0, 1, 2, 3]),
            seq_lens=_i32([5, 200, 129]),
            token_to_req_indices=_i32([0, 1, 2, 0]),
            is_valid_token=_b([True, True, True, False]),
            block_table=_i32([[3, 0, 0, 0], [6, 2, 9, 0], [1, 4, 7, 0]]),
            block_size=SWA_BLOCK_SIZE,
            window_size=SWA_WINDOW,
        ), ["window-starts-at-0", "padding-token", "permuted-block-table", "page-boundary"],
            block_size=SWA_BLOCK_SIZE, window_size=SWA_WINDOW),
        _case("prefill-paged-bs61-token-offset", "swa_indices", b, dict(
            query_start_loc=_i32([0, 1, 2, 7]),
            seq_lens=_i32([3, 70, 130]),
            token_to_req_indices=_i32([0, 1, 2, 2, 2, 2, 2]),
            is_valid_token=_b([True, True, True, True, True, True, True]),
            block_table=_i32([[5, 0, 0], [2, 7, 0], [3, 8, 1]]),
            block_size=61,
            window_size=SWA_WINDOW,
            num_tokens=5,
            token_offset=2,
        ), ["paged-prefill", "odd-block-size", "window-starts-at-0", "permuted-block-table"],
            block_size=61, window_size=SWA_WINDOW),
        _case("window16-bs2-starts-at-0", "swa_indices", b, dict(
            query_start_loc=_i32([0, 3, 4]),
            seq_lens=_i32([3, 20]),
            token_to_req_indices=_i32([0, 0, 0, 1]),
            is_valid_token=_b([True, True, True, True]),
            block_table=_i32([[9, 4, 0, 0, 0, 0, 0, 0, 0, 0], [3, 0, 8, 1, 6, 2, 7, 5, 10, 11]]),
            block_size=2,
            window_size=16,
        ), ["window-starts-at-0", "odd-block-size", "small-window", "permuted-block-table"],
            block_size=2, window_size=16),
        _case("decode-bs256-long-context", "swa_indices", b, dict(
            query_start_loc=_i32([0, 1]),
            seq_lens=_i32([1001]),
            token_to_req_indices=_i32([0]),
            is_valid_token=_b([True]),
            block_table=_i32([[2, 0, 3, 1]]),
            block_size=256,
            window_size=SWA_WINDOW,
        ), ["page-boundary", "permuted-block-table"], block_size=256, window_size=SWA_WINDOW),
        _case("replay-start-v41-bs64", "swa_indices", b, dict(
            query_start_loc=_i32([0, 1]),
            seq_lens=_i32([150]),
            token_to_req_indices=_i32([0]),
            is_valid_token=_b([True]),
            block_table=_i32([[4, 2, 5]]),
            block_size=SWA_BLOCK_SIZE,
            window_size=SWA_WINDOW,
            replay_start=_i32([100]),
        ), ["replay-start"], block_size=SWA_BLOCK_SIZE, window_size=SWA_WINDOW),
    ]


# --------------------------------------------------------------------------- c128a_indices


@register_cases("c128a_indices")
def c128a_indices_cases() -> list[Case]:
    b = "build_c128a_topk_metadata"
    return [
        _case("c128a-decode-prefill-bs2-permuted-padding", "c128a_indices", b, dict(
            positions=_i64([127, 255, 1000, 5, 300, 126, 127, 383]),
            compress_ratio=C128_RATIO,
            num_decode_tokens=5,
            token_to_req_indices=_i32([0, 1, 2, 0, 1, 3, 3, 3]),
            block_table=_i32([[6, 1, 0, 0], [3, 9, 0, 0], [4, 8, 2, 7]]),
            block_size=C128_BLOCK_SIZE,
            slot_mapping=_i64([17, 40, 99, 3, -1, 5, 6, 7]),
            max_compressed_tokens=128,
        ), ["permuted-block-table", "padding-token", "odd-block-size", "zero-visible"],
            block_size=C128_BLOCK_SIZE),
        _case("c128a-width-capped", "c128a_indices", b, dict(
            positions=_i64([128 * 130 - 1]),
            compress_ratio=C128_RATIO,
            num_decode_tokens=1,
            token_to_req_indices=_i32([0]),
            block_table=_i32([list(range(63, -1, -1))]),
            block_size=C128_BLOCK_SIZE,
            slot_mapping=_i64([0]),
            max_compressed_tokens=128,
        ), ["width-cap", "permuted-block-table"], block_size=C128_BLOCK_SIZE),
        _case("c4-short-context-fill", "c128a_indices", "fill_short_context_topk_indices", dict(
            positions=_i64([0, 3, 4, 7, 8, 30]),
            TOP_K=8,
            COMPRESS_RATIO=C4_RATIO,
        ), ["window-starts-at-0", "zero-visible", "short-context"]),
    ]


# --------------------------------------------------------------------------- compressed_slots


@register_cases("compressed_slots")
def compressed_slots_cases() -> list[Case]:
    b = "get_compressed_slot_mapping"
    c128_tokens = 136  # positions 124 .. 259 of one request: boundaries 127 and 255
    c128_slots = list(range(1000, 1000 + c128_tokens))
    return [
        _case("c4-bs64-permuted-2req-padding-slot", "compressed_slots", b, dict(
            num_tokens=11,
            slot_mapping=_i64([10, 11, 12, 13, 14, 15, 16, -1, 18, 19, 500]),
            query_start_loc=_i32([0, 10, 11]),
            seq_lens=_i32([10, 260]),
            block_table=_i32([[3, 0, 0, 0, 0], [2, 5, 1, 7, 4]]),
            block_size=C4_BLOCK_SIZE,
            compress_ratio=C4_RATIO,
        ), ["permuted-block-table", "padding-token"], block_size=C4_BLOCK_SIZE),
        _case("c128-bs2-permuted-boundaries", "compressed_slots", b, dict(
            num_tokens=c128_tokens,
            slot_mapping=_i64(c128_slots),
            query_start_loc=_i32([0, c128_tokens]),
            seq_lens=_i32([260]),
            block_table=_i32([[4, 1]]),
            block_size=C128_BLOCK_SIZE,
            compress_ratio=C128_RATIO,
        ), ["odd-block-size", "permuted-block-table"], block_size=C128_BLOCK_SIZE),
        _case("c4-dcp2-interleave4", "compressed_slots", b, dict(
            num_tokens=16,
            slot_mapping=_i64(list(range(16))),
            query_start_loc=_i32([0, 16]),
            seq_lens=_i32([16]),
            block_table=_i32([[3, 1]]),
            block_size=2,
            compress_ratio=C4_RATIO,
            dcp_world_size=2,
            cp_interleave=4,
        ), ["dcp", "odd-block-size"], block_size=2),
    ]


# --------------------------------------------------------------------------- combine_prefill


def combine_c4_inputs() -> dict:
    # chunk of 2 prefill requests; query_start_loc has base 5 (2 decode + 3 earlier tokens)
    # request 0: seq 20, query 3 -> positions 17, 18, 19; prefix 17 -> gather 3 + min(17, 127) = 20
    # request 1: seq 140, query 4 -> positions 136..139; prefix 136 -> gather 4 + 127 = 131
    # N = max(20 // 4, 140 // 4) = 35; M = 35 + 131 = 166
    return dict(
        topk_indices=_i32([
            _pad([0, 1, 2, 3], 8), _pad([0, 1, 2, 3], 8), [4, 0, 1, 2, 3, -1, -1, -1],
            [0, 5, 33, 2, 7, 9, 11, 1],
            [0, -1, 33, 2, 7, 9, 11, 1],  # interior -1 inside topk_len = 8
            [34, 0, 1, 2, 3, 4, 5, 6],
            [0, 1, 2, 3, 4, 5, 6, 7],
        ]),
        query_start_loc=_i32([5, 8, 12]),
        seq_lens=_i32([20, 140]),
        gather_lens=_i32([20, 131]),
        window_size=SWA_WINDOW,
        compress_ratio=C4_RATIO,
        topk=8,
        M=166,
        N=35,
    )


def sglang_combine_inputs(common: dict, extra_rows: int = 0) -> dict:
    """A common-form combine case in SGLang's arguments: the same workspace (``compressed_base =
    M*r``, ``swa_base = M*r + N``), absolute ``query_pos``, ``extra_rows`` trailing rows owned by
    no request (SGLang writes them -1 with length 0)."""
    qsl, sl = common["query_start_loc"].to(torch.int64), common["seq_lens"].to(torch.int64)
    qlen = qsl[1:] - qsl[:-1]
    req = torch.repeat_interleave(torch.arange(sl.shape[0]), qlen)
    first = torch.repeat_interleave(torch.cumsum(qlen, 0) - qlen, qlen)
    pos = sl[req] - qlen[req] + torch.arange(req.numel()) - first
    topk = common["topk_indices"]
    r = torch.arange(sl.shape[0], dtype=torch.int32)
    return dict(
        topk_indices=torch.cat([topk, torch.full((extra_rows, topk.shape[1]), 7, dtype=torch.int32)]),
        query_start_loc=common["query_start_loc"],
        query_pos=torch.cat([pos, torch.full((extra_rows,), 3, dtype=torch.int64)]).to(torch.int32),
        seq_lens=common["seq_lens"],
        gather_lens=common["gather_lens"],
        compressed_base=r * common["M"],
        swa_base=r * common["M"] + common["N"],
        window_size=common["window_size"],
        compress_ratio=common["compress_ratio"],
        topk=common["topk"],
    )


@register_cases("combine_prefill")
def combine_prefill_cases() -> list[Case]:
    edge = ["nonzero-query-base", "interior-minus1", "window-starts-at-0"]
    return [
        _case("c4-common-base5-interior-minus1", "combine_prefill", "combine_topk_swa_indices",
              combine_c4_inputs(), edge + ["divergence-minus1-to-M*r-1"], form="common"),
        _case("c4-rocm-base5-interior-minus1", "combine_prefill", "combine_topk_swa_indices_rocm",
              combine_c4_inputs(), edge, form="rocm"),
        _case("c4-sglang-base5-interior-minus1-pad-row", "combine_prefill", "combine_topk_swa_indices_sglang",
              sglang_combine_inputs(combine_c4_inputs(), extra_rows=1), edge + ["padding-token"], form="sglang"),
        _case("c4-bounded-replay-out-of-pool", "combine_prefill", "combine_topk_swa_indices", dict(
            # one request, seq 200, query 2 (positions 198, 199), replay from 138: gather 62 < W, so
            # the window max(p - 127, 0) = 71, 72 starts before gather_start = 138; N = 200 // 4 = 50,
            # M = 50 + 62; top-k entries 60 and 63 lie past N (out of the compressed pool), -1 inside
            topk_indices=_i32([[0, 60, 2, -1, 4, 5, 6, 7], [0, 1, 2, 3, 63, 5, -1, 49]]),
            query_start_loc=_i32([0, 2]),
            seq_lens=_i32([200]),
            gather_lens=_i32([62]),
            window_size=SWA_WINDOW,
            compress_ratio=C4_RATIO,
            topk=8,
            M=112,
            N=50,
        ), ["out-of-pool-topk", "window-before-gather-start"], form="common"),
        _case("swa-only-topk0-common", "combine_prefill", "combine_topk_swa_indices", dict(
            topk_indices=_i32([[-1]] * 3),
            query_start_loc=_i32([0, 2, 3]),
            seq_lens=_i32([2, 130]),
            gather_lens=_i32([2, 128]),
            window_size=SWA_WINDOW,
            compress_ratio=1,
            topk=0,
            M=130,
            N=0,
        ), ["window-starts-at-0", "swa-only"], form="common"),
        _case("c128-common-bs2-local-rows", "combine_prefill", "combine_topk_swa_indices", dict(
            # positions 254, 255 -> (p+1)//128 = 1, 2 visible C128 entries (build_c128a prefill rows)
            topk_indices=_i32([_pad([0], 128), _pad([0, 1], 128)]),
            query_start_loc=_i32([3, 5]),
            seq_lens=_i32([256]),
            gather_lens=_i32([129]),
            window_size=SWA_WINDOW,
            compress_ratio=C128_RATIO,
            topk=128,
            M=131,
            N=2,
        ), ["nonzero-query-base", "c128a"], form="common"),
        _case("gather-lens-decodes-first-replay", "combine_prefill", "compute_prefill_gather_lens", dict(
            seq_lens=_i32([50, 7, 300, 140]),
            query_start_loc=_i32([0, 1, 5, 15, 19]),
            replay_start=_i32([0, 0, 250, 0]),
            num_prefills=3,
            num_decodes=1,
            window_size=SWA_WINDOW,
        ), ["replay-start", "window-starts-at-0"]),
        _case("chunk-plan-3req", "combine_prefill", "get_prefill_chunk_plan", dict(
            prefill_seq_lens=_i32([20, 140, 1000]),
            prefill_query_lens=_i32([3, 4, 900]),
            compress_ratio=C4_RATIO,
            prefill_chunk_size=1,
            prefill_max_model_len=1024,
            prefill_window_size=SWA_WINDOW,
            prefill_max_num_batched_tokens=64,
        ), ["chunk-split"]),
        _case("workspace-rows-c4", "combine_prefill", "prefill_workspace_rows", dict(
            seq_lens=_i32([20, 140]),
            gather_lens=_i32([20, 131]),
            compress_ratio=C4_RATIO,
            N=35,
            M=166,
        ), ["workspace-layout"]),
    ]


# --------------------------------------------------------------------------- flashinfer_mixed


def _fi_c4_inputs() -> dict:
    # 2 decode tokens (token 1 is CUDA-graph padding), then one prefill request with 3 tokens.
    # requests: 0 = decode (seq 70), 1 = padding request (seq 0), 2 = prefill (seq 9, query 3)
    w = 4  # small window (a parameter) keeps the rows readable
    return dict(
        decode_swa_indices=_i32([[200, 201, 202, 203], [-1, -1, -1, -1]]),
        decode_compressed_indices=_i32([[0, 16, -1, 5, -1, -1], [1, 2, -1, -1, -1, -1]]),
        decode_compressed_topk_lens=None,
        prefill_topk_indices=_i32([[0, -1, -1, -1, -1, -1], [0, 1, -1, -1, -1, -1], [1, 0, -1, -1, -1, -1]]),
        query_start_loc=_i32([0, 1, 2, 5]),
        seq_lens=_i32([70, 0, 9]),
        token_to_req_indices=_i32([0, 1, 2, 2, 2]),
        swa_block_table=_i32([[9, 3], [0, 0], [5, 7]]),
        swa_block_size=8,
        compressed_block_table=_i32([[2, 6, 4], [0, 0, 0], [3, 1, 0]]),
        compressed_block_size=C4_BLOCK_SIZE // 8,
        window_size=w,
        compress_ratio=C4_RATIO,
        topk=6,
        decode_compressed_indices_are_local=True,
        decode_is_valid_token=_b([True, False]),
    )


@register_cases("flashinfer_mixed")
def flashinfer_mixed_cases() -> list[Case]:
    b = "build_flashinfer_mixed_sparse_indices"
    packed = _fi_c4_inputs()
    packed.update(swa_block_span=10, compressed_block_span=9)
    return [
        _case("c4-local-decode-prefill-permuted-padding", "flashinfer_mixed", b, _fi_c4_inputs(),
              ["permuted-block-table", "padding-token", "window-starts-at-0", "interior-minus1"],
              window_size=4),
        _case("c4-packed-page-span", "flashinfer_mixed", b, packed,
              ["block-span-remap", "permuted-block-table"], window_size=4),
        _case("c128-global-with-lens-bs2", "flashinfer_mixed", b, dict(
            decode_swa_indices=_i32([[10, 11, 12, -1]]),
            decode_compressed_indices=_i32([[6, 7, 2, -1, -1]]),
            decode_compressed_topk_lens=_i32([3]),
            prefill_topk_indices=_i32([[0, 1, 2, -1, -1], [0, 1, 2, 3, -1]]),
            query_start_loc=_i32([0, 1, 3]),
            seq_lens=_i32([3, 512]),
            token_to_req_indices=_i32([0, 1, 1]),
            swa_block_table=_i32([[5, 0, 0, 0, 0, 0, 0, 0], [7, 6, 5, 4, 3, 2, 1, 0]]),
            swa_block_size=SWA_BLOCK_SIZE,
            compressed_block_table=_i32([[3, 1, 0], [2, 0, 1]]),
            compressed_block_size=C128_BLOCK_SIZE,
            window_size=4,
            compress_ratio=C128_RATIO,
            topk=5,
        ), ["odd-block-size", "permuted-block-table", "c128a"], window_size=4),
        _case("swa-only-no-compressed", "flashinfer_mixed", b, dict(
            decode_swa_indices=_i32([[3, 4, -1, -1]]),
            decode_compressed_indices=None,
            decode_compressed_topk_lens=None,
            prefill_topk_indices=_i32([[-1], [-1]]),
            query_start_loc=_i32([0, 1, 3]),
            seq_lens=_i32([2, 6]),
            token_to_req_indices=_i32([0, 1, 1]),
            swa_block_table=_i32([[2, 0, 0], [1, 3, 5]]),
            swa_block_size=2,
            compressed_block_table=None,
            compressed_block_size=2,
            window_size=4,
            compress_ratio=1,
            topk=0,
        ), ["swa-only", "window-starts-at-0"], window_size=4),
        _case("dspark-noncausal-decode", "flashinfer_mixed", b, dict(
            decode_swa_indices=_i32([[100, 101, 102, 103, 104, -1], [100, 101, 102, 103, 104, -1],
                                     [-1, -1, -1, -1, -1, -1]]),
            decode_compressed_indices=None,
            decode_compressed_topk_lens=None,
            prefill_topk_indices=torch.zeros((0, 1), dtype=torch.int32),
            query_start_loc=_i32([0, 2, 2]),
            seq_lens=_i32([5, 0]),
            token_to_req_indices=_i32([0, 0, 1]),
            swa_block_table=_i32([[0]]),
            swa_block_size=64,
            compressed_block_table=None,
            compressed_block_size=64,
            window_size=4,
            compress_ratio=1,
            topk=0,
        ), ["dspark-noncausal", "padding-token"], window_size=4),
        _case("v41-replay-start-c4", "flashinfer_mixed", b, _fi_replay_inputs(),
              ["replay-start", "replay-at-first-query-token", "replay-below-window", "permuted-block-table"],
              window_size=8),
    ]


def _fi_replay_inputs() -> dict:
    """DeepSeek-V4.1 SWA bounded replay (``replay_start`` per request) on a decode-first batch.
    Requests: 0 decode (seq 30); 1 prefill positions 16..19, replay from 14 (inside the window of
    every token: windows cut to 14..p); 2 prefill positions 3..5, replay from 3 (= the first query
    position: that token's window is itself only); 3 prefill positions 38..39, replay from 5 (below
    the window: no effect, the V4 rows)."""
    return dict(
        decode_swa_indices=_i32([[40, 41, 42, 43, 44, 45, 46, 47]]),
        decode_compressed_indices=_i32([[9, 3, 12, -1, -1, -1]]),
        decode_compressed_topk_lens=_i32([3]),
        prefill_topk_indices=_i32([[0, 3, -1, 1, 2, -1], [4, 0, 2, 1, 3, -1], [1, 0, 2, 3, 4, -1],
                                   [0, 2, 1, 3, 4, -1], [0, -1, -1, -1, -1, -1], [0, -1, -1, -1, -1, -1],
                                   [0, 1, -1, -1, -1, -1], [9, 0, 5, 7, 3, 8], [9, 8, 7, 6, 5, 4]]),
        query_start_loc=_i32([0, 1, 5, 8, 10]),
        seq_lens=_i32([30, 20, 6, 40]),
        token_to_req_indices=_i32([0, 1, 1, 1, 1, 2, 2, 2, 3, 3]),
        swa_block_table=_i32([[3, 8, 1, 0, 0, 0, 0, 0, 0, 0], [6, 2, 9, 4, 11, 0, 0, 0, 0, 0],
                              [7, 5, 0, 0, 0, 0, 0, 0, 0, 0], [12, 13, 14, 15, 16, 17, 18, 19, 10, 20]]),
        swa_block_size=4,
        compressed_block_table=_i32([[2, 5], [1, 0], [3, 4], [6, 7]]),
        compressed_block_size=8,
        window_size=8,
        compress_ratio=C4_RATIO,
        topk=6,
        replay_start=_i32([0, 14, 3, 5]),
    )


# --------------------------------------------------------------------------- rocm_ragged


@register_cases("rocm_ragged")
def rocm_ragged_cases() -> list[Case]:
    return [
        _case("positional-interior-minus1-bs64", "rocm_ragged", "compute_global_topk_ragged_indices_and_indptr", dict(
            topk_indices=_i32([[3, -1, 70, -1], [1, 2, 3, -1], [5, -1, -1, -1]]),
            token_to_req_indices=_i32([0, 1, 0]),
            block_table=_i32([[6, 2], [1, 4]]),
            block_size=C4_BLOCK_SIZE,
            is_valid_token=_b([True, True, False]),
        ), ["interior-minus1", "padding-token", "positional"], block_size=C4_BLOCK_SIZE),
        _case("compacting-from-dense-num-rows", "rocm_ragged", "build_ragged_indices_from_dense", dict(
            indices=_i32([[7, -1, 3, 12, 5], [-1, -1, 0, 1, 2], [4, 4, 4, 4, 4]]),
            lengths=_i32([5, 4, 0]),
            num_rows=10,
        ), ["interior-minus1", "out-of-range", "compacting"]),
        _case("prefill-topk-ragged-token-offset", "rocm_ragged", "build_prefill_topk_ragged_indices", dict(
            topk_indices=_i32([[0, 1, -1, 2], [2, -1, 0, 1], [1, 0, 9, 2]]),
            token_to_req_indices=_i32([0, 1, 1, 1, 1]),
            query_start_loc=_i32([0, 1, 5]),
            seq_lens=_i32([4, 12]),
            is_valid_token=_b([True, True, True, False, True]),
            block_table=_i32([[3, 0], [5, 2]]),
            block_size=2,
            compress_ratio=C4_RATIO,
            num_compressed=3,
            token_offset=2,
        ), ["interior-minus1", "padding-token", "odd-block-size", "compacting"], block_size=2),
        _case("indptr-from-lengths", "rocm_ragged", "build_indptr_from_lengths", dict(
            lengths=_i32([3, 0, 2, 5]),
        ), ["zero-length"]),
    ]
