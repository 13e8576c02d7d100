"""Hypothesis fuzz for the index builders that live in vLLM's engine-bound files (staged with
``dsv4-numerics stage-vllm --parts engine``): ``sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL``
and ``amd/rocm.py: compute_global_topk_ragged_indices_and_indptr``. Same harness as
``test_fuzz_indices`` (reference expected on CPU, the kernel on the GPU, the stage's judge);
skips with the entry's reason where the kernel cannot run."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from dsv4_numerics.strategies.index import batches

from .test_fuzz_indices import TOPK_INTERIOR, IndexSpec, check, topk_global_specs

RAGGED = "compute_global_topk_ragged_indices_and_indptr"


@st.composite
def swa_index_specs(draw) -> IndexSpec:
    b = draw(batches(max_seq=600, max_query=8))
    t = b.num_tokens
    valid = torch.tensor(draw(st.lists(st.booleans(), min_size=t, max_size=t)), dtype=torch.bool)
    return IndexSpec.of("compute_swa_indices_and_lens", query_start_loc=b.query_start_loc,
                        seq_lens=torch.tensor(b.seq_lens, dtype=torch.int32),
                        token_to_req_indices=b.token_to_req, is_valid_token=valid,
                        block_table=b.block_table, block_size=b.block_size,
                        window_size=draw(st.sampled_from([1, 4, 16, 128])))


@pytest.mark.needs_entry("rocm_triton.compute_global_topk_ragged_indices_and_indptr")
@given(spec=topk_global_specs())
@example(spec=TOPK_INTERIOR)
def test_compute_global_topk_ragged_indices_and_indptr(spec):
    check("rocm_triton.compute_global_topk_ragged_indices_and_indptr", "rocm_ragged", IndexSpec(RAGGED, spec.args))


@pytest.mark.needs_entry("vllm_triton.compute_swa_indices_and_lens")
@given(spec=swa_index_specs())
def test_compute_swa_indices_and_lens(spec):
    check("vllm_triton.compute_swa_indices_and_lens", "swa_indices", spec)
