"""Hypothesis fuzz for vLLM's CuTe-DSL compressor (``cutedsl.compressor``, the writer of every
compressed cache on NVIDIA): the same specs and tolerance tier as the Triton compressor fuzz in
``test_fuzz_writers``, with the CuTe producer's declared policies -- Q_S (``scale_clamp``) and the
separate RoPE form (``x*cos - x'*sin``, datapath 2.4). The CuTe C128 path needs state pages of
exactly 8 entries (the kernel raises otherwise), so C128 specs use 8."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import example, given

from dsv4_numerics.kernels import registry
from dsv4_numerics.kernels.cutedsl import CUTE_C128_STATE_BLOCK
from dsv4_numerics.oracles.compressor_tier import compressor_error_bound
from dsv4_numerics.reference.cache_model1 import insert
from dsv4_numerics.reference.compressor import compressor_boundary
from dsv4_numerics.reference.constants import HEAD_DIM

from .test_fuzz_writers import C4_CANCEL, C4_PROD, C128_PROD, CompressorSpec, assert_compressor_within_tier, compressor_specs


def cute_expected(spec: CompressorSpec):
    """``(cache, written slots, bound A)`` of the reference under the CuTe compressor's policies."""
    inp, dense = spec.build()
    pos, slots, cs = inp["positions"], inp["slot_mapping"], inp["compressed_slot_mapping"]
    req = inp["token_to_req_indices"].long()
    fires = (slots >= 0) & ((pos + 1) % spec.ratio == 0) & (cs >= 0)
    cache, written, bounds = inp["cache"], [], []
    for r in range(len(spec.seq_lens)):
        sel = fires & (req == r)
        if not bool(sel.any()):
            continue
        b = compressor_boundary(dense[r], pos[sel], spec.ratio, inp["rms_norm_weight"], inp["rms_norm_eps"],
                                inp["cos_sin_cache"], "separate")
        cache = insert(cache, b.row_bf16, cs[sel], spec.kv_block_size, "scale_clamp")
        bounds.append(compressor_error_bound(dense[r], pos[sel], spec.ratio, inp["rms_norm_weight"],
                                             inp["rms_norm_eps"], b.normed))
        written.append(cs[sel])
    slots_w = torch.cat(written) if written else torch.zeros(0, dtype=torch.int64)
    A = torch.cat(bounds) if bounds else torch.zeros(0, HEAD_DIM, dtype=torch.float64)
    return cache, slots_w, A


def _cute_geometry(spec: CompressorSpec) -> CompressorSpec:
    if spec.ratio == 128:
        return dataclasses.replace(spec, state_block_size=CUTE_C128_STATE_BLOCK)
    return spec


@given(spec=compressor_specs())
@example(spec=C4_PROD)
@example(spec=C128_PROD)
@example(spec=C4_CANCEL)
def test_cute_compressor_within_tier(spec):
    entry = registry.get("cutedsl.compressor")
    ok, reason = entry.available()
    if not ok:
        pytest.skip(f"{entry.name}: {reason}")
    spec = _cute_geometry(spec)
    want, slots, bound = cute_expected(spec)
    case = spec.case("cuda")
    got = entry.call(case)["cache"]
    torch.cuda.synchronize()
    assert_compressor_within_tier(got, want, case.inputs["cache"], slots, spec.kv_block_size, bound, repr(spec))
