"""Constants of the DSv4 formats, defined once.

Every number here is cited to the DSv4 specification the reference implements: the data path (D)
and the sparse attention (A), by section. Units are stated per constant: bytes, dims (elements), or plain values.
No other module may re-state these numbers; import them from here.
"""

from __future__ import annotations

import struct

# --------------------------------------------------------------------------- latent row (dims)
HEAD_DIM = 512  # D1.1: latent K row, also the value row in DSv4 (V includes RoPE dims)
NOPE_DIM = 448  # D1.1: dims [0, 448) are FP8-quantised ("NoPE")
ROPE_DIM = 64  # D1.1: dims [448, 512) are bf16 RoPE dims (GPT-J interleaved pairs)
ROPE_OFFSET = NOPE_DIM  # first RoPE dim
TILE = 64  # D1.1: quantisation tile width (dims)
N_TILES = NOPE_DIM // TILE  # 7 tiles per token

# --------------------------------------------------------------------------- MODEL1 584-byte record (bytes)
DATA_ROW_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576: 448 FP8 codes + 64 bf16
SCALE_ROW_BYTES = N_TILES + 1  # 8: 7 UE8M0 scale bytes + 1 pad byte
RECORD_BYTES = DATA_ROW_BYTES + SCALE_ROW_BYTES  # 584
PAD_BYTE_INDEX = N_TILES  # byte 7 of the scale row
DEFINED_BYTES_PER_RECORD = RECORD_BYTES - 1  # 583: pad byte excluded (D7 H5)
PAGE_ALIGNMENT = 576  # D1.2: vLLM allocates round_up(bs*584, 576) bytes per page

# --------------------------------------------------------------------------- FP8 formats (values)
E4M3_MAX = 448.0  # OCP E4M3FN largest finite, code 0x7E
E4M3_BIAS = 7
E4M3FNUZ_MAX = 240.0  # E4M3FNUZ largest finite, code 0x7F
E4M3FNUZ_BIAS = 8
FNUZ_GFX942_CLAMP = 224.0  # D2.1: gfx942 SWA writer clamps to +-224 before the FNUZ cast
UE8M0_BIAS = 127  # value = 2**(byte - 127); byte 0xFF is NaN
UE8M0_NAN = 0xFF

# --------------------------------------------------------------------------- scale rules (fp32 values)
# D2.0: the floor 1e-4 as an fp32 constant (0x38D1B717 ~= 9.99999975e-5).
SCALE_FLOOR_BITS = 0x38D1B717
SCALE_FLOOR_F32 = struct.unpack("<f", struct.pack("<I", SCALE_FLOOR_BITS))[0]
# D2.0: Q_A and Q_S differ exactly when tile amax <= 448 * 2**-14.
TINY_TILE_AMAX = E4M3_MAX * 2.0**-14  # 0.02734375
# Scale byte ranges for finite bf16 input (D2.0).
AMAX_CLAMP_SCALE_BYTE_RANGE = (105, 247)
SCALE_CLAMP_SCALE_BYTE_RANGE = (114, 247)

# --------------------------------------------------------------------------- output epilogue (A3.3)
OUT_GROUP = 128  # output FP8 quantisation group width (dims)
OUT_EPS = 1e-10  # amax floor of the output quantiser
OUT_GROUPS_PER_HEAD = HEAD_DIM // OUT_GROUP  # 4
OUT_HEADS_PER_GROUP = 8  # o_groups: heads per output group (8 heads -> D = 4096)
OUT_TOKEN_ALIGN = 4  # SM90 fp32 MN-major scales pad T to round_up(T, 4)

# --------------------------------------------------------------------------- attention (A1.1)
SOFTMAX_SCALE = HEAD_DIM**-0.5  # 512**-0.5
SWA_WINDOW = 128  # sliding window W (tokens)
C4_RATIO = 4
C128_RATIO = 128
COMPRESS_RATIOS = (1, C4_RATIO, C128_RATIO)  # SWA-only, C4A, C128A
C4_OVERLAP_COFF = 2  # D1.4: C4 state rows are 2*512 wide (overlap window 8)
C128_COFF = 1
PREFILL_WIDTH_ALIGN = 128  # D4.5: combined prefill rows are rounded up to a multiple of 128
C128A_TOPK_ALIGN = 128  # D4.3
FLASHINFER_ROW_ALIGN = 4  # D4.6: int32 per 16-byte row alignment

# --------------------------------------------------------------------------- production geometry (D1.2)
SWA_BLOCK_SIZE = 64  # entries per SWA page
C4_BLOCK_SIZE = 64  # entries per C4 compressed page
C128_BLOCK_SIZE = 2  # entries per C128 compressed page
KV_BLOCK_SIZE = 256  # attention backend kernel block size (tokens)


def production_page_stride(block_size: int) -> int:
    """vLLM's page size in bytes for ``block_size`` entries: ``round_up(bs*584, 576)`` (D1.2).

    37 440 for 64-entry pages, 1 728 for 2-entry pages.
    """
    raw = block_size * RECORD_BYTES
    return -(-raw // PAGE_ALIGNMENT) * PAGE_ALIGNMENT


# --------------------------------------------------------------------------- V3.2 656-byte row (D1.5)
V32_NOPE_DIM = 512
V32_ROPE_DIM = 64
V32_HEAD_DIM = V32_NOPE_DIM + V32_ROPE_DIM  # 576 (value dim 512 = NoPE only)
V32_TILE = 128
V32_N_TILES = V32_NOPE_DIM // V32_TILE  # 4
V32_ROW_BYTES = V32_NOPE_DIM + 4 * V32_N_TILES + 2 * V32_ROPE_DIM  # 656
# Byte offsets inside one 656-byte V3.2 row (D1.5; appended by the MLA-family module owner).
V32_SCALE_BYTE_OFFSET = V32_NOPE_DIM  # 512: 4 little-endian fp32 scales start here
V32_ROPE_BYTE_OFFSET = V32_SCALE_BYTE_OFFSET + 4 * V32_N_TILES  # 528: 64 bf16 RoPE values

# --------------------------------------------------------------------------- dense MLA (A1.3, R1/V3/Kimi)
# DeepSeek-R1/V3 (and Kimi K2) MLA decode works in the latent space: K row = [kv_lora_rank | rope],
# V row = the first kv_lora_rank dims of the same row (FlashMLA dense decode d_qk 576, d_v 512).
MLA_KV_LORA_RANK = V32_NOPE_DIM  # 512: the same latent geometry as V3.2 (V3.2 = V3 + sparse attention)
MLA_QK_ROPE_DIM = V32_ROPE_DIM  # 64
MLA_D_QK = MLA_KV_LORA_RANK + MLA_QK_ROPE_DIM  # 576
MLA_D_V = MLA_KV_LORA_RANK  # 512
# R1 per-head (non-absorbed) prefill dims: q/k = nope 128 + rope 64, v = 128 (vLLM tokenspeed_mla).
R1_QK_NOPE_DIM = 128
R1_V_HEAD_DIM = 128
FLASHMLA_DENSE_BLOCK_SIZE = 64  # FlashMLA dense_decode: "Currently page_block_size must be 64"

# --------------------------------------------------------------------------- DeepSeek-V4.1 records (D1.6, H13)
# V4.1 quantises all 512 latent dims (RoPE included); two per-token records, same size in both
# byte orders (``reference.policies.V41Layout``).
V41_MXFP8_GROUP = 32  # dims per UE8M0 scale
V41_MXFP8_SCALES = HEAD_DIM // V41_MXFP8_GROUP  # 16 UE8M0 bytes per token
V41_MXFP8_DATA_BYTES = HEAD_DIM  # 512 E4M3 codes per token
V41_MXFP8_RECORD_BYTES = V41_MXFP8_DATA_BYTES + V41_MXFP8_SCALES  # 528
V41_NVFP4_GROUP = 16  # dims per E4M3 scale
V41_NVFP4_SCALES = HEAD_DIM // V41_NVFP4_GROUP  # 32 E4M3 scale bytes per token
V41_NVFP4_DATA_BYTES = HEAD_DIM // 2  # 256: two E2M1 codes per byte, even element in the low nibble
V41_NVFP4_RECORD_BYTES = V41_NVFP4_DATA_BYTES + V41_NVFP4_SCALES  # 288

# --------------------------------------------------------------------------- E2M1 / NVFP4 scales (values)
E2M1_MAX = 6.0  # largest E2M1 magnitude (code 0x7)
E2M1_BIAS = 1
NVFP4_SCALE_MIN = 2.0**-9  # the V4.1 NVFP4 writers clamp amax/6 to [2**-9, 448] (smallest E4M3 subnormal)
NVFP4_SCALE_MAX = E4M3_MAX
NVFP4_POISON_SCALE_BYTE = 0x7F  # E4M3 NaN: FlashInfer's scale byte for a group holding NaN/Inf

# --------------------------------------------------------------------------- V4.1 query quantiser (MXFP8 activations)
# ``fused_q_kv_rmsnorm_quant`` (vLLM 0.33.0 ``models/deepseek_v41/common/ops/query_quant.py``): the
# normalised q rows as E4M3 codes with one UE8M0 byte per V41_MXFP8_GROUP (32) values, the bytes in
# FlashInfer's swizzled F8_128x4 layout: tiles of 128 rows x 4 groups = 512 bytes.
F8_128X4_ROWS = 128  # rows per scale tile (the token count is padded to a multiple of it)
F8_128X4_GROUPS = 4  # scale groups per tile (the group count is padded to a multiple of it)
F8_128X4_SUBROWS = 32  # rows per interleaved sub-block: byte (r % 32) * 16 + (r % 128 // 32) * 4 + g % 4
F8_128X4_TILE_BYTES = F8_128X4_ROWS * F8_128X4_GROUPS  # 512

# DeepSeek-V4.1 indexer K cache (vLLM 0.33.0 deepseek_v41/common/ops/indexer_k_store.py): 128-dim keys,
# the last 64 dims RoPE (GPT-J pairs), per token either 128 E4M3 codes + one fp32 scale (4 bytes) or
# 64 bytes of E2M1 pairs + 4 UE8M0 scales (MXFP4, one per 32 dims); values of a page first, then scales.
INDEXER_HEAD_DIM = 128
INDEXER_ROPE_DIM = 64
INDEXER_MXFP4_GROUP = 32
INDEXER_FP8_ROW_BYTES = INDEXER_HEAD_DIM + 4  # codes + fp32 scale
INDEXER_MXFP4_ROW_BYTES = INDEXER_HEAD_DIM // 2 + INDEXER_HEAD_DIM // INDEXER_MXFP4_GROUP  # 64 + 4
