"""The DeepSeek-V4.1 sparse-attention oracle: the V4 attention core (``attention.sparse_attention``,
ordered float64, and ``attention_fast.fast_sparse_attention`` with its proven bound) over the
exactly decoded rows of the V4.1 caches (datapath 1.6, H13).

What V4.1 changes, read from vLLM 0.33.0 and its vendored FlashMLA, and what it keeps:

* Records (``cache_v41``): the main (SWA) cache is the 528-byte MXFP8 record; the extra
  (compressed) cache is MXFP8 528 B (``fp8_ds_mla``) or NVFP4 288 B (``nvfp4_ds_mla``: "keeps the
  MXFP8 sliding-window record and stores the compressed cache as NVFP4",
  ``V:models/deepseek_v41/attention.py:522-527``). FlashMLA accepts a 288-byte cache only as
  ``extra_k_cache`` next to a 528-byte ``k_cache`` (``V:third_party/flashmla/flash_mla_interface.py``
  "V4.1 fp4 ... only valid for extra_k_cache, and only when k_cache is in the V4.1 format");
  FlashMLA selects the record from ``k_cache.shape[-1]`` (584 / 528 / 288), there is no flag.
* No bf16 RoPE part: all 512 dims, RoPE included, are quantised (MXFP8: 16 UE8M0 scales of 32
  dims; NVFP4: 32 E4M3 scales of 16 dims). V = the same 512 dims (``head_dim_v = 512``).
* Byte order: interleaved (each token's data then its scales) in vLLM 0.33.0 and FlashMLA from
  2026.09.30; page-footer in FlashInfer 0.7.2 (``V41Layout``). Nothing rejects the wrong order.
* Unchanged: indices are global slots ``block * block_size + offset`` with ``-1`` empty and
  per-token ``topk_length`` / ``extra_topk_length`` prefixes (``V:.../deepseek_v41/nvidia/flashmla.py``
  ``_forward_decode`` passes the same arguments as V4: ``q.unsqueeze(1)``, ``indices=swa_indices``,
  ``topk_length=swa_lens``, ``extra_indices_in_kvcache``, ``extra_topk_length``); the softmax scale
  is ``head_dim ** -0.5`` (``attention.py:363``); the sink is a per-head fp32 ``attn_sink`` padded
  with ``-inf`` (``attention.py:367-369``); outputs are bf16 ``out`` and the natural-log, sink-free
  ``lse`` (the same interface). Prefill dequantises both caches into the bf16 workspace
  (``dequantize_and_gather_k_cache`` reads the record off ``k_cache.shape[-1]``) and runs the
  unchanged ``flash_mla_sparse_fwd``. What V4.1 changes in the index *builders* (compress ratios
  1 and 2 instead of 4 and 128) is upstream of attention.

Exactness of the decoded rows (what makes the V4 bound apply unchanged). ``cache_v41.decode_records``
forms ``value * scale`` exactly and rounds once to bf16; that rounding is exact for every written
record: an E2M1 magnitude (at most 2 significant bits) times an E4M3 scale (at most 4) has at most
6 significant bits and lies in ``[2**-10, 6 * 448]``; an E4M3 code (4 bits) times ``2**(b - 127)``
for the bytes the writers produce (``b in [105, 247]``) lies in ``[2**-31, 2**128)`` except the
one product ``256 * 2**120`` a group at the very top of bf16 could round to (bf16 ``inf``, as any
bf16 consumer gets). So the rows are bf16 values, every ``q * k`` product is exact in float64, and
``attention_fast``'s derivation (which assumes bf16 or power-of-two-scaled FP8 rows) holds as for V4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..caches import v41 as cache_v41
from .ordered import Segment
from ..errors import check_enum, fail
from ..policies import IndexRule, Ue8m0Consumer, V41Layout, V41Record

__all__ = ["V41Paged", "v41_segments", "check_v41_pairing"]


@dataclass(frozen=True)
class V41Paged:
    """One V4.1 segment: a paged cache of ``record`` (``[num_blocks, >= bs*R]`` uint8) with its
    ``[T, K]`` global-slot indices (``-1`` empty) and ``[T]`` prefix lengths (None = K)."""

    cache: torch.Tensor
    block_size: int
    record: V41Record
    idx: torch.Tensor
    length: torch.Tensor | None = None


def check_v41_pairing(fn: str, main: V41Paged, extra: V41Paged | None) -> None:
    """FlashMLA's V4.1 contract: the main cache is MXFP8 (528 B); NVFP4 (288 B) only as the extra cache."""
    if check_enum(fn, "main.record", V41Record, main.record) is not V41Record.MXFP8:
        fail(fn, "main.record", "must be mxfp8_528: the 288-byte NVFP4 record is valid only as the extra "
             "(compressed) cache next to a 528-byte main cache", main.record)
    if extra is not None:
        check_enum(fn, "extra.record", V41Record, extra.record)


def v41_segments(main: V41Paged, extra: V41Paged | None, layout: V41Layout | str,
                 rule: IndexRule | str = IndexRule.MINUS1_ONLY,
                 consumer: Ue8m0Consumer | str = Ue8m0Consumer.EXACT,
                 extra_layout: V41Layout | str | None = None) -> list[Segment]:
    """The oracle segments ``[main, extra?]`` over the exactly decoded rows (module docstring) of the
    V4.1 caches read in ``layout`` (``extra_layout``: the extra cache's, default ``layout``), on the
    caches' device. ``consumer``: how UE8M0 bytes 0 / 255 of the MXFP8 records are read (H4)."""
    fn = "v41_segments"
    check_v41_pairing(fn, main, extra)
    layout = check_enum(fn, "layout", V41Layout, layout)
    extra_layout = layout if extra_layout is None else check_enum(fn, "extra_layout", V41Layout, extra_layout)
    rule = check_enum(fn, "rule", IndexRule, rule)
    segs = []
    for seg, lay in ((main, layout), (extra, extra_layout)):
        if seg is None:
            continue
        rows = cache_v41.dequantize_all(seg.cache, seg.block_size, seg.record, lay, consumer)
        segs.append(Segment(rows, seg.idx.to(rows.device),
                            None if seg.length is None else seg.length.to(rows.device), rule))
    return segs
