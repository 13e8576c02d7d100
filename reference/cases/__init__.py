"""Canonical sample inputs ("cases") shared by the kernel matrix, the mutation suite, the
fixtures and the CLI -- the OpInfo ``sample_inputs`` of this suite.

A ``Case`` is a named, deterministic set of canonical inputs for one *stage* of the pipeline.
Case builders live beside the reference code of their stage (``cases_cache``, ``cases_index``,
``cases_attention``) and are collected here by stage name.

Stage names (the vocabulary shared by reference, oracles, kernels, fixtures and tests):

  bytes stages  swa_write         bf16 K [N,512] + slots -> 584-byte paged cache bytes (SWA writer)
                compressed_write  bf16 pre-quantisation compressed rows -> 584-byte cache bytes
                plain_write       bf16 K -> plain bf16 / per-tensor FP8 rows
                gather            584-byte cache + block table -> dequantised bf16 rows
                v41_write         bf16 K -> V4.1 528-byte MXFP8 / 288-byte NVFP4 records
                v41_gather        V4.1 cache + block table -> dequantised bf16 rows
                inv_rope_fp8      bf16 attention output -> inverse RoPE + FP8 group-major codes/scales
  index stages  topk_global       local top-k -> global slots + lengths
                swa_indices       SWA window indices + lengths (decode / paged prefill)
                c128a_indices     C128A visibility table
                compressed_slots  compressed write slot mapping
                combine_prefill   prefill combine of top-k and window (common and ROCm forms)
                flashinfer_mixed  FlashInfer trtllm-gen mixed table
                rocm_ragged       ROCm ragged streams + indptr
  numeric       rope              RoPE forward/inverse on dims 448..511
                compressor        state rows -> compressed fp32 rows
                v41_compress_insert DeepSeek-V4.1 fused compressor: kv/score rows + ring state -> bf16
                                  latent, updated ring, compressed records (MXFP8 / NVFP4 / 584 B / plain)
                decode            sparse attention, decode form (main + extra segments)
                prefill           sparse attention, prefill form (one combined segment)
                v32_decode        DeepSeek V3.2 sparse decode (656-byte cache)
                dense_mla_decode  dense paged MLA decode (R1/V3/Kimi)
                dense_mla_prefill dense ragged causal MHA prefill (R1 per-head dims 192/128; TokenSpeed)
                v41_sparse_decode DeepSeek-V4.1 sparse decode (MXFP8 528 B SWA + MXFP8/NVFP4 compressed)
                v41_sparse_prefill DeepSeek-V4.1 prefill over the workspace gathered from the V4.1 caches
  bytes         v41_indexer_k_store DeepSeek-V4.1 indexer K: bf16 k_pre -> norm, RoPE, FP8 / MXFP4 paged records
  bytes         v41_query_quant   DeepSeek-V4.1 query quantiser (MXFP8 q, F8_128x4 scales, normed kv)
                kv_norm_rope_store  kv RMSNorm + RoPE -> unit-scale E4M3 rows of a plain pool (SGLang)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class Case:
    """One named, deterministic input set for a stage.

    name:   readable test id, e.g. ``"bs64-stride37440-permuted-tiny"``
    stage:  one of the stage names above
    inputs: canonical inputs (CPU tensors and plain values); the runner moves tensors to a device
    params: JSON-serialisable description (shapes, seed, policies, edge cases exercised)
    """

    name: str
    stage: str
    inputs: dict[str, Any]
    params: dict[str, Any] = field(default_factory=dict)

    def to(self, device: str | torch.device) -> "Case":
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.inputs.items()}
        return Case(self.name, self.stage, moved, dict(self.params))


CaseBuilder = Callable[[], list[Case]]
_BUILDERS: dict[str, CaseBuilder] = {}
_FULL_BUILDERS: dict[str, CaseBuilder] = {}
# Case-set sizes: "default" (CPU-sized: CI, check) and "full" (every dimension the production
# kernels' own tests vary, for a GPU runner; a stage without a full builder uses its default set).
CASE_SIZES = ("default", "full")


def register_cases(stage: str, size: str = "default") -> Callable[[CaseBuilder], CaseBuilder]:
    """Decorator: register the ``size`` (``"default"`` or ``"full"``) case builder of ``stage``."""
    if size not in CASE_SIZES:
        raise ValueError(f"register_cases: size must be one of {list(CASE_SIZES)}, got {size!r}")

    def deco(fn: CaseBuilder) -> CaseBuilder:
        (_FULL_BUILDERS if size == "full" else _BUILDERS)[stage] = fn
        return fn

    return deco


def _load_builders() -> None:
    import importlib

    for mod in ("cache", "index", "attention", "attention_sweep", "mla", "v41",
                "v41_attention", "v41_compress", "v41_indexer", "sglang"):
        try:
            importlib.import_module(f"{__package__}.{mod}")
        except ModuleNotFoundError as e:  # a builder module not written yet
            if e.name != f"{__package__}.{mod}":
                raise


def default_cases(stage: str) -> list[Case]:
    """The default (CPU-sized) case set of ``stage``; deterministic on every call and machine."""
    _load_builders()
    if stage not in _BUILDERS:
        raise KeyError(f"no default cases registered for stage '{stage}' (known: {sorted(_BUILDERS)})")
    return _BUILDERS[stage]()


def stage_cases(stage: str, size: str = "default") -> list[Case]:
    """The ``size`` case set of ``stage`` (:data:`CASE_SIZES`): ``"default"`` is
    :func:`default_cases`; ``"full"`` is the stage's full builder (which includes its default
    cases) or, for a stage without one, its default set. Raises ``KeyError`` like ``default_cases``."""
    if size not in CASE_SIZES:
        raise KeyError(f"unknown case-set size {size!r} (known: {list(CASE_SIZES)})")
    _load_builders()
    if size == "full" and stage in _FULL_BUILDERS:
        return _FULL_BUILDERS[stage]()
    return default_cases(stage)


def has_full_cases(stage: str) -> bool:
    """Whether ``stage`` has a full case set of its own (else ``size="full"`` is its default set)."""
    _load_builders()
    return stage in _FULL_BUILDERS


def stages_with_cases() -> list[str]:
    _load_builders()
    return sorted(_BUILDERS)
