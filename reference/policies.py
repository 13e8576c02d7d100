"""Named policies where production producers and consumers disagree (spec README section 3).

A policy is data, declared by a producer or consumer (kernel registry entries declare theirs) and
implemented by the reference. Values are plain strings so they serialise into JSON reports and
fixture manifests unchanged.
"""

from __future__ import annotations

from enum import Enum


class _StrEnum(str, Enum):
    def __str__(self) -> str:  # JSON/reports show the bare name
        return self.value


class ScaleRule(_StrEnum):
    """How a 64-wide tile's power-of-two scale exponent ``e`` is chosen (datapath 2.0).

    AMAX_CLAMP (Q_A): ``e = ceil(log2(fl32(max(amax, 1e-4f) / 448)))`` -- vLLM CUDA SWA writer,
        vLLM Triton writers, the indexer.
    SCALE_CLAMP (Q_S): ``e = ceil(log2(max(fl32(amax / 448), 1e-4f)))`` -- vLLM CuTe-DSL
        compressor (every compressed cache on NVIDIA), FlashMLA's test quantiser.
    They differ exactly when ``amax <= 0.02734375``.
    """

    AMAX_CLAMP = "amax_clamp"
    SCALE_CLAMP = "scale_clamp"


class Fp8Flavour(_StrEnum):
    """FP8 code format of the NoPE bytes.

    E4M3FN: OCP, max 448, 0x7F/0xFF NaN, no Inf.
    E4M3FNUZ: bias 8, max 240, 0x80 NaN, no -0 (gfx942 SWA cache; the writer clamps at 224).
    """

    E4M3FN = "e4m3fn"
    E4M3FNUZ = "e4m3fnuz"


class NonFinite(_StrEnum):
    """Producer behaviour on NaN/Inf input (datapath 2.8, H3). FINITE is the neutral contract.

    FINITE: non-finite input is out of contract; the reference raises.
    TORCH: torch cast semantics -- NaN-propagating amax, NaN -> 0x7F, +-Inf -> 0x7F/0xFF.
    CUDA_SATFINITE: vLLM CUDA writer -- NaN ignored by the tile max, NaN element -> 0xFE,
        Inf -> scale byte 255, Inf element -> 0xFE, other elements of that tile -> +-0.
    TRITON: vLLM Triton writers -- like CUDA_SATFINITE but the NaN/Inf element -> 0x7E.
    """

    FINITE = "finite"
    TORCH = "torch"
    CUDA_SATFINITE = "cuda_satfinite"
    TRITON = "triton"


class SlotSkip(_StrEnum):
    """Which negative slot-mapping values an insert skips (datapath 2.1, 2.2).

    MINUS1_ONLY: Triton ``quantize_and_insert_k_cache`` (other negatives would write out of bounds).
    ALL_NEGATIVE: CUDA writer (every negative slot is skipped).
    """

    MINUS1_ONLY = "minus1_only"
    ALL_NEGATIVE = "all_negative"


class IndexRule(_StrEnum):
    """What a consumer treats as an invalid index value (datapath 4.9, attention 2.4).

    MINUS1_ONLY: FlashMLA decode, trtllm-gen -- only -1 is invalid; other values are addresses.
    ANY_OUT_OF_RANGE_INVALID: FlashMLA prefill, ROCm Triton, SM120 -- any negative or >= N.
    """

    MINUS1_ONLY = "minus1_only"
    ANY_OUT_OF_RANGE_INVALID = "any_out_of_range_invalid"


class LseConvention(_StrEnum):
    """How a kernel returns the log-sum-exp (attention 2.2, hazard H1).

    NATURAL_SINKFREE: FlashMLA -- natural log, sink not included, +inf for an empty row.
    BASE2_SINKMERGED: FlashInfer SM120 -- base 2, sink merged, -inf for empty rows without sink.
    NONE: no LSE returned (trtllm-gen, ROCm Triton).
    """

    NATURAL_SINKFREE = "natural_sinkfree"
    BASE2_SINKMERGED = "base2_sinkmerged"
    NONE = "none"


class NanPolicy(_StrEnum):
    """NaN in a *valid* KV row (attention 2.7): FlashMLA propagates, ROCm Triton scrubs to 0."""

    PROPAGATE = "propagate"
    SCRUB = "scrub"


class RopeArithmetic(_StrEnum):
    """RoPE arithmetic (datapath H6).

    FMA: the production writers' contraction ``even' = fma(e, cos, -fl32(o*sin))``,
        ``odd' = fma(e, sin, fl32(o*cos))`` emulated exactly.
    SEPARATE: plain separate fp32 multiplies then add/sub (PyTorch, CuTe compressor).
    """

    FMA = "fma"
    SEPARATE = "separate"


class AttentionMode(_StrEnum):
    """Oracle arithmetic: EXACT fp64, or BF16_P emulation of the bf16 kernels (attention 7)."""

    EXACT = "exact"
    BF16_P = "bf16_p"
