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
    VLLM_CPU: vLLM's CPU writer (``vllm-cpu`` 0.32.0 ``_C::fused_qnorm_rope_kv_insert_cpu``,
        measured, no source published): the tile amax is an x86 ``maxps`` tree
        (``quant.maxps_tree_amax``), so a NaN is ignored or propagated by its position (a NaN at
        element 51 of a tile makes the whole tile NaN); a NaN element -> 0x7E as TRITON; a tile
        whose amax is NaN or Inf gets scale byte 127 (exponent 0), not 255, and codes 0x7E for
        every element of a NaN tile, +-0 / 0x7E for the finite / Inf elements of an Inf tile.
    TORCH_SATURATING: torch 2.13's ``float8_e4m3fn`` cast (torch changed the cast between 2.11 and
        2.13; TORCH is the 2.11 cast: ``|v|`` rounding to >= 480, +-Inf, NaN -> ``0x7F|sign``): finite
        overflow and +-Inf -> ``0x7E|sign``, NaN -> ``0x7F|sign``.
    SGLANG_JIT: SGLang 0.5.23's JIT-CUDA V4 store (``fused_store_flashmla_cache``,
        ``SG:kernels/jit/csrc/deepseek_v4/store.cuh:47-80``, helpers
        ``SG:kernels/jit/include/sgl_kernel/deepseek_v4/fp8_utils.cuh:26-45``). The tile amax is a
        NaN-ignoring ``fmaxf`` / ``redux.sync.max.f32`` (as CUDA_SATFINITE); the element clamp is
        ``fmaxf(fminf(v, M), -M)``, so a NaN becomes ``+M`` (0x7E) whatever its sign. An Inf tile gets
        scale byte 255 and the inverse scale ``__uint_as_float((254 - 255) << 23)`` = ``-Inf``: every
        element is multiplied by ``-Inf`` before the clamp, so a positive (or +Inf) element -> 0xFE,
        a negative (or -Inf) element -> 0x7E, and +-0 and NaN (``0 * -Inf`` = NaN) -> 0x7E.
    """

    FINITE = "finite"
    TORCH = "torch"
    CUDA_SATFINITE = "cuda_satfinite"
    TRITON = "triton"
    TORCH_SATURATING = "torch_saturating"
    VLLM_CPU = "vllm_cpu"
    # SGLang 0.5.23 JIT-CUDA V4 store (block below the enum's users; ``SG:`` = the sglang wheel).
    SGLANG_JIT = "sglang_jit"


class Fp8Subnormals(_StrEnum):
    """What an FP8 tile encoder does with a scaled value below the smallest normal (E4M3FN
    ``|y| < 2**-6``, E4M3FNUZ ``|y| < 2**-7``).

    KEEP: OCP encoding, RNE onto the subnormal codes ``m * 2**-9`` (every GPU writer, torch).
    FLUSH: the value becomes a signed zero (0x80 / 0x00; FNUZ has no -0: 0x00), including values
        that RNE would round up to the smallest normal -- vLLM's CPU writer (``vllm-cpu`` 0.32.0,
        measured: every code 0x01..0x08 / 0x81..0x88 that RNE gives for ``|y| < 2**-6`` is 0x00 / 0x80).
    """

    KEEP = "keep"
    FLUSH = "flush"


class Fp8Decode(_StrEnum):
    """How a reader turns FP8 codes whose exponent field is 0 (+-0 and the subnormals) into values.

    EXACT: the OCP values (+-0, ``m * 2**(1 - bias - 3)``): every GPU reader, torch.
    EXP0_AS_NORMAL: read as if normal, ``(1 + m/8) * 2**(1 - bias - 1)`` -- E4M3FN ``(1 + m/8) * 2**-7``,
        so a zero code reads as ``2**-7`` times the tile scale -- vLLM's CPU sparse attention
        (``vllm-cpu`` 0.32.0 ``_C::flash_mla_with_kvcache_cpu``, measured on all 254 non-NaN
        codes: exactly the 16 codes 0x00..0x07 / 0x80..0x87 differ, each as this formula says).
    """

    EXACT = "exact"
    EXP0_AS_NORMAL = "exp0_as_normal"


class MissingLengths(_StrEnum):
    """What a consumer reads when a row's top-k length is not given.

    ALL_COLUMNS: every column of the row, ``-1`` (or any invalid index) masked wherever it
        stands -- the canonical meaning of an absent length (attention 2.4).
    COUNT_AS_PREFIX: the number of non-negative indices of the row taken as a prefix length, so
        a row with interior ``-1`` loses its valid indices past that count -- vLLM 0.33.0's
        ROCm Triton prefill wrapper (``V:v1/attention/ops/rocm_aiter_mla_sparse.py:3622-3627``,
        ``_rocm_sparse_attn_prefill_triton``: ``(indices >= 0).sum(-1)`` as ``topk_length``); the
        count-used-as-prefix class of spec README 6.
    """

    ALL_COLUMNS = "all_columns"
    COUNT_AS_PREFIX = "count_as_prefix"


class SlotSkip(_StrEnum):
    """Which negative slot-mapping values an insert skips (datapath 2.1, 2.2).

    MINUS1_ONLY: Triton ``quantize_and_insert_k_cache`` (other negatives would write out of bounds).
    ALL_NEGATIVE: CUDA writer (every negative slot is skipped).
    NEGATIVE_WRAPS: NO slot is skipped; a negative slot ``s`` in ``[-capacity, -1]`` writes slot
        ``capacity + s`` (the last rows of the pool); ``s < -capacity`` is out of bounds -- SGLang
        0.5.23 ``kv_norm_rope_store.fused_k_norm_rope_uniform_fp8`` (``SG:kernels/ops/attention/
        dsv4/kv_norm_rope_store.py:45-47``, "Preserve PyTorch indexed assignment's negative-index
        interpretation").
    """

    MINUS1_ONLY = "minus1_only"
    ALL_NEGATIVE = "all_negative"
    NEGATIVE_WRAPS = "negative_wraps"


class GatherOutput(_StrEnum):
    """What a dequantise-gather writes into its workspace (datapath 3, 4.5).

    BF16: the exact bf16 dequantisation (every vLLM / FlashMLA / SGLang bf16 gather).
    E4M3_REQUANT: each dequantised fp32 value re-encoded as a unit-scale E4M3FN code, RNE with
        saturation (``cvt.rn.satfinite``: finite overflow and +-Inf -> +-448, NaN -> NaN); the RoPE
        dims' bf16 values likewise -- SGLang 0.5.23 ``gather_dequant_requant_fp8_paged_dsv4``
        (``SG:kernels/ops/attention/dsv4/dequant_k_cache.py:172-236``, the Q8KV8 prefill's FP8
        workspace). The canonical ``out`` holds those E4M3 values as bf16 (exact).
    """

    BF16 = "bf16"
    E4M3_REQUANT = "e4m3_requant"


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
    """NaN in a *valid* KV row (attention 2.7).

    PROPAGATE: the NaN reaches the output of every query that attends to the row (FlashMLA).
    SCRUB: the row's NaN values are read as 0 (ROCm Triton).
    """

    PROPAGATE = "propagate"
    SCRUB = "scrub"


class RopeArithmetic(_StrEnum):
    """RoPE arithmetic (datapath H6).

    FMA: the production writers' contraction ``even' = fma(e, cos, -fl32(o*sin))``,
        ``odd' = fma(e, sin, fl32(o*cos))`` emulated exactly.
    SEPARATE: plain separate fp32 multiplies then add/sub (PyTorch, CuTe compressor).
    FMA_TRITON: the Triton contraction, where the *first* product written in each expression is
        fused (compressor forward ``odd*cos + even*sin`` -> ``fma(o, cos, fl32(e*sin))``;
        ``fused_inv_rope_fp8_quant`` ``x*cos +- x'*sin`` -> ``fma(x, cos, +-fl32(x'*sin))``;
        ``reference/pipeline/rope.py`` documents the exact formulas).
    """

    FMA = "fma"
    SEPARATE = "separate"
    FMA_TRITON = "fma_triton"


class AttentionMode(_StrEnum):
    """Oracle arithmetic (attention 7).

    EXACT: the float64 oracle alone.
    BF16_P: the kernel rounds the softmax weights ``P`` to bf16 before ``P.V``; the judge also
        applies the three-output rule against the oracle's bf16-P emulation.
    """

    EXACT = "exact"
    BF16_P = "bf16_p"


class Ue8m0Consumer(_StrEnum):
    """How a consumer turns a UE8M0 scale byte into a multiplier (datapath 3 table, hazard H4).

    All consumers agree on bytes 1..254 (``2**(b - 127)`` exactly); they differ on 0 and 255:

    EXACT:       OCP MX E8M0 definition: 0 -> 2**-127, 255 -> NaN (torch.float8_e8m0fnu agrees).
    FLASHMLA:    ``__nv_cvt_e8m0x2_to_bf162raw`` (FlashMLA SM90/SM100 MODEL1 decode):
                 0 -> 2**-127 (bf16 0x0040), 255 -> NaN (bf16 0x7FFF).
    SM120:       FlashInfer SM120 ``cvt.rn.bf16x2.ue8m0x2``: same as FLASHMLA.
    TRITON:      vLLM Triton ``dequantize_and_gather_k_cache``: ``exp2(s - 127)`` with
                 ``ex2.approx.ftz``: 0 -> 0.0 (flushed), 255 -> +Inf.
    ROCM_TRITON: vLLM ROCm Triton decode, ``exp2(s - 127)`` -> bf16: same as TRITON.
    CUTE:        vLLM CuTe-DSL ``DequantGatherKCacheKernel``: bf16 bits ``s << 7``: 0 -> +0.0, 255 -> +Inf.
    ROCM_GFX950: ROCm gfx950 exact loader, fp32 bits ``s << 23`` with ``s = 0 -> 1 << 22``:
                 0 -> 2**-127, 255 -> +Inf.
    """

    EXACT = "exact"
    FLASHMLA = "flashmla"
    SM120 = "sm120"
    TRITON = "triton"
    ROCM_TRITON = "rocm_triton"
    CUTE = "cute"
    ROCM_GFX950 = "rocm_gfx950"


class V32ScaleDecode(_StrEnum):
    """How a consumer applies a V3.2 656-byte row's fp32 tile scale ``s`` to an E4M3 code ``c``
    (datapath 1.5, attention.md 6 and H11).

    All three agree whenever ``s`` is a power of two in the normal range (FlashMLA's quantiser
    only writes such scales); they differ on arbitrary fp32 scales, which the format allows.

    EXACT:         ``c * s`` exactly (the fp32 multiplier as stored; FlashMLA ``tests/quant.py``
                   dequantises ``code.float() * scale``).
    BF16_RNE:      ``bf16(c * bf16(s))``: the scale is rounded to bf16 (RNE), then a bf16
                   multiply (FlashMLA SM90 ``splitkv_mla.cuh`` V32 branch ``(bf16)scales_float``
                   + ``cvt_fp8x8_bf16x8``; the fixed SM100 head64 decoder does the same).
    SM100_RZ_E8M0: the scale goes through E8M0 with round-toward-zero, i.e. it is truncated to
                   the power of two at or below it (``2**floor(log2 s)``), then ``c * 2**k`` is
                   exact (FlashMLA SM100 head64 decoder at FM 9241ae3,
                   ``csrc/sm100/decode/head64/kernel.cuh:705-709``; fixed upstream, FlashMLA#184).
    """

    EXACT = "exact"
    BF16_RNE = "bf16_rne"
    SM100_RZ_E8M0 = "sm100_rz_e8m0"


# --------------------------------------------------------------------------- DeepSeek-V4.1 (datapath 1.6, H13)
# Citation keys: ``V:`` = the vLLM 0.33.0 wheel (``vllm/``), ``FI:`` = the FlashInfer 0.7.2 wheel
# (``flashinfer/``).


class V41Record(_StrEnum):
    """The two V4.1 per-token records (``V:models/deepseek_v41/common/ops/cache_utils.py:39-56``).

    MXFP8: 528 B -- 512 E4M3FN codes (RoPE dims quantised too), 16 UE8M0 scales, one per 32 dims
        (FlashMLA ``ModelType::V41``).
    NVFP4: 288 B -- 256 B of E2M1 pairs (even element in the LOW nibble), 32 E4M3FN scales, one
        per 16 dims (FlashMLA ``ModelType::V41_FP4``, compressed / extra cache only).
    """

    MXFP8 = "mxfp8_528"
    NVFP4 = "nvfp4_288"


class V41Layout(_StrEnum):
    """Byte order of a V4.1 page (hazard H13: same bytes per token, so nothing rejects the wrong one).

    INTERLEAVED: each token's scales right after its own data, token ``e`` at ``page*P + e*R``
        -- vLLM 0.33.0 writers and gathers (``V:.../deepseek_v41/common/ops/cache_utils.py:216-217,
        570-571,629``; ``fused_compress_quant_cache.py:308-317,465-466,528-530``) and the vendored
        FlashMLA (``V:third_party/flashmla/flash_mla_interface.py:122-128``, "BREAKING CHANGE ...
        2026.09.30 ... a cache written in the old layout is NOT rejected, it is misread").
    PAGE_FOOTER: all data rows of a page first, then all scale rows -- FlashInfer 0.7.2
        (``FI:data/include/flashinfer/attention/sparse_mla_sm120/model/dsv41_layout.cuh:15-43``
        ``FooterScaleLayout``; ``FI:trace/templates/quantize.py:1123-1126,1146-1149``) and FlashMLA
        before 2026.09.30.
    """

    INTERLEAVED = "interleaved"
    PAGE_FOOTER = "page_footer"


class Nvfp4ScaleRule(_StrEnum):
    """How a V4.1 NVFP4 writer forms a 16-group's E4M3 scale from its fp32 ``amax``; both then clamp
    to ``[2**-9, 448]``, round to E4M3 (RNE) and divide the values by the DECODED scale with a
    correctly rounded division (``div_rn``) before ``cvt.rn.satfinite.e2m1x2.f32``.

    RECIP_MUL: ``fl32(amax * fl32(1/6))`` -- vLLM 0.33.0 ``_rope_quant_insert_nvfp4_kernel``
        (``V:.../deepseek_v41/common/ops/fused_compress_quant_cache.py:518-524``).
    DIV_RN: ``fl32(amax / 6)`` (``__fdiv_rn``) -- FlashInfer 0.7.2 ``quantize_dsv41_group16``
        (``FI:data/csrc/sparse_mla_sm120/dsv41_fp4_cache_ops.cu:129-138``).
    They agree on every bf16 ``amax`` (test-proven exhaustively); they can differ by one E4M3
    step for an fp32 ``amax`` (vLLM's RoPE lanes are fp32 after the rotation).
    """

    RECIP_MUL = "recip_mul"
    DIV_RN = "div_rn"


class Nvfp4NonFinite(_StrEnum):
    """What a V4.1 NVFP4 writer does with a 16-group holding NaN or Inf.

    FINITE: out of contract, the reference raises.
    POISON: scale byte 0x7F (E4M3 NaN) and all 16 codes 0 -- FlashInfer 0.7.2 ("zero codes plus
        a NaN scale", ``FI:data/csrc/sparse_mla_sm120/dsv41_fp4_cache_ops.cu:113-127``).
    TRITON: vLLM 0.33.0 ``_rope_quant_insert_nvfp4_kernel`` (``V:.../deepseek_v41/common/ops/
        fused_compress_quant_cache.py:518-531``), step by step: ``amax = tl.max(|x|)`` is a
        ``maxnum`` reduction, so NaN elements are ignored and an Inf makes ``amax = Inf``; the scale
        ``clamp(Inf / 6, 2**-9, 448)`` is 448 (byte 0x7E); ``div_rn`` keeps NaN / +-Inf; then
        ``cvt.rn.satfinite.e2m1x2.f32`` saturates +-Inf to +-6 (codes 0x7 / 0xF) and, E2M1 having
        no NaN, writes NaN as positive MAX_NORM (+6, code 0x7; PTX ISA ``cvt`` ``.satfinite``; not
        yet observed on hardware: the instruction exists only on sm100+).
        A group whose 16 elements are all NaN has ``amax = NaN``, and ``tl.clamp`` of NaN is
        unspecified: out of contract, the reference raises. The value is ``"triton"``, as
        ``NonFinite.TRITON``, so one declared ``nonfinite`` serves both records of the producer.
    """

    FINITE = "finite"
    POISON = "poison"
    TRITON = "triton"




# --------------------------------------------------------------------------- SGLang 0.5.23
# Citation key ``S:`` = the SGLang 0.5.23 wheel (``sglang/``).


class CombineInvalidTopk(_StrEnum):
    """What a prefill combine (top-k + SWA window into one workspace index row) writes for a
    NEGATIVE top-k entry inside the row's ``topk_len`` prefix.

    SHIFTED_BY_BASE: no check, the entry gets the request's workspace base added, so a ``-1`` of
        request ``r`` becomes ``M*r - 1``, the last row of request ``r-1`` (vLLM 0.33.0's common
        ``combine_topk_swa_indices``, hazard H10; ``reference.indices.prefill``).
    KEPT_MINUS1: every negative entry becomes ``-1`` (a hole the prefill attention skips) and is
        still counted by the row length; entries ``>= 0`` get the base added without an upper
        bound check -- SGLang 0.5.23 ``_combine_topk_swa_indices_kernel``
        (``S:kernels/ops/attention/dsv4/sparse_prefill_kernels.py:142-146``).
    BOUNDED_MINUS1: every entry outside ``[0, N)`` (negative, or past the compressed part of the
        workspace) becomes ``-1`` and is still counted by the row length -- vLLM 0.33.0's V4.1
        ``CombineTopkSwaIndicesKernel`` (``models/deepseek_v41/common/ops/cache_utils.py:1105-1110``:
        "A failed (-1) or out-of-pool candidate stays -1"); the ROCm V4 form validates the same way.
    """

    SHIFTED_BY_BASE = "shifted_by_base"
    KEPT_MINUS1 = "kept_minus1"
    BOUNDED_MINUS1 = "bounded_minus1"


class E2m1Zero(_StrEnum):
    """How a V4.1 NVFP4 reader decodes E2M1 code ``0x8`` (sign bit set, magnitude 0).

    SIGNED: ``-0.0``, the format's value (``reference.formats.fp4.decode_e2m1``).
    POSITIVE: ``+0.0``: the reader forms ``where(code >= 8, -mag, mag)`` and Triton lowers the
        float negation ``-mag`` to ``0 - mag`` (``triton.language.semantic.minus``), so ``-0.0``
        never appears -- vLLM 0.33.0's ``_dequantize_and_gather_k_nvfp4_kernel``
        (``models/deepseek_v41/common/ops/cache_utils.py``); seen on the H200 (sm90): 2,605 of 65,536
        elements of ``nvfp4-bs64-window`` were +0 where the format reads -0.
    """

    SIGNED = "signed"
    POSITIVE = "positive"


class CombineWindowStart(_StrEnum):
    """Where a prefill combine's SWA window may start, for token position ``p`` with window ``W``
    of a request whose gathered context starts at ``gather_start = seq_len - gather_len``.

    SEQUENCE: ``max(p - (W-1), 0)``: a window reaching below ``gather_start`` indexes rows before
        the request's gathered SWA rows (vLLM 0.33.0's V4 common form; the caller keeps
        ``gather_len >= W`` so it does not happen there).
    GATHERED: ``max(p - (W-1), 0, gather_start)``: the window never starts before the gathered
        buffer (vLLM 0.33.0's V4.1 kernel, ``cache_utils.py:1086-1090``, "SWA bounded replay").
    """

    SEQUENCE = "sequence"
    GATHERED = "gathered"


class IndexerKScale(_StrEnum):
    """The scale a DeepSeek-V4.1 FP8 indexer-K writer stores per token (vLLM 0.33.0
    ``deepseek_v41/common/ops/indexer_k_store.py:266-273``).

    FP32: the power of two ``2**e`` as a little-endian fp32 (``mqa_logits_use_mx_scales()`` False).
    UE8M0_X4: ``pack_ue8m0_x4(2**e)`` (DeepGEMM MX-scale logits); not modelled by the reference.
    """

    FP32 = "fp32"
    UE8M0_X4 = "ue8m0_x4"
