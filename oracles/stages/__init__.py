"""One declarative ``StageSpec`` per pipeline stage: the reference outputs under an entry's declared
policies, and the judge that compares a kernel's canonical outputs with them (docs/architecture.md
"The protocols"; spec README 2-4).

``StageSpec(name=, kind=, outputs=, defaults=, expected=, judge=, doc=)`` (registered by keyword):

* ``kind``: ``"bytes"`` (bit-exact over the defined bytes, ``bytes_diff``), ``"index"`` (exact,
  ``bytes_diff.diff_index``) or ``"numeric"`` (``numeric.compare`` with the tolerance record of the
  entry's scope, exact zeros where the reference is exactly zero, and the three-output rule where
  the entry declares ``attention_mode = bf16_p``; the attention stages' softmax statistics also
  get the per-row logit term ``logit_ulps * 2**-23 * F`` of ``row_scale``, and the degenerate
  floor is relative to the case's V RMS / largest ``F``: ``_statistic_allowance``);
* ``outputs``: the canonical output names a kernel's ``call`` returns (``got``);
* ``defaults``: the stage's default policies (used for keys an entry does not declare);
* ``expected(case, policies) -> dict``: reference outputs (CPU); keys starting with ``_`` are
  auxiliary data for the judge (never compared as outputs);
* ``judge(case, expected, got, scope) -> Verdict``.

Policy keys honoured (values from ``reference.policies``; entries declare them in ``policies``):
``scale_rule``, ``fp8``, ``nonfinite``, ``slot_skip``, ``fp8_clamp`` (float, e.g. 224 for the
gfx942 writer), ``writer_rope`` (``identity``: the adapter feeds the canonical pre-roped rows
through an identity RoPE table, so the expected bytes are those of ``apply_rope(k, identity,
rope_arith)``; ``identity_all``: the V4.1 ``rope_quant_insert`` kernels, which rotate all 256
pairs and quantise the fp32 result, ``identity_rotated_pairs``), ``rope_arith``, ``round_to_bf16_first`` (plain FP8 rows), ``ue8m0`` (gather
consumer of scale bytes 0/255), ``nan`` (attention NaN policy), ``index_rule``,
``attention_mode`` (``bf16_p``: also judge by the three-output rule), ``v32_scale_decode``,
``output_inv_roped`` (``true``: the kernel returns inverse-roped attention output), ``gather_out``
(``e4m3_requant``: the gathered values re-encoded as unit-scale E4M3, ``GatherOutput``), ``v41_layout``
(``interleaved`` | ``page_footer``, the V4.1 byte order), ``nvfp4_rule`` (``recip_mul`` |
``div_rn``, the V4.1 NVFP4 scale rule), ``fp8_q`` /
``fp8_kv`` (``true``: the kernel is fed per-tensor E4M3 q / KV rows with scale 1.0, so the oracle
is fed the same FP8-rounded values, attention 7 "Adapters").

Canonical outputs per stage (what ``call`` returns; tensors on any device):

=================  ==========================================================================
swa_write,         ``cache``: the cache after the write, same geometry as ``inputs["cache"]``
compressed_write
plain_write        ``cache``: the plain-row cache after the write
v41_write          ``cache``: the V4.1 528/288-byte cache after the write (record: ``inputs["record"]``)
v41_gather         ``out``: bf16 ``[R, max(gather_lens), 512]`` from a V4.1 cache (``stages.v41``)
gather             ``out``: bf16 ``[R, max(gather_lens), 512]`` (rows past a request's gather
                   length are not compared)
index stages       the production output names of ``reference.cases.index.INDEX_BUILDERS``
                   for the case's ``params["builder"]`` (``case.params["outputs"]``)
decode, prefill    ``out`` ``[T, H, 512]`` (bf16), optional ``lse`` / ``max_logits`` /
                   ``lse_with_sink`` ``[T, H]`` in the oracle convention (natural, sink-free except
                   ``lse_with_sink``, ``-inf`` for lonely rows); with ``output_inv_roped=true`` the
                   expected ``out`` is inverse-roped (needs ``positions`` and ``cos_sin``)
rope               ``out``: fp32 (or bf16) ``x.shape``, bit-exact
compressor         ``normed`` fp32 ``[M, 512]`` (the RMS-normalised compressed rows) and/or ``cache``
                   (the compressed 584-byte cache after the write, same geometry as
                   ``inputs["cache"]``; judged by ``oracles.compressor_tier``, not bit-exact, H7)
kv_norm_rope_store ``cache``: uint8 ``[rows, 512]`` plain unit-scale E4M3 pool after the store
                   (``stages.sglang``)
inv_rope_fp8       ``codes`` uint8 ``[T, G, hpg*512]`` (vLLM's ``[T, G, D]`` view), ``exponents``
                   int ``[T, H, 4]`` (UE8M0 byte - 127), optional ``deq`` fp32 ``[T, H, 512]``
v32_decode,        ``out`` ``[b, s_q, h, 512]``, optional ``lse`` ``[b, s_q, h]`` (oracle
dense_mla_decode   convention)
dense_mla_prefill  ``out`` ``[T, h, 128]``, optional ``lse`` ``[T, h]``
=================  ==========================================================================

Modules (``import dsv4_numerics.oracles.stages`` imports every family, so each stage registers into
``STAGES``; the import order below is the registry order the CLI tables and JSON follow):

=================  ==========================================================================
``core``           ``StageSpec``, the registry (``STAGES``, ``register``, ``get``), ``Verdict``,
                   ``JudgeScope``, the policy lookups, the shared judges and helpers
                   (``writer_rows``, ``judge_gather_rows``, ``judge_attention``,
                   ``attention_outputs``, ``prefill_segments``, the oracle modes ``ORDERED`` / ``FAST``)
``writers``        ``swa_write``, ``compressed_write``, ``v41_write``, ``plain_write``
``gathers``        ``gather``
``indices``        the index stages
``attention``      ``decode``, ``prefill`` (``decode_segments``; ``prefill_segments`` is in ``core``)
``rope``           ``rope``
``compressor``     ``compressor``
``epilogue``       ``inv_rope_fp8``
``mla``            ``v32_decode``, ``dense_mla_decode``, ``dense_mla_prefill``, the V3.2 policy fit
                   and the MLA tolerance records
``v41``            ``v41_gather``
``v41_attention``  ``v41_sparse_decode``, ``v41_sparse_prefill``, ``v41_query_quant``
``v41_compress``   ``v41_compress_insert``
``v41_indexer``    ``v41_indexer_k_store``
``sglang``         ``kv_norm_rope_store``
=================  ==========================================================================
"""

from __future__ import annotations

from dsv4_numerics.reference.errors import InputError

from .core import (
    FAST,
    FAST_ORACLE_STAGES,
    ORDERED,
    STAGES,
    JudgeScope,
    StageSpec,
    Verdict,
    get,
    identity_cos_sin,
    identity_rotated_pairs,
    judge_attention,
    judge_gather_rows,
    prefill_segments,
    register,
    v_rms,
    writer_rows,
    written_slots,
)
# the helpers the stage families and tests use as ``stages.X``
from .core import ATTN_DEFAULTS, ATTN_OUTPUTS, attention_outputs, bytes_verdict  # noqa: F401
from .core import index_rule_of, missing_verdict, policy_value  # noqa: F401

# The stage families register on import, in this order (the registry order).
from . import writers  # noqa: F401  (swa_write, compressed_write, v41_write, plain_write)
from . import gathers  # noqa: F401  (gather)
from . import indices  # noqa: F401  (the index stages)
from . import attention  # noqa: F401  (decode, prefill)
from . import rope  # noqa: F401  (rope)
from . import compressor  # noqa: F401  (compressor)
from . import epilogue  # noqa: F401  (inv_rope_fp8)
from . import mla  # noqa: F401  (v32_decode, dense_mla_decode, dense_mla_prefill)
from . import v41  # noqa: F401  (v41_gather)
from . import v41_attention  # noqa: F401  (v41_sparse_decode / prefill, v41_query_quant)
from . import v41_compress  # noqa: F401  (v41_compress_insert)
from . import v41_indexer  # noqa: F401  (v41_indexer_k_store)
from . import sglang  # noqa: F401  (kv_norm_rope_store)
from .attention import expected_prefill, decode_segments  # noqa: F401

__all__ = ["FAST", "FAST_ORACLE_STAGES", "JudgeScope", "ORDERED", "STAGES", "StageSpec", "Verdict", "decode_segments",
           "get", "identity_cos_sin", "identity_rotated_pairs", "judge_attention", "judge_gather_rows",
           "prefill_segments", "v_rms", "register", "writer_rows", "written_slots", "InputError"]
