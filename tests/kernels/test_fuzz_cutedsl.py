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
from dsv4_numerics.kernels.vllm.cutedsl import CUTE_C128_STATE_BLOCK

from .test_fuzz_writers import (C4_CANCEL, C4_PROD, C128_PROD, CompressorSpec, assert_compressor_within_tier,
                                compressor_expected, compressor_specs)


def cute_expected(spec: CompressorSpec):
    """``(cache, written slots, bound A)`` of the reference under the CuTe compressor's policies
    (separate RoPE multiplies, Q_S scale rule)."""
    return compressor_expected(spec, rope_arith="separate", scale_rule="scale_clamp")


def _cute_geometry(spec: CompressorSpec) -> CompressorSpec:
    if spec.ratio == 128:
        return dataclasses.replace(spec, state_block_size=CUTE_C128_STATE_BLOCK)
    return spec


@pytest.mark.needs_entry("cutedsl.compressor")
@given(spec=compressor_specs())
@example(spec=C4_PROD)
@example(spec=C128_PROD)
@example(spec=C4_CANCEL)
def test_cute_compressor_within_tier(spec):
    entry = registry.get("cutedsl.compressor")  # available: needs_entry skipped the test otherwise
    spec = _cute_geometry(spec)
    want, slots, bound = cute_expected(spec)
    case = spec.case("cuda")
    got = entry.call(case)["cache"]
    torch.cuda.synchronize()
    assert_compressor_within_tier(got, want, case.inputs["cache"], slots, spec.kv_block_size, bound, repr(spec))
