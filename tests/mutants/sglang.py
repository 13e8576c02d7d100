"""Mutants of SGLang 0.5.23's JIT / TileLang kernels."""

from __future__ import annotations

from dsv4_numerics.oracles import stages as st

from .machinery import MutantEntry, entry_outputs, layout_mutant, mutant, reference_entry




MUTANTS: list[MutantEntry] = [
    mutant("sglang_padded_page_stride", "swa_write", "pages addressed at SGLang's kv_page_bytes (bs*584 rounded up "
           "to 576, kv_layout.cuh:111-115) instead of cache.stride(0) on an unpadded cache", layout_mutant("sglang_padded")),
    mutant("sglang_requant_gather_values_kept", "gather", "the Q8KV8 FP8 workspace holding the exact dequantised values "
           "(a bf16 workspace) where gather_dequant_requant_fp8_paged_dsv4 re-encodes them as unit-scale E4M3 "
           "(dequant_k_cache.py:458-462)", lambda c: entry_outputs(st.get("gather").expected(c, st.get("gather").policies({}))),
           gather_out="e4m3_requant"),
    mutant("sglang_norm_rope_store_negative_slot_skipped", "kv_norm_rope_store", "SGLang's uniform-FP8 store skipping a "
           "negative slot like the CUDA writers; kv_norm_rope_store.py:45-47 wraps it to CACHE_ROWS + slot (PyTorch's index)",
           reference_entry("kv_norm_rope_store", {"slot_skip": "all_negative"}).call, slot_skip="negative_wraps"),
    mutant("sglang_norm_rope_store_torch_cast", "kv_norm_rope_store", "normed rows cast to E4M3 by torch 2.11's cast "
           "(overflow -> NaN, the 'old path') where the Triton store saturates to 448",
           reference_entry("kv_norm_rope_store", {"slot_skip": "negative_wraps", "nonfinite": "torch"}).call,
           slot_skip="negative_wraps"),
    mutant("fp8_exp0_read_as_normal", "decode", "exponent-0 FP8 codes (zero included) read as (1 + m/8) * 2**-7 times the "
           "scale (SGLang's TileLang decode, vLLM's CPU decode) where the consumer reads them exactly",
           reference_entry("decode", {"fp8_decode": "exp0_as_normal"}).call),
]
