"""TokenSpeed's MLA kernels (``tokenspeed_mla``, CuTe-DSL, SM100), as vLLM 0.33.0 runs them for
DeepSeek-R1 dims: dense paged decode and ragged prefill, stages ``dense_mla_decode`` /
``dense_mla_prefill`` of ``reference.cases.mla`` (production imports are lazy, inside probes and calls).

==========================================  ==================  =========  ==========================
entry                                       stage               archs      production entry point
==========================================  ==================  =========  ==========================
``tokenspeed_mla.decode``                   dense_mla_decode    sm100/103  ``tokenspeed_mla.tokenspeed_mla_decode``
``tokenspeed_mla.prefill``                  dense_mla_prefill   sm100/103  ``tokenspeed_mla.tokenspeed_mla_prefill``
==========================================  ==================  =========  ==========================

Contracts honoured:

* Decode (``tokenspeed_mla.tokenspeed_mla_decode``): ``query [B, q_len, H, 576]``,
  ``kv_cache [nb, bs, 576]`` of the query dtype, ``bs`` in {32, 64}, ``q_len`` 1..4 (vLLM sizes
  its workspace for up to 8), ``softmax_scale = bmm1``, ``output_scale = bmm2``, workspace int8,
  LSE base 2 (``lse_base_on_e = False`` in ``V:v1/attention/backends/mla/tokenspeed_mla.py``),
  causal bound ``seq_len - (q_len - 1) + q_tok``. DeepSeek-R1 dims only (kv_lora 512, rope 64).
* Prefill: ragged ``q [T, H, 192]``, ``k [T, H, 192]``, ``v [T, H, 128]`` (contiguous;
  vLLM forces ``v.contiguous()``), ``cum_seq_lens`` int32, ``is_causal``; bf16 output; LSE not
  requested (its base is not documented).
"""

from __future__ import annotations

import torch

from dsv4_numerics.reference.constants import MLA_KV_LORA_RANK, MLA_QK_ROPE_DIM, R1_QK_NOPE_DIM, R1_V_HEAD_DIM
from dsv4_numerics.reference.errors import UnsupportedCase
from dsv4_numerics.reference.policies import LseConvention, NanPolicy

from dsv4_numerics.kernels.convert import base2_lse_to_natural, dense_mla_inputs
from dsv4_numerics.kernels.probe import SM100_ARCHS, all_reasons, import_after_others, needs_arch, needs_module
from dsv4_numerics.kernels.registry import KernelEntry

__all__ = ["ENTRIES"]

TOKENSPEED_MODULE = "tokenspeed_mla"
TOKENSPEED_PAGE_SIZES = (32, 64)  # vLLM TokenspeedMLABackend.get_supported_kernel_block_sizes
TOKENSPEED_MAX_Q_LEN = 4  # tokenspeed_mla_decode_with_kvcache traits: q_len in {1, 2, 3, 4}

_tokenspeed_sm100 = all_reasons(needs_arch(*SM100_ARCHS), needs_module(TOKENSPEED_MODULE, "tokenspeed-mla"),
                                import_after_others(TOKENSPEED_MODULE))


def _tokenspeed_decode_call(case) -> dict:
    inp, q, kv, bs, bt, seq = dense_mla_inputs(case)
    b, s_q, h, _ = q.shape
    if bs not in TOKENSPEED_PAGE_SIZES:
        raise UnsupportedCase(f"TokenSpeed MLA decode needs page size 32 or 64 (got {bs})")
    if s_q > TOKENSPEED_MAX_Q_LEN or h > 128:
        raise UnsupportedCase(f"TokenSpeed MLA decode supports q_len 1..4 and <= 128 heads (got {s_q}, {h})")
    if s_q > 1 and q.dtype != torch.float8_e4m3fn:
        # tokenspeed_mla_decode docstring: causal_mask "is effective for the FP8 kernel path"
        raise UnsupportedCase("TokenSpeed documents causal masking (q_len > 1) for the FP8 path only")
    bmm1 = float(inp["softmax_scale"]) * float(inp["q_scale"]) * float(inp["kv_scale"])
    bmm2 = float(inp["kv_scale"])
    # workspace bound of vLLM's _get_workspace: num_sms * H * MAX_Q_LEN(8) * (kv_lora + 1) * 4 bytes
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    ws = torch.zeros(sms * max(h, 128) * 8 * (MLA_KV_LORA_RANK + 1) * 4, dtype=torch.int8, device=q.device)
    from tokenspeed_mla import tokenspeed_mla_decode

    out, lse2 = tokenspeed_mla_decode(
        query=q.contiguous(), kv_cache=kv, workspace_buffer=ws, kv_lora_rank=MLA_KV_LORA_RANK,
        qk_rope_head_dim=MLA_QK_ROPE_DIM, block_tables=bt, seq_lens=seq, max_seq_len=int(seq.max()),
        softmax_scale=bmm1, output_scale=bmm2, causal_mask=bool(inp["causal"]), return_lse=True,
    )
    return {"out": out, "lse": base2_lse_to_natural(lse2.reshape(b, s_q, h))}


def _tokenspeed_prefill_call(case) -> dict:
    inp = case.inputs
    q, k, v = inp["q"], inp["k"], inp["v"]
    if q.shape[-1] != R1_QK_NOPE_DIM + MLA_QK_ROPE_DIM or v.shape[-1] != R1_V_HEAD_DIM:
        raise UnsupportedCase("TokenSpeed MLA prefill is specialised for DeepSeek-R1 dims (d_qk 192, d_v 128)")
    cq, ck = inp["cu_seqlens_q"].to(torch.int32), inp["cu_seqlens_kv"].to(torch.int32)
    if not torch.equal(cq.cpu(), ck.cpu()):
        # the FMHA's causal alignment for q_len != kv_len is not documented (window_right = 0)
        raise UnsupportedCase("this adapter covers new-token prefill (cu_seqlens_q == cu_seqlens_kv) only")
    lens = (ck[1:] - ck[:-1]).contiguous()
    from tokenspeed_mla import tokenspeed_mla_prefill

    out = tokenspeed_mla_prefill(
        query=q.contiguous(), key=k.contiguous(), value=v.contiguous(), seq_lens=lens, cum_seq_lens=ck.contiguous(),
        max_seq_len=int(lens.max()), batch_size=int(lens.numel()), softmax_scale=float(inp["scale"]),
        is_causal=bool(inp["causal"]), return_lse=False,
    )
    return {"out": out}


ENTRIES: list[KernelEntry] = [
    KernelEntry(
        name="tokenspeed_mla.decode",
        stage="dense_mla_decode",
        family="CuTe-DSL",
        source="tokenspeed_mla.tokenspeed_mla_decode",
        archs=SM100_ARCHS,
        dtypes=("bfloat16", "float8_e4m3fn"),
        policies={"lse": LseConvention.NATURAL_SINKFREE.value, "nan": NanPolicy.PROPAGATE.value},
        tolerance_scope="tokenspeed_mla.decode",
        probe=_tokenspeed_sm100,
        call=_tokenspeed_decode_call,
        notes="DeepSeek-R1 dims only (kv_lora 512, rope 64); vLLM runs it with FP8 q/cache; base-2 LSE "
              "converted to natural. Not run on hardware by its author (no SM100).",
    ),
    KernelEntry(
        name="tokenspeed_mla.prefill",
        stage="dense_mla_prefill",
        family="CuTe-DSL",
        source="tokenspeed_mla.tokenspeed_mla_prefill",
        archs=SM100_ARCHS,
        dtypes=("bfloat16",),
        policies={"nan": NanPolicy.PROPAGATE.value},
        tolerance_scope="tokenspeed_mla.prefill",
        probe=_tokenspeed_sm100,
        call=_tokenspeed_prefill_call,
        notes="Ragged causal MHA prefill, DeepSeek-R1 per-head dims (192/128). Not run on hardware by its "
              "author (no SM100).",
    ),
]
