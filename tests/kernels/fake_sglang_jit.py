"""A CPU stand-in for SGLang 0.5.23's JIT store and RoPE ops (``kernels/sglang/jit.py``), used to
test the adapters' plumbing without a GPU.

It enforces the host checks of ``SG:kernels/jit/csrc/deepseek_v4/store.cuh`` (``TensorMatcher``:
input ``[N, 512]`` bf16, cache 2-D with strides ``(kv_page_bytes, 1)`` exactly, indices ``[N]``;
a power-of-two page size; the kernel has no slot skip, so a negative index is an error here
instead of an out-of-bounds write) and re-derives the V4 tile arithmetic from the CUDA source in
float32 tensor ops, independently of ``reference.formats.quant``: ``fmaxf`` amax, ``fmaxf(1e-4f, amax) /
448``, ``cast_to_ue8m0`` and ``inv_scale_ue8m0`` on the bits, ``fmaxf(fminf(v, 448), -448)``, then
the E4M3 conversion (torch's cast, which is RNE for the clamped finite values). The V4.1 MXFP8
exponent is the bit formula of ``kv_layout.cuh:163-168``; NVFP4 codes come from ``reference.formats.fp4``
(plumbing only). The RoPE op rotates in float32 with the left product fused.
"""

from __future__ import annotations

import torch

from dsv4_numerics.reference.formats import fp4
from dsv4_numerics.reference.pipeline.rope import fma_f32

CALLS: list[dict] = []
PAGE_ALIGN = {"v4": 576, "v41": 512, "v41_fp4": 256, "v41_new": 528, "v41_fp4_new": 288}
RECORD = {"v4": 584, "v41": 528, "v41_fp4": 288, "v41_new": 528, "v41_fp4_new": 288}
DATA = {"v4": 576, "v41": 512, "v41_fp4": 256, "v41_new": 512, "v41_fp4_new": 256}


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _from_bits(b: torch.Tensor) -> torch.Tensor:
    b = b & 0xFFFFFFFF
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


def _fmaxf(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # the non-NaN operand wins
    return torch.where(torch.isnan(a), b, torch.where(torch.isnan(b), a, torch.maximum(a, b)))


def _v4_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 codes [N, 448] and scale bytes [N, 7] of store.cuh:59-71."""
    t = x[:, :448].to(torch.float32).reshape(-1, 7, 64)
    a = t.abs()
    amax = a[..., 0]
    for i in range(1, 64):
        amax = _fmaxf(amax, a[..., i])
    raw = _fmaxf(torch.full_like(amax, 1e-4), amax) / 448.0
    u = _bits(raw)
    exp = ((u >> 23) & 0xFF) + ((u & 0x7FFFFF) != 0).to(torch.int64)
    inv = _from_bits((127 + 127 - exp) << 23)
    y = t * inv.unsqueeze(-1)
    m = torch.full_like(y, 448.0)
    clipped = _fmaxf(-m, torch.where(torch.isnan(y), m, torch.minimum(y, m)))  # fminf(NaN, 448) = 448
    codes = clipped.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1, 448)
    return codes, exp.to(torch.uint8)


def _v41_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = x.to(torch.float32).reshape(-1, 16, 32)
    amax = t.abs().amax(-1)
    b = _bits(amax)
    e = torch.clamp((b >> 23) - 8 + ((b & 0x7FFFFF) > 0x600000).to(torch.int64), min=114)
    y = t * _from_bits((254 - e) << 23).unsqueeze(-1)
    return y.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1, 512), e.to(torch.uint8)


def _v41_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = x.to(torch.float32).reshape(-1, 32, 16)
    amax = t.abs().amax(-1)
    scale = torch.clamp(fp4.div_rn_f32(amax, torch.full_like(amax, 6.0)), 2.0**-9, 448.0).to(torch.float8_e4m3fn)
    y = fp4.div_rn_f32(t, scale.to(torch.float32).unsqueeze(-1))
    codes = fp4.pack_e2m1(fp4.encode_e2m1_trusted(y.to(torch.float64)).reshape(-1, 512))
    return codes, scale.view(torch.uint8)


def fused_store_cache(input, cache, indices, *, page_size, type, layout="v4", freqs_cis=None):
    layout = str(getattr(layout, "value", layout))
    CALLS.append({"layout": layout, "page_size": page_size, "cache_shape": tuple(cache.shape),
                  "stride": cache.stride(), "n": input.shape[0], "indices_dtype": indices.dtype})
    assert type == "flashmla" and freqs_cis is None
    assert page_size & (page_size - 1) == 0, "kPageSize must be a power of 2"
    n = input.shape[0]
    assert input.dtype == torch.bfloat16 and tuple(input.shape) == (n, 512) and input.is_contiguous()
    assert indices.dtype in (torch.int32, torch.int64) and tuple(indices.shape) == (n,)
    a = PAGE_ALIGN[layout]
    page_bytes = -(-page_size * RECORD[layout] // a) * a
    assert cache.dtype == torch.uint8 and cache.dim() == 2 and cache.stride() == (page_bytes, 1), \
        f"cache strides {cache.stride()} != ({page_bytes}, 1)"
    assert bool((indices >= 0).all()), "no slot skip: a negative index writes out of bounds"
    if layout == "v4":
        codes, scales = _v4_rows(input)
        data = torch.cat([codes, input[:, 448:].contiguous().view(torch.uint8)], dim=1)
    elif layout in ("v41", "v41_new"):
        data, scales = _v41_mxfp8(input)
    else:
        data, scales = _v41_nvfp4(input)
    interleaved = layout.endswith("_new")
    flat = cache.view(-1)
    d_bytes = DATA[layout]
    for t, s in enumerate(indices.tolist()):
        page, e = divmod(s, page_size)
        if interleaved:
            d0 = page * page_bytes + e * RECORD[layout]
            s0 = d0 + d_bytes
        else:
            d0 = page * page_bytes + e * d_bytes
            s0 = page * page_bytes + page_size * d_bytes + e * (RECORD[layout] - d_bytes)
        flat[d0:d0 + d_bytes] = data[t]
        flat[s0:s0 + scales.shape[1]] = scales[t]  # V4: 7 bytes, the pad byte untouched


def fused_rope_inplace(q, k, freqs_cis, positions, inverse=False):
    CALLS.append({"rope": True, "shape": tuple(q.shape), "stride": q.stride(), "inverse": inverse})
    assert k is None and q.dtype == torch.bfloat16 and q.dim() == 3 and q.shape[-1] == 64 and q.stride(-1) == 1
    assert freqs_cis.dtype == torch.complex64 and positions.shape == (q.shape[0],)
    f = torch.view_as_real(freqs_cis)[positions.to(torch.int64)].unsqueeze(1)  # [B, 1, 32, 2]
    c, s = f[..., 0], f[..., 1]
    e, o = q[..., 0::2].to(torch.float32), q[..., 1::2].to(torch.float32)
    if inverse:  # (e*c + o*s, o*c - e*s), left product fused
        e2, o2 = fma_f32(e, c, o * s), fma_f32(o, c, -(e * s))
    else:  # (e*c - o*s, e*s + o*c)
        e2, o2 = fma_f32(e, c, -(o * s)), fma_f32(e, s, o * c)
    q[..., 0::2] = e2.to(torch.bfloat16)
    q[..., 1::2] = o2.to(torch.bfloat16)


def dpsk_v4_fp8_attention_fwd(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                              num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=False,
                              indices=None, attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None,
                              topk_length=None, extra_topk_length=None):
    """The TileLang decode's contract (``tilelang_fp8_attention.py:95-108,949-1064``: power-of-two
    pages, top-k a multiple of block_I = 32, no schedule) over FlashMLA's stand-in, with the NoPE
    codes read by exponent arithmetic (every exponent-0 code as a normal)."""
    import tests.kernels.fake_flashmla as FM
    from dsv4_numerics.reference.caches.model1 import dequantize_all
    from dsv4_numerics.reference.policies import Fp8Decode, Ue8m0Consumer

    assert tile_scheduler_metadata is None and num_splits is None
    for cache, idx in ((k_cache, indices), (extra_k_cache, extra_indices_in_kvcache)):
        if cache is not None:
            bs = cache.shape[1]
            assert bs & (bs - 1) == 0, "block_size_kv must be a power of two"
            assert idx.shape[-1] % 32 == 0 and cache.stride(0) % 4 == 0
    CALLS.append({"fn": "tilelang_decode", "h_q": q.shape[2]})
    rows = FM.cache_rows
    FM.cache_rows = lambda c: dequantize_all(c[:, :, 0, :], c.shape[1], consumer=Ue8m0Consumer.FLASHMLA,
                                        read=Fp8Decode.EXP0_AS_NORMAL)
    try:
        return FM.flash_mla_with_kvcache(q, k_cache, None, None, head_dim_v, None, softmax_scale=softmax_scale,
                                         is_fp8_kvcache=is_fp8_kvcache, indices=indices, attn_sink=attn_sink,
                                         extra_k_cache=extra_k_cache, extra_indices_in_kvcache=extra_indices_in_kvcache,
                                         topk_length=topk_length, extra_topk_length=extra_topk_length)
    finally:
        FM.cache_rows = rows
