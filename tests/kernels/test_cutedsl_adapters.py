"""The CuTe-DSL compressor adapter hands the kernel only tensors at the alignment the real
kernels are compiled for (vLLM 0.33.0 ``sparse_attn_compress_cutedsl.py`` ``warmup_inputs``:
``make_fake_tensor(Int64, ..., divisibility=8)`` = 64-byte aligned positions and slot mappings,
Int32 ``divisibility=4`` = 16-byte token_to_req_indices). The case that showed it: positions and
slot mappings handed over as views at an element offset (a slice of a longer buffer), which the
adapter passed through unchanged before; the compiled kernel does not check alignment."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dsv4_numerics.kernels.vllm import cutedsl

from dsv4_numerics.kernels.vllm import triton as vllm_triton


def _offset_view(n: int, dtype, offset: int = 1) -> torch.Tensor:
    base = torch.arange(n + offset, dtype=dtype)
    return base[offset:]


def test_aligned_copies_only_misaligned_views():
    v = _offset_view(16, torch.int64)
    assert v.data_ptr() % 64 != 0
    a = cutedsl.aligned(v, 64)
    assert a.data_ptr() % 64 == 0 and torch.equal(a, v) and a.data_ptr() != v.data_ptr()
    fresh = torch.arange(16, dtype=torch.int64)
    if fresh.data_ptr() % 64 == 0:
        assert cutedsl.aligned(fresh, 64) is fresh  # no copy when already aligned
    assert cutedsl.aligned(None, 64) is None


def test_compressor_adapter_aligns_every_argument(monkeypatch):
    seen = {}
    finish_called = []

    def fake_args(inputs):
        return dict(
            state_cache=torch.zeros(2, 8, 1024), num_actual=4,
            token_to_req_indices=_offset_view(4, torch.int32), positions=_offset_view(4, torch.int64),
            slot_mapping=_offset_view(4, torch.int64), block_table=torch.zeros(1, 2, dtype=torch.int32),
            block_size=8, state_width=512, cos_sin_cache=torch.zeros(16, 64), kv_cache=torch.zeros(2, 4, 584, dtype=torch.uint8),
            k_cache_metadata=SimpleNamespace(slot_mapping=_offset_view(4, torch.int64, 3)), pdl_kwargs={},
            head_dim=512, rope_head_dim=64, compress_ratio=128, overlap=False, use_fp4_cache=False,
            rms_norm_weight=torch.ones(512, dtype=torch.bfloat16), rms_norm_eps=1e-6, quant_block=64,
            token_stride=576, scale_dim=8, _finish=lambda: finish_called.append(1) or torch.zeros(1))

    def kernel(**kw):
        seen.update(kw)

    monkeypatch.setattr(vllm_triton, "compressor_args", fake_args)
    monkeypatch.setattr(cutedsl, "cute_module", lambda name: SimpleNamespace(_SPARSE_ATTN_COMPRESSOR_CUTEDSL_KERNEL=kernel))
    cutedsl.compressor_call(SimpleNamespace(inputs={}))
    for name, nbytes in cutedsl.COMPRESSOR_ALIGN.items():
        assert seen[name].data_ptr() % nbytes == 0, name
    assert seen["k_cache_metadata"].slot_mapping.data_ptr() % 64 == 0
    assert torch.equal(seen["positions"], torch.arange(1, 5))
    assert seen["store_full_kv"] is False and seen["fp8_scale"] is None and finish_called
