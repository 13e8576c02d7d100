"""Default cases of the MLA-family stages: ``v32_decode``, ``dense_mla_decode``, ``dense_mla_prefill``.

Deterministic (``torch.Generator`` seeded per case), CPU-sized, in the shapes the production
kernels accept, so the same case runs on the CPU reference and on a GPU kernel unchanged:

v32_decode (FlashMLA ``flash_mla_with_kvcache`` sparse, ``d_qk = 576``, 656-byte cache)
    inputs: ``q [b, s_q, h_q, 576]`` bf16 ~ N(0,1) clamped to +-1 (FlashMLA's decode test domain,
    attention.md 7); ``kv_cache [num_blocks, page_stride]`` uint8 page buffer, ``page_stride =
    (block_size + 1) * 656`` (FlashMLA's tests pad each page by one row, ``FM:tests/quant.py``);
    ``block_size`` 64; ``indices [b, s_q, topk]`` int32 global slots, ``-1`` = invalid;
    ``scale`` (non-default: ``576**-0.55``); ``sink [h_q]`` fp32 or None; ``d_v`` 512.
    Latent values ~ N(0, 0.1^2) clamped to +-1, bf16, FlashMLA V32 quantiser
    (``cache_v32.encode_v32_rows``). Every row no valid index points at, and every page's padding
    row, is NaN-poisoned (``cache_v32.v32_nan_row``). ``h_q`` in {64, 128}, ``topk % 64 == 0``
    (FlashMLA SM90/SM100 decode). No ``topk_length`` (FlashMLA SM90 rejects it for V3.2:
    ``KU_ASSERT(params.topk_length == nullptr, "V3.2 does not support dynamic topk length")``).
    One case writes **non-power-of-two** fp32 scales (the format allows any fp32), where the
    consumers' ``V32ScaleDecode`` policies differ.

dense_mla_decode (FlashMLA dense decode, FlashInfer ``trtllm_batch_decode_with_kv_cache_mla``,
TokenSpeed ``tokenspeed_mla_decode``)
    inputs: ``q [b, s_q, h_q, 576]`` and ``kv_cache [num_blocks, block_size, 576]``, both bfloat16
    or both float8_e4m3fn; ``block_table [b, M]`` int32 (a permutation of pages; columns past a
    request's pages point at a spare page of finite garbage, never NaN, as vLLM pads with real
    page ids), ``seq_lens [b]`` int32, ``block_size`` (64 or 32), ``softmax_scale``,
    ``q_scale``, ``kv_scale`` (per-tensor FP8 dequant multipliers; 1.0 for bf16),
    ``causal`` True. Cache positions ``>= seq_len`` inside a request's pages and every unused
    page are NaN (FlashMLA's dense test poisons them, ``FM:tests/test_fp8_flash_mla.py``).
    FP8 cases: ``q = e4m3(q_real / q_scale)``, ``kv = e4m3(kv_real / kv_scale)`` (RNE, saturating).

dense_mla_prefill (TokenSpeed ``tokenspeed_mla_prefill``; DeepSeek-R1 per-head dims)
    inputs: ``q [T, h, 192]``, ``k [T, h, 192]``, ``v [T, h, 128]`` bf16, ``cu_seqlens_q`` and
    ``cu_seqlens_kv`` ``[R+1]`` int32 (equal in the default cases: new-token prefill, ``s_r == L_r``),
    ``scale``, ``causal`` True.
"""

from __future__ import annotations

import math

import torch

from ..caches.v32 import insert_v32, pack_v32_rows, quantize_v32, v32_nan_row
from ..cases import Case, register_cases
from ..constants import MLA_D_QK, MLA_D_V, R1_QK_NOPE_DIM, R1_V_HEAD_DIM, V32_HEAD_DIM, V32_N_TILES, V32_ROW_BYTES
from ..formats.fp8 import encode_e4m3fn

__all__ = ["v32_decode_cases", "dense_mla_decode_cases", "dense_mla_prefill_cases",
           "build_v32_case", "build_dense_case", "build_prefill_case"]

V32_BLOCK_SIZE = 64  # FlashMLA's production page; vLLM V3.2 fp8_ds_mla pages are 64 tokens
V32_SCALE = V32_HEAD_DIM ** -0.55  # non-default (FlashMLA decode tests use d**-0.55 style scales)
DENSE_SCALE = MLA_D_QK ** -0.5 * 0.75  # non-default softmax scale
PREFILL_SCALE = (R1_QK_NOPE_DIM + 64) ** -0.5 * 0.8


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _q_domain(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """N(0,1) clamped to +-1, bf16 (FlashMLA decode test domain, attention.md 7)."""
    return torch.randn(shape, generator=g).clamp(-1, 1).to(torch.bfloat16)


def _kv_domain(g: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """N(0, 0.1^2) clamped to +-1, bf16."""
    return (torch.randn(shape, generator=g) * 0.1).clamp(-1, 1).to(torch.bfloat16)


def _sink(g: torch.Generator, h: int, kind: str) -> torch.Tensor | None:
    if kind == "none":
        return None
    s = torch.randn(h, generator=g).to(torch.float32)
    if kind == "mixed_inf":  # FlashMLA's generator sets ~30% to +inf and ~30% to -inf
        u = torch.rand(h, generator=g)
        s = torch.where(u < 0.3, torch.full_like(s, math.inf), s)
        s = torch.where(u > 0.7, torch.full_like(s, -math.inf), s)
    return s


# --------------------------------------------------------------------------- v32_decode


def build_v32_case(name: str, *, b: int, s_q: int, h_q: int, topk: int, num_blocks: int, seed: int,
                   invalid_frac: float = 0.25, lonely_tokens: tuple[int, ...] = (), sink: str = "none",
                   nonpow2_scales: bool = False) -> Case:
    """One ``v32_decode`` case (module docstring). ``lonely_tokens``: flat token ids (``b_i * s_q +
    i``) whose whole index row is ``-1``. ``nonpow2_scales``: every referenced row's 4 tile scales
    are multiplied by a fp32 factor in [0.5, 1) with a full mantissa (codes unchanged)."""
    g = _gen(seed)
    bs = V32_BLOCK_SIZE
    n_slots = num_blocks * bs
    t = b * s_q
    q = _q_domain(g, (b, s_q, h_q, V32_HEAD_DIM))
    idx = torch.stack([torch.randperm(n_slots, generator=g)[:topk] for _ in range(t)])  # distinct per row
    drop = torch.rand(t, topk, generator=g) < invalid_frac
    idx = torch.where(drop, torch.full_like(idx, -1), idx)
    for tok in lonely_tokens:
        idx[tok] = -1
    referenced = torch.unique(idx[idx >= 0])
    kv = _kv_domain(g, (referenced.numel(), V32_HEAD_DIM))
    codes, scales, rope = quantize_v32(kv)
    if nonpow2_scales:
        # factor = 0.5 + m * 2**-24, m uniform in [0, 2**23): a 24-bit fp32 mantissa in [0.5, 1)
        m = torch.randint(0, 2**23, (referenced.numel(), V32_N_TILES), generator=g, dtype=torch.int64)
        factor = (0.5 + m.to(torch.float64) * 2.0**-24).to(torch.float32)  # exact in fp32
        scales = (scales.to(torch.float64) * factor.to(torch.float64)).to(torch.float32)  # exact: pow2 * fp32
    rows = pack_v32_rows(codes, scales, rope)
    page_stride = (bs + 1) * V32_ROW_BYTES
    cache = v32_nan_row().repeat(num_blocks, bs + 1).reshape(num_blocks, page_stride)
    cache = insert_v32(cache, rows, referenced, bs)
    sk = _sink(g, h_q, sink)
    inputs = {
        "q": q,
        "kv_cache": cache,
        "block_size": bs,
        "indices": idx.to(torch.int32).reshape(b, s_q, topk),
        "scale": V32_SCALE,
        "sink": sk,
        "d_v": MLA_D_V,
    }
    params = {
        "b": b, "s_q": s_q, "h_q": h_q, "topk": topk, "num_blocks": num_blocks, "block_size": bs,
        "page_stride": page_stride, "seed": seed, "invalid_frac": invalid_frac,
        "lonely_tokens": list(lonely_tokens), "sink": sink, "nonpow2_scales": nonpow2_scales,
        "nan_poisoned_unreferenced_rows": True, "scale": V32_SCALE,
    }
    return Case(name, "v32_decode", inputs, params)


@register_cases("v32_decode")
def v32_decode_cases() -> list[Case]:
    """Default ``v32_decode`` cases (FlashMLA-compatible: h_q 64/128, topk % 64 == 0, page 64)."""
    return [
        build_v32_case("h64-b2-sq1-topk64-nan-poison", b=2, s_q=1, h_q=64, topk=64, num_blocks=4, seed=3201),
        build_v32_case("h128-b2-sq2-topk128-sink-inf", b=2, s_q=2, h_q=128, topk=128, num_blocks=4,
                       seed=3202, sink="mixed_inf"),
        build_v32_case("h64-b3-sq1-topk128-lonely-token", b=3, s_q=1, h_q=64, topk=128, num_blocks=3,
                       seed=3203, lonely_tokens=(1,)),
        build_v32_case("h64-b2-sq1-topk64-nonpow2-scales", b=2, s_q=1, h_q=64, topk=64, num_blocks=3,
                       seed=3204, nonpow2_scales=True),
    ]


# --------------------------------------------------------------------------- dense_mla_decode


def build_dense_case(name: str, *, dtype: str, b: int, s_q: int, h_q: int, block_size: int,
                     seq_lens: tuple[int, ...], seed: int, q_scale: float = 1.0, kv_scale: float = 1.0,
                     spare_pages: int = 2) -> Case:
    """One ``dense_mla_decode`` case (module docstring). ``dtype``: ``"bfloat16"`` or
    ``"float8_e4m3fn"`` (then ``q_scale``/``kv_scale`` are the per-tensor dequant multipliers)."""
    if dtype not in ("bfloat16", "float8_e4m3fn"):
        raise ValueError(f"build_dense_case: dtype must be bfloat16 or float8_e4m3fn (got {dtype})")
    if len(seq_lens) != b or min(seq_lens) < s_q:
        raise ValueError("build_dense_case: one seq_len per request, each >= s_q (FlashMLA's contract)")
    g = _gen(seed)
    pages_per_req = [-(-L // block_size) for L in seq_lens]
    m = max(pages_per_req)
    used = sum(pages_per_req)
    num_blocks = used + spare_pages
    perm = torch.randperm(num_blocks, generator=g)
    garbage_page = int(perm[used])  # finite random values, pads the block-table columns
    bt = torch.full((b, m), garbage_page, dtype=torch.int32)
    k = 0
    for r, n in enumerate(pages_per_req):
        bt[r, :n] = perm[k:k + n].to(torch.int32)
        k += n
    real = _kv_domain(g, (num_blocks, block_size, MLA_D_QK)).to(torch.float32)
    nan_mask = torch.ones(num_blocks, block_size, dtype=torch.bool)
    nan_mask[garbage_page] = False
    for r, L in enumerate(seq_lens):
        for p in range(L):
            nan_mask[int(bt[r, p // block_size]), p % block_size] = False
    q_real = _q_domain(g, (b, s_q, h_q, MLA_D_QK)).to(torch.float32)
    if dtype == "bfloat16":
        q = q_real.to(torch.bfloat16)
        kv = real.to(torch.bfloat16)
        kv[nan_mask] = float("nan")
        q_scale = kv_scale = 1.0
    else:
        q = encode_e4m3fn(q_real.to(torch.float64) / q_scale).view(torch.float8_e4m3fn)
        kv_codes = encode_e4m3fn(real.to(torch.float64) / kv_scale)
        kv_codes[nan_mask] = 0x7F  # E4M3FN NaN
        kv = kv_codes.view(torch.float8_e4m3fn)
    inputs = {
        "q": q,
        "kv_cache": kv,
        "block_table": bt,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "block_size": block_size,
        "softmax_scale": DENSE_SCALE,
        "q_scale": float(q_scale),
        "kv_scale": float(kv_scale),
        "causal": True,
    }
    params = {
        "dtype": dtype, "b": b, "s_q": s_q, "h_q": h_q, "block_size": block_size,
        "seq_lens": list(seq_lens), "num_blocks": num_blocks, "seed": seed, "q_scale": float(q_scale),
        "kv_scale": float(kv_scale), "softmax_scale": DENSE_SCALE, "causal": True,
        "nan_poisoned_unreferenced_positions": True,
    }
    return Case(name, "dense_mla_decode", inputs, params)


@register_cases("dense_mla_decode")
def dense_mla_decode_cases() -> list[Case]:
    """Default ``dense_mla_decode`` cases: bf16 and per-tensor FP8 caches, pages 64 and 32,
    128/64/16 heads, 1, 2 and 4 query tokens per request (causal speculative decode)."""
    return [
        build_dense_case("bf16-h128-bs64-b2-sq1", dtype="bfloat16", b=2, s_q=1, h_q=128, block_size=64,
                         seq_lens=(100, 37), seed=5101),
        build_dense_case("bf16-h64-bs64-b2-sq2-mtp", dtype="bfloat16", b=2, s_q=2, h_q=64, block_size=64,
                         seq_lens=(130, 65), seed=5102),
        build_dense_case("bf16-h128-bs64-b1-sq4-short", dtype="bfloat16", b=1, s_q=4, h_q=128, block_size=64,
                         seq_lens=(5,), seed=5103),
        build_dense_case("bf16-h16-bs32-b3-sq1", dtype="bfloat16", b=3, s_q=1, h_q=16, block_size=32,
                         seq_lens=(33, 64, 7), seed=5104),
        build_dense_case("fp8-h128-bs64-b2-sq1-scaled", dtype="float8_e4m3fn", b=2, s_q=1, h_q=128,
                         block_size=64, seq_lens=(90, 129), seed=5105, q_scale=1 / 16, kv_scale=3 / 512),
        build_dense_case("fp8-h64-bs64-b2-sq2-mtp-scaled", dtype="float8_e4m3fn", b=2, s_q=2, h_q=64,
                         block_size=64, seq_lens=(66, 200), seed=5107, q_scale=1 / 16, kv_scale=1 / 64),
        build_dense_case("fp8-h128-bs32-b2-sq2-scaled", dtype="float8_e4m3fn", b=2, s_q=2, h_q=128,
                         block_size=32, seq_lens=(70, 33), seed=5106, q_scale=1 / 8, kv_scale=1 / 128),
    ]


# --------------------------------------------------------------------------- dense_mla_prefill


def build_prefill_case(name: str, *, h: int, seq_lens: tuple[int, ...], seed: int) -> Case:
    """One ``dense_mla_prefill`` case: R1 per-head dims, ragged new-token prefill, causal."""
    g = _gen(seed)
    t = sum(seq_lens)
    dqk = R1_QK_NOPE_DIM + 64
    q = (torch.randn(t, h, dqk, generator=g) * 0.5).to(torch.bfloat16)
    k = (torch.randn(t, h, dqk, generator=g) * 0.5).to(torch.bfloat16)
    v = torch.randn(t, h, R1_V_HEAD_DIM, generator=g).to(torch.bfloat16)
    cu = torch.tensor([0] + list(torch.cumsum(torch.tensor(seq_lens), 0).tolist()), dtype=torch.int32)
    inputs = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu, "cu_seqlens_kv": cu.clone(),
              "scale": PREFILL_SCALE, "causal": True}
    params = {"h": h, "seq_lens": list(seq_lens), "seed": seed, "d_qk": dqk, "d_v": R1_V_HEAD_DIM,
              "scale": PREFILL_SCALE, "causal": True}
    return Case(name, "dense_mla_prefill", inputs, params)


@register_cases("dense_mla_prefill")
def dense_mla_prefill_cases() -> list[Case]:
    """Default ``dense_mla_prefill`` cases (ragged, causal, R1 dims 192/128)."""
    return [
        build_prefill_case("r1-h16-3req-37-64-5", h=16, seq_lens=(37, 64, 5), seed=5201),
        build_prefill_case("r1-h4-1req-130", h=4, seq_lens=(130,), seed=5202),
    ]
