"""One declarative ``StageSpec`` per pipeline stage: the reference outputs under an entry's declared
policies, and the judge that compares a kernel's canonical outputs with them (DESIGN.md
"The protocols"; spec README 2-4).

``StageSpec(name, kind, outputs, defaults, expected, judge)``:

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
v41_gather         ``out``: bf16 ``[R, max(gather_lens), 512]`` from a V4.1 cache (``stages_v41``)
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
                   (``stages_sglang``)
inv_rope_fp8       ``codes`` uint8 ``[T, G, hpg*512]`` (vLLM's ``[T, G, D]`` view), ``exponents``
                   int ``[T, H, 4]`` (UE8M0 byte - 127), optional ``deq`` fp32 ``[T, H, 512]``
v32_decode,        ``out`` ``[b, s_q, h, 512]``, optional ``lse`` ``[b, s_q, h]`` (oracle
dense_mla_decode   convention)
dense_mla_prefill  ``out`` ``[T, h, 128]``, optional ``lse`` ``[T, h]``
=================  ==========================================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dsv4_numerics.reference.caches import model1 as cache_model1

from dsv4_numerics.reference.caches import plain as cache_plain

from dsv4_numerics.reference.caches import v41 as cache_v41
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.constants import HEAD_DIM, ROPE_DIM
from dsv4_numerics.reference.detmath import fixed_sum
from dsv4_numerics.reference.errors import InputError, UnsupportedCase, fail
from dsv4_numerics.reference.policies import (
    AttentionMode,
    Fp8Decode,
    Fp8Flavour,
    Fp8Subnormals,
    GatherOutput,
    MissingLengths,
    NanPolicy,
    NonFinite,
    Nvfp4ScaleRule,
    RopeArithmetic,
    ScaleRule,
    SlotSkip,
    Ue8m0Consumer,
    V41Layout,
)

from . import bytes_diff as bd
from .bytes_diff_v41 import diff_v41
from . import numeric as nm
from .row_scale import logit_allowance, logit_scale
from .tolerances import Tolerances, default_tolerances


@dataclass
class Verdict:
    """A judge's decision. ``rule``: the deciding rule (``"bit_exact"``, ``"out:cosine"``, ...);
    ``worst_ulps``: worst element error in ulps of the output format at the reference value, over
    the elements where the relative criterion governs (numeric stages; ``NumericReport.max_ulps_rel_regime``);
    ``headroom``: min tolerance/observed (``< 1`` on a numeric failure, 0 on a bytes failure,
    ``inf`` when bit-exact); ``details``: JSON-able decoded diffs / numeric reports."""

    passed: bool
    rule: str
    message: str = ""
    worst_ulps: float | None = None
    headroom: float | None = None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class JudgeScope:
    """The context a judge needs: the entry's tolerance scope name (``kernel``), the architecture
    tag for tolerance lookup, the entry's declared policies and the tolerance records."""

    kernel: str
    arch: str = "*"
    policies: dict[str, Any] = field(default_factory=dict)
    tolerances: Tolerances | None = None

    def tol(self) -> Tolerances:
        return self.tolerances if self.tolerances is not None else default_tolerances()


@dataclass(frozen=True)
class StageSpec:
    name: str
    kind: str
    outputs: tuple[str, ...]
    defaults: dict[str, Any]
    expected: Callable[[Case, dict], dict]
    judge: Callable[[Case, dict, dict, JudgeScope], Verdict]
    doc: str = ""

    def policies(self, declared: dict | None) -> dict[str, Any]:
        """The stage defaults overridden by the entry's declared policies (values as strings)."""
        p = dict(self.defaults)
        for k, v in (declared or {}).items():
            p[k] = v.value if hasattr(v, "value") else v
        return p


def _pol(policies: dict | None, key: str, default: Any) -> Any:
    v = (policies or {}).get(key, default)
    return v.value if hasattr(v, "value") else v


def _flag(policies: dict | None, key: str, default: bool = False) -> bool:
    v = (policies or {}).get(key)
    if v is None:
        return default
    return str(v).lower() in ("true", "1", "yes")


def _clamp(policies: dict | None) -> float | None:
    p = policies or {}
    v = p.get("fp8_clamp", p.get("clamp"))
    return None if v in (None, "", "none") else float(v)


def _missing(name: str, got: dict) -> Verdict:
    have = sorted(got) if isinstance(got, dict) else type(got).__name__
    return Verdict(False, "missing_output", f"the kernel returned no '{name}' (returned {have})", headroom=0.0)


# --------------------------------------------------------------------------- writer helpers


def identity_cos_sin() -> torch.Tensor:
    """fp32 ``[1, 64]`` RoPE table row with cos = 1, sin = +0 (the adapters' identity table)."""
    return torch.cat([torch.ones(1, ROPE_DIM // 2), torch.zeros(1, ROPE_DIM // 2)], dim=1)


def writer_rows(k: torch.Tensor, policies: dict | None) -> torch.Tensor:
    """The rows the writer quantises: ``k`` itself, under ``writer_rope=identity_all`` the fp32
    ``identity_rotated_pairs(k)``, or under ``writer_rope=identity`` the
    bf16 of ``apply_rope(k, identity, rope_arith)`` (an identity table is not an exact identity:
    -0.0 may become +0.0 and a non-finite RoPE lane poisons its pair partner)."""
    mode = _pol(policies, "writer_rope", "none")
    if mode == "identity_all":
        return identity_rotated_pairs(k, _pol(policies, "rope_arith", RopeArithmetic.FMA_TRITON.value))
    if mode != "identity":
        return k
    from dsv4_numerics.reference.pipeline.rope import apply_rope

    arith = _pol(policies, "rope_arith", RopeArithmetic.FMA.value)
    pos = torch.zeros(k.shape[0], dtype=torch.int64)
    return apply_rope(k.cpu(), pos, identity_cos_sin(), inverse=False, arithmetic=arith).to(torch.bfloat16)


def identity_rotated_pairs(k: torch.Tensor, arith: RopeArithmetic | str) -> torch.Tensor:
    """fp32 rows the V4.1 ``rope_quant_insert`` kernels quantise when fed an identity table
    (``writer_rope = identity_all``): ALL 256 GPT-J pairs of the row go through the rotation (the
    NoPE pairs load ``(cos, sin) = (1, 0)``, ``V:.../deepseek_v41/common/ops/
    fused_compress_quant_cache.py:446-455``), so signed zeros and non-finite pair partners change
    in every dim, and the fp32 result is quantised without a bf16 rounding."""
    from dsv4_numerics.reference.pipeline.rope import rope_pairs

    x = k.cpu().to(torch.float64)
    one, zero = torch.ones((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    e, o = rope_pairs(x[..., 0::2], x[..., 1::2], one, zero, False, RopeArithmetic(arith))
    return torch.stack((e, o), dim=-1).reshape(k.shape).to(torch.float32)


def written_slots(slot_mapping: torch.Tensor, n_rows: int, policies: dict | None) -> torch.Tensor:
    """Slots a writer fills (``-1`` for skipped tokens), aligned with the rows of ``k``: every
    negative slot is skipped (under ``slot_skip=minus1_only`` any other negative value is out of
    contract and the reference insert rejects it)."""
    s = slot_mapping.to(torch.int64).cpu()[:n_rows]
    return torch.where(s >= 0, s, torch.full_like(s, -1))


# --------------------------------------------------------------------------- bytes stages


def _expected_model1(case: Case, policies: dict) -> dict:
    inp = case.inputs
    k = writer_rows(inp["k"], policies)
    cache = cache_model1.insert(
        inp["cache"], k, inp["slot_mapping"], inp["block_size"],
        rule=_pol(policies, "scale_rule", ScaleRule.AMAX_CLAMP.value),
        flavour=_pol(policies, "fp8", Fp8Flavour.E4M3FN.value),
        nonfinite=_pol(policies, "nonfinite", NonFinite.FINITE.value),
        slot_skip=_pol(policies, "slot_skip", SlotSkip.ALL_NEGATIVE.value),
        clamp=_clamp(policies),
        subnormals=_pol(policies, "fp8_subnormals", Fp8Subnormals.KEEP.value))
    return {"cache": cache, "_k": k}


def _judge_model1(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    if "cache" not in got:
        return _missing("cache", got)
    inp = case.inputs
    k = expected.get("_k", inp["k"])
    slots = written_slots(inp["slot_mapping"], k.shape[0], scope.policies)
    rep = bd.diff_model1(expected["cache"], got["cache"].cpu(), block_size=inp["block_size"], slots=slots,
                         source_rows=k, policies=scope.policies, initial=inp["cache"])
    return _bytes_verdict(rep)


def _bytes_verdict(rep: bd.BytesReport) -> Verdict:
    if rep.passed:
        return Verdict(True, "bit_exact", "", headroom=math.inf, details=rep.to_dict())
    rule = rep.rule if rep.rule != "bit_exact" else ("clobber" if rep.differing == 0 and rep.clobbered else "bit_exact")
    return Verdict(False, rule, rep.summary(max_lines=2).replace("\n", " | "), headroom=0.0, details=rep.to_dict())


def _expected_v41(case: Case, policies: dict) -> dict:
    inp = case.inputs
    cache = cache_v41.insert(
        inp["cache"], writer_rows(inp["k"], policies), inp["slot_mapping"], inp["block_size"], inp["record"],
        _pol(policies, "v41_layout", V41Layout.INTERLEAVED.value),
        mxfp8_rule=_pol(policies, "scale_rule", ScaleRule.AMAX_CLAMP.value),
        nonfinite=_pol(policies, "nonfinite", NonFinite.FINITE.value),
        nvfp4_rule=_pol(policies, "nvfp4_rule", Nvfp4ScaleRule.RECIP_MUL.value),
        slot_skip=_pol(policies, "slot_skip", SlotSkip.ALL_NEGATIVE.value))
    return {"cache": cache}


def _judge_v41(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    """diff_v41 over the written records in the declared byte order, then every other byte
    (other slots, page tails) must be the initial cache's (a clobber check)."""
    if "cache" not in got:
        return _missing("cache", got)
    inp = case.inputs
    g = got["cache"].cpu()
    layout = _pol(scope.policies, "v41_layout", V41Layout.INTERLEAVED.value)
    slots = inp["slot_mapping"]
    if tuple(g.shape) != tuple(inp["cache"].shape) or g.dtype != torch.uint8:
        return Verdict(False, "shape", f"cache: got {g.dtype}{tuple(g.shape)}, expected uint8{tuple(inp['cache'].shape)}",
                       headroom=0.0)
    rep = diff_v41(expected["cache"], g, slots, inp["block_size"], inp["record"], layout)
    mask = cache_v41.defined_byte_mask(inp["cache"], slots, inp["block_size"], inp["record"], layout)
    clobbered = int(((g != inp["cache"]) & ~mask).sum())
    if clobbered:
        rep.passed, rep.clobbered = False, clobbered
        rep.message = (rep.message + "; " if rep.message else "") + f"{clobbered} bytes changed outside the written records"
    return _bytes_verdict(rep)


def _expected_plain(case: Case, policies: dict) -> dict:
    inp = case.inputs
    k = writer_rows(inp["k"], policies)
    skip = _pol(policies, "slot_skip", SlotSkip.ALL_NEGATIVE.value)
    if inp["layout"] == "bf16":
        cache = cache_plain.insert_bf16_rows(inp["cache"], k, inp["slot_mapping"], slot_skip=skip)
    else:
        cache = cache_plain.insert_fp8_rows(
            inp["cache"], k, inp["slot_mapping"], kv_scale=inp.get("kv_scale", 1.0),
            round_to_bf16_first=_flag(policies, "round_to_bf16_first", True),
            nonfinite=_pol(policies, "nonfinite", NonFinite.FINITE.value), slot_skip=skip)
    return {"cache": cache}


def _judge_plain(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    if "cache" not in got:
        return _missing("cache", got)
    e, g = expected["cache"], got["cache"].cpu()
    bs = case.inputs["block_size"]

    def where(idx):
        return {"slot": idx[0] * bs + idx[1], **bd._dim_part(idx[-1])}

    if e.dtype == torch.bfloat16:
        rep = bd.diff_values(e, g, layout="plain_bf16", describe=where)
    else:
        g8 = g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g
        e8 = e.view(torch.uint8) if e.dtype == torch.float8_e4m3fn else e
        rep = bd.diff_plain_rows(e8, g8, fp8_scale=case.inputs.get("kv_scale", 1.0))
    return _bytes_verdict(rep)


def _expected_gather(case: Case, policies: dict) -> dict:
    inp = case.inputs
    out, valid = cache_model1.gather(
        inp["cache"], inp["block_table"], inp["seq_lens"], inp["block_size"], inp.get("gather_lens"),
        flavour=_pol(policies, "fp8", Fp8Flavour.E4M3FN.value),
        consumer=_pol(policies, "ue8m0", Ue8m0Consumer.EXACT.value))
    if _pol(policies, "gather_out", GatherOutput.BF16.value) == GatherOutput.E4M3_REQUANT.value:
        out = cache_plain.requantize_e4m3(out)
    return {"out": out, "_valid": valid}


def _gather_alternatives(case: Case, policies: dict) -> dict[str, torch.Tensor]:
    """The gather under each single other policy (explanations for a failing kernel)."""
    alts = {}
    inp = case.inputs
    for f in Fp8Flavour:
        if f.value != _pol(policies, "fp8", Fp8Flavour.E4M3FN.value):
            p = dict(policies, fp8=f.value)
            alts[f"fp8={f.value} (codes read in the other FP8 flavour)"] = _expected_gather(case, p)["out"]
    for g in GatherOutput:
        if g.value != _pol(policies, "gather_out", GatherOutput.BF16.value):
            alts[f"gather_out={g.value}"] = _expected_gather(case, dict(policies, gather_out=g.value))["out"]
    return alts


def _judge_gather(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    return judge_gather_rows(expected, got, lambda: _gather_alternatives(case, scope.policies))


def judge_gather_rows(expected: dict, got: dict, alternatives: Callable[[], dict[str, torch.Tensor]]) -> Verdict:
    """Bit-exact judge of a gather's ``out`` over the rows the reference marks ``_valid`` (a wider
    kernel workspace is cut to the reference width); on a failure, ``alternatives()`` (label ->
    expected ``out`` under one other policy) explain it."""
    if "out" not in got:
        return _missing("out", got)
    e, valid = expected["out"], expected["_valid"]
    g = got["out"].cpu()
    if g.dim() == 3 and g.shape[0] == e.shape[0] and g.shape[1] >= e.shape[1] and g.shape[2] == e.shape[2]:
        g = g[:, : e.shape[1]]  # a kernel workspace may be wider than the longest gather
    if tuple(g.shape) != tuple(e.shape) or g.dtype != e.dtype:
        return Verdict(False, "shape", f"got {g.dtype}{tuple(g.shape)}, expected {e.dtype}{tuple(e.shape)}", headroom=0.0)
    mask = valid.unsqueeze(-1).expand_as(e)
    e_m = torch.where(mask, e, torch.zeros_like(e))
    g_m = torch.where(mask, g, torch.zeros_like(g))

    def where(idx):
        return {"request": idx[0], "row": idx[1], **bd._dim_part(idx[-1])}

    rep = bd.diff_values(e_m, g_m, layout="gather_bf16", describe=where)
    if not rep.passed:
        alts = {k: torch.where(mask, v, torch.zeros_like(v)) for k, v in alternatives().items()}
        rep.explanations.extend(bd.match_alternatives(g_m, alts))
        rep.message = bd._first_explanation(rep)
    return _bytes_verdict(rep)


# --------------------------------------------------------------------------- index stages


def _expected_index(case: Case, policies: dict) -> dict:
    from dsv4_numerics.reference.cases.index import run_index_case

    return dict(run_index_case(case, policies))


def _judge_index(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    reports = {}
    failed = []
    for name, e in expected.items():
        if name.startswith("_"):
            continue
        if name not in got:
            return _missing(name, got)
        rep = bd.diff_index(e, got[name], name=name)
        reports[name] = rep.to_dict()
        if not rep.passed:
            failed.append((name, rep))
    if not failed:
        return Verdict(True, "exact", "", headroom=math.inf, details=reports)
    name, rep = failed[0]
    msg = "; ".join(f"{n}: {r.differing}/{r.compared} entries differ" + (f" ({r.message})" if r.message else "")
                    + (f", first {r.differences[0].line()}" if r.differences else f" -- {r.message}") for n, r in failed)
    return Verdict(False, f"{name}:{rep.rule if rep.rule != 'bit_exact' else 'exact'}", msg, headroom=0.0, details=reports)


# --------------------------------------------------------------------------- numeric judge


# outputs judged with another output's records: the sink-merged LSE is an LSE; max_logits falls
# back to the LSE record where a tier has no max_logits default (both are fp32 softmax statistics)
_TOL_FALLBACK = {"lse_with_sink": "lse", "max_logits": "lse"}


def _lookup(tols: Tolerances, scope: JudgeScope, name: str, dtype: str, params: dict):
    try:
        return tols.lookup(scope.kernel, name, dtype, scope.arch, params)
    except InputError:
        if name not in _TOL_FALLBACK:
            raise
        return tols.lookup(scope.kernel, _TOL_FALLBACK[name], dtype, scope.arch, params)


def _dtype_name(case: Case, policies: dict | None = None) -> str:
    """Tolerance-scope dtype: the dtype the kernel computes QK with -- ``float8_e4m3fn`` under
    ``fp8_q=true`` (the adapter feeds FP8 q), else the case's ``q`` dtype."""
    if _flag(policies, "fp8_q"):
        return "float8_e4m3fn"
    q = case.inputs.get("q")
    return str(q.dtype).replace("torch.", "") if isinstance(q, torch.Tensor) else "*"


def judge_attention(case: Case, expected: dict, got: dict, scope: JudgeScope,
                    outputs: tuple[str, ...] = ("out", "lse", "max_logits")) -> Verdict:
    """Numeric judge of attention-like outputs (module docstring).

    ``out`` is required; ``lse``/``max_logits`` are judged when the kernel returns them.
    ``expected["_zero"]`` (bool, broadcastable to ``out``'s leading dims) marks (token, head) rows
    whose reference output is exactly zero (lonely queries, sink = +inf): the kernel must return
    exact zeros there (attention 7 tier A); the tolerance comparison covers the other rows.
    ``expected["_same_precision"]``: the bf16_p oracle output, for the three-output rule.
    """
    reports: dict[str, Any] = {}
    checks: list[tuple[str, bool, str, float, float | None]] = []  # (rule, passed, msg, headroom, ulps)
    tols = scope.tol()
    dtype = _dtype_name(case, scope.policies)
    for name in outputs:
        if name not in expected:
            continue
        if name not in got:
            if name == "out":
                return _missing(name, got)
            continue
        e = expected[name]
        g = got[name].detach().cpu()
        if tuple(g.shape) != tuple(e.shape):
            return Verdict(False, f"{name}:shape", f"{name}: got shape {tuple(g.shape)}, expected {tuple(e.shape)}", headroom=0.0)
        tol = _lookup(tols, scope, name, dtype, case.params)
        fmt = nm.format_of(g.dtype) if g.dtype.is_floating_point else "fp32"
        if tol.metric != "kernelkit":
            fail("judge_attention", "tolerances", f"output '{name}' needs a kernelkit record (got {tol.metric})")
        zero = expected.get("_zero") if name == "out" else None
        if zero is not None and bool(zero.any()):
            zmask = zero.reshape(*zero.shape, *([1] * (e.dim() - zero.dim()))).expand_as(e)
            rz = nm.compare(torch.where(zmask, g.to(torch.float64), torch.zeros((), dtype=torch.float64)),
                            torch.zeros_like(e), atol=0.0, rtol=0.0, cos_tol=0.0, fmt=fmt,
                            name=f"{name}[exact-zero rows]", zero_ref="exact")
            reports[f"{name}:exact_zero"] = rz.to_dict()
            checks.append((f"{name}:{rz.rule}", rz.passed, rz.message, rz.headroom, None))
            keep = ~zmask
        else:
            keep = torch.ones_like(e, dtype=torch.bool)
        if bool(keep.any()):
            vr = expected.get("_vrms")
            vr = float(vr) if vr is not None else None
            if tol.atol_unit == "vrms" and vr is None:
                fail("judge_attention", "expected", f"must carry '_vrms' for the {tol.atol_unit} atol of '{name}'")
            atol = tol.atol_for(vr)
            allow, ref_scale = _statistic_allowance(name, tol, expected, e.shape, vr)
            r = nm.compare(g.to(torch.float64)[keep], e[keep], atol=atol, rtol=tol.rtol, cos_tol=tol.cos_tol,
                           fmt=fmt, name=name, ref_scale=ref_scale, allow=None if allow is None else allow[keep])
            rd = r.to_dict()
            rd["tolerance"] = {"line": tol.line, "tier": tol.tier, "kind": tol.kind, "scope": tol.scope.to_dict(),
                               "atol_unit": tol.atol_unit, "vrms": vr, "logit_ulps": tol.logit_ulps,
                               "max_logit_allowance": float(allow.max()) if allow is not None and allow.numel() else 0.0,
                               "ref_scale": ref_scale}
            reports[name] = rd
            checks.append((f"{name}:{r.rule}", r.passed, r.message, r.headroom, r.max_ulps_rel_regime))
        if name == "out" and "_same_precision" in expected and tol.three_output_k:
            t3 = nm.three_output(g, e, expected["_same_precision"], k=tol.three_output_k, fmt=fmt, name=name)
            reports[f"{name}:three_output"] = t3.to_dict()
            checks.append((f"{name}:{t3.rule}", t3.passed, t3.message, t3.headroom, None))
    if "_oracle" in expected:
        reports["oracle"] = expected["_oracle"]
    if not checks:
        return Verdict(False, "no_outputs", "nothing comparable was returned", headroom=0.0, details=reports)
    ulps = [c[4] for c in checks if c[4] is not None]
    worst = max(ulps) if ulps else None
    head = min(c[3] for c in checks)
    bad = [c for c in checks if not c[1]]
    if bad:
        rule, _, msg, _, _ = bad[0]
        return Verdict(False, rule, "; ".join(f"{c[0]}: {c[2]}" for c in bad), worst, head, reports)
    binding = min(checks, key=lambda c: c[3])[0]
    return Verdict(True, binding, "", worst, head, reports)


def _statistic_allowance(name: str, tol, expected: dict, shape: tuple, vr: float | None):
    """``(allow, ref_scale)`` for ``numeric.compare`` of output ``name``: the softmax statistics
    (``[T, H]``: lse, lse_with_sink, max_logits) get the per-row logit term ``tol.logit_ulps * 2**-23
    * F`` (``row_scale``; None without ``_logit_scale`` or ``logit_ulps``) and are "trivially small"
    relative to their largest ``F``; ``out`` relative to the case's V RMS. The scale falls back to 1
    (kernelkit's absolute floor) where the case has none (0: nothing valid, or not carried)."""
    f = expected.get("_logit_scale")
    if name == "out":
        return None, (vr if vr is not None and 0 < vr < math.inf else 1.0)
    if f is None or tuple(f.shape) != tuple(shape):
        return None, 1.0
    fmax = float(f.max()) if f.numel() else 0.0
    allow = logit_allowance(tol.logit_ulps, f) if tol.logit_ulps else None
    return allow, (fmax if 0 < fmax < math.inf else 1.0)


def v_rms(segments: list, num_tokens: int, d_v: int) -> float:
    """RMS of the first ``d_v`` dims of every row that some valid slot references (each row once,
    non-finite values excluded): the value scale of a case, the unit of ``atol_unit="vrms"``."""
    from dsv4_numerics.reference.attention.ordered import segment_validity

    valid = segment_validity(segments, num_tokens)
    sq, n = 0.0, 0
    col = 0
    for seg in segments:
        K = seg.idx.shape[1]
        v = valid[:, col:col + K]
        col += K
        ids = torch.unique(seg.idx.to(torch.int64)[v])
        if ids.numel() == 0:
            continue
        x = seg.rows.index_select(0, ids.to(seg.rows.device))[:, :d_v].to(torch.float64)
        x = x[torch.isfinite(x)]
        sq += float(fixed_sum(x * x))  # fixed order (derive.py records depend on it)
        n += x.numel()
    return math.sqrt(sq / n) if n else 0.0


def _zero_rows(n_valid: torch.Tensor, sink: torch.Tensor | None, H: int) -> torch.Tensor:
    """``[T, H]`` rows whose exact output is 0: no valid key, or sink = +inf."""
    z = (n_valid == 0).reshape(-1, 1).expand(-1, H)
    if sink is not None:
        z = z | torch.isposinf(sink.to(torch.float64)).reshape(1, H)
    return z.clone()


# --------------------------------------------------------------------------- DSv4 attention stages


def _index_rule(case: Case, policies: dict) -> str:
    """The consumer's index rule; a case built for any-out-of-range consumers (out-of-range values
    inside the prefix) is outside a ``-1``-only consumer's contract (attention 2.4, H2)."""
    from dsv4_numerics.reference.policies import IndexRule

    case_rule = case.params.get("index_rule", IndexRule.MINUS1_ONLY.value)
    rule = _pol(policies, "index_rule", case_rule)
    if rule == IndexRule.MINUS1_ONLY.value and case_rule == IndexRule.ANY_OUT_OF_RANGE_INVALID.value:
        raise UnsupportedCase("the case puts out-of-range index values inside the prefix, which a "
                              "-1-only consumer (index_rule=minus1_only) treats as addresses (attention 2.4, H2)")
    return rule


# judging oracle modes (policy keys ``oracle`` / ``oracle_device``, set by ``matrix.run_entry``,
# never by entries):
# ``ordered`` = reference.attention.ordered (fixed order, fixtures), ``fast`` = reference.attention.fast
# (unordered float64 GEMMs with a returned bound; the default on a CUDA device)
ORDERED, FAST = "ordered", "fast"
FAST_ORACLE_STAGES = ("decode", "prefill", "v41_sparse_decode", "v41_sparse_prefill")


def _attention_outputs(case: Case, policies: dict, q: torch.Tensor, segs: list) -> dict:
    """Oracle outputs (and judge aux, all on the CPU) for ``q`` over ``segs`` under ``policies``.
    Under ``oracle=fast`` the attention itself runs on ``oracle_device`` (the kernel's device;
    ``_expected_decode`` dequantises the decode caches there too, the rest of the preparation stays
    on the CPU). ``_oracle``: which oracle mode ran, where, and its bound
    (max per output of ``|fast - ordered|``; 0 for the ordered oracle)."""
    from dsv4_numerics.reference.attention.ordered import Segment, sparse_attention

    inp = case.inputs
    nan = _pol(policies, "nan", NanPolicy.PROPAGATE.value)
    sink = inp.get("sink")
    T, H, _ = q.shape
    if _flag(policies, "fp8_q"):  # attention 7 adapters: feed the oracle the FP8-rounded q
        q = _e4m3_values(q)
    if _flag(policies, "fp8_kv"):  # the rows the kernel consumes: per-tensor E4M3 (scale 1.0)
        segs = [Segment(_e4m3_values(s.rows), s.idx, s.length, s.rule) for s in segs]
    if _pol(policies, "oracle", ORDERED) == FAST:
        from dsv4_numerics.reference.attention.fast import fast_sparse_attention

        from dsv4_numerics.reference.attention.ordered import OracleOut

        dev = torch.device(_pol(policies, "oracle_device", "cpu"))
        dsegs = [Segment(s.rows.to(dev), s.idx.to(dev), None if s.length is None else s.length.to(dev), s.rule)
                 for s in segs]
        fx = fast_sparse_attention(q.to(dev), dsegs, inp["scale"], None if sink is None else sink.to(dev),
                                   nan_policy=nan)
        ex = OracleOut(*(t.cpu() for t in (fx.out, fx.lse, fx.lse_with_sink, fx.max_logits, fx.n_valid)))
        names = [k for k, b in fx.bound.items() if b.numel()]
        maxima = torch.stack([fx.bound[k].max() for k in names]).tolist() if names else []  # one sync
        oracle = {"mode": FAST, "device": str(dev), "exact_logits": fx.exact_logits,
                  "bound": {k: dict(zip(names, maxima)).get(k, 0.0) for k in fx.bound}}
    else:
        sink = None if sink is None else sink.to(q.device)  # the ordered oracle runs where q is
        ex = sparse_attention(q, segs, inp["scale"], sink, nan_policy=nan)
        oracle = {"mode": ORDERED, "device": str(q.device), "bound": 0.0}
    out = {"out": ex.out, "lse": ex.lse, "max_logits": ex.max_logits, "lse_with_sink": ex.lse_with_sink,
           "_zero": _zero_rows(ex.n_valid, sink, H), "_vrms": torch.tensor(v_rms(segs, T, HEAD_DIM)),
           "_logit_scale": logit_scale(q, segs, inp["scale"]), "_oracle": oracle}
    if _pol(policies, "attention_mode", AttentionMode.EXACT.value) == AttentionMode.BF16_P.value:
        csegs = [Segment(s.rows.to(q.device), s.idx.to(q.device), None if s.length is None else s.length.to(q.device),
                         s.rule) for s in segs]  # the ordered oracle runs where q is (the CPU)
        out["_same_precision"] = sparse_attention(q, csegs, inp["scale"], sink, nan_policy=nan,
                                                  mode=AttentionMode.BF16_P).out
    if _flag(policies, "output_inv_roped"):
        out = _inv_roped(case, policies, out)
    return out


def _e4m3_values(x: torch.Tensor) -> torch.Tensor:
    """Exact values of per-tensor (scale 1.0) RNE saturating E4M3FN codes of ``x`` (bf16 result;
    NaN stays NaN): the FP8 routes' ``q`` / KV with vLLM's ``q_scale = kv_scale = 1``."""
    from dsv4_numerics.reference.formats.fp8 import decode_e4m3fn, encode_e4m3fn

    codes = encode_e4m3fn(x, nonfinite=NonFinite.TORCH_SATURATING, clamp=448.0)
    return decode_e4m3fn(codes).to(torch.bfloat16)


def _inv_roped(case: Case, policies: dict, out: dict) -> dict:
    """Outputs of a kernel that returns its attention output inverse-roped (ROCm decode epilogue,
    FlashInfer RopeQuant; attention 3.3, H15): rotate the oracle output (fp32, then float64)."""
    from dsv4_numerics.reference.attention.epilogue import inverse_rope_output

    inp = case.inputs
    cs = inp.get("cos_sin", inp.get("cos_sin_cache"))
    if cs is None or inp.get("positions") is None:
        raise UnsupportedCase("output_inv_roped=true needs 'positions' and 'cos_sin' in the case")
    arith = _pol(policies, "rope_arith", RopeArithmetic.FMA_TRITON.value)
    for k in ("out", "_same_precision"):
        if k in out:
            rot = inverse_rope_output(out[k].to(torch.float32), inp["positions"], cs, arithmetic=arith)
            out[k] = rot.to(torch.float64)
    return out


def decode_segments(case: Case, policies: dict, device: str | torch.device | None = None) -> list:
    """The oracle segments of a ``decode`` case: ``[SWA, compressed?]`` over the exactly
    dequantised 584-byte caches (SWA in the declared ``fp8`` flavour; compressed always OCP).
    ``device``: dequantise there (the reference gives the same bits on every device; a production
    cache dequantised on the GPU takes milliseconds instead of seconds); None: where the case is."""
    from dsv4_numerics.reference.attention.ordered import Segment
    from dsv4_numerics.reference.policies import IndexRule

    inp = case.inputs

    def on(x):
        return x if x is None or device is None else x.to(device)

    rule = IndexRule(_index_rule(case, policies))
    read = _pol(policies, "fp8_decode", Fp8Decode.EXACT.value)
    main_rows = cache_model1.dequantize_all(on(inp["swa_cache"]), inp["swa_block_size"],
                                            flavour=_pol(policies, "fp8", Fp8Flavour.E4M3FN.value),
                                            consumer=_pol(policies, "ue8m0", Ue8m0Consumer.EXACT.value), read=read)
    segs = [Segment(main_rows, on(inp["swa_indices"]), on(inp.get("swa_lens")), rule)]
    if "extra_cache" in inp:  # the compressed cache is OCP on every platform (datapath 2.3, H8)
        extra_rows = cache_model1.dequantize_all(on(inp["extra_cache"]), inp["extra_block_size"],
                                                 consumer=_pol(policies, "ue8m0", Ue8m0Consumer.EXACT.value),
                                                 read=read)
        segs.append(Segment(extra_rows, on(inp["extra_indices"]), on(inp.get("extra_lens")), rule))
    return segs


def prefill_segments(case: Case, policies: dict) -> list:
    """The one combined oracle segment of a ``prefill`` case (bf16 workspace rows); a case without
    ``topk_length`` is read per the ``missing_lengths`` policy (``MissingLengths``)."""
    from dsv4_numerics.reference.attention.ordered import Segment
    from dsv4_numerics.reference.policies import IndexRule

    inp = case.inputs
    rule = IndexRule(_index_rule(case, policies))
    length = inp.get("topk_length")
    if length is None and _pol(policies, "missing_lengths", MissingLengths.ALL_COLUMNS.value) == \
            MissingLengths.COUNT_AS_PREFIX.value:
        length = (inp["indices"] >= 0).sum(dim=-1, dtype=torch.int32)  # the count, read as a prefix
    return [Segment(inp["kv"], inp["indices"], length, rule)]


def _expected_decode(case: Case, policies: dict) -> dict:
    # under the fast oracle the caches are dequantised where the attention runs (the kernel's device)
    dev = _pol(policies, "oracle_device", "cpu") if _pol(policies, "oracle", ORDERED) == FAST else None
    return _attention_outputs(case, policies, case.inputs["q"], decode_segments(case, policies, dev))


def _expected_prefill(case: Case, policies: dict) -> dict:
    return _attention_outputs(case, policies, case.inputs["q"], prefill_segments(case, policies))


_ATTN_OUTPUTS = ("out", "lse", "max_logits", "lse_with_sink")


def _judge_attention_stage(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    return judge_attention(case, expected, got, scope, _ATTN_OUTPUTS)


def _expected_rope(case: Case, policies: dict) -> dict:
    from dsv4_numerics.reference.pipeline.rope import apply_rope

    inp = case.inputs
    arith = _pol(policies, "rope_arith", RopeArithmetic.FMA.value)
    return {"out": apply_rope(inp["x"], inp["positions"], inp["cos_sin"], inverse=bool(inp.get("inverse", False)),
                              arithmetic=arith)}


def _judge_rope(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    """Bit-exact (README 2: RoPE is exact with the FMA-contracted arithmetic). A bf16 result is
    compared with the bf16 rounding of the fp32 reference."""
    if "out" not in got:
        return _missing("out", got)
    e, g = expected["out"], got["out"].cpu()
    if g.dtype == torch.bfloat16:
        e = e.to(torch.bfloat16)
    rep = bd.diff_values(e, g, layout=f"rope_{str(g.dtype).replace('torch.', '')}")
    if not rep.passed:
        alts = {}
        for a in RopeArithmetic:
            if a.value != _pol(scope.policies, "rope_arith", RopeArithmetic.FMA.value):
                alt = _expected_rope(case, {"rope_arith": a.value})["out"]
                alts[f"rope_arith={a.value}"] = alt.to(g.dtype) if g.dtype == torch.bfloat16 else alt
        rep.explanations.extend(bd.match_alternatives(g, alts))
        rep.message = bd._first_explanation(rep)
    return _bytes_verdict(rep)


def _expected_inv_rope_fp8(case: Case, policies: dict) -> dict:
    from dsv4_numerics.reference.attention.epilogue import inv_rope_fp8_quant

    inp = case.inputs
    arith = _pol(policies, "rope_arith", RopeArithmetic.FMA_TRITON.value)
    r = inv_rope_fp8_quant(inp["o"], inp["positions"], inp["cos_sin"], inp["heads_per_group"], arithmetic=arith)
    return {"codes": r.codes_tgd.contiguous(), "exponents": r.exponents, "deq": r.dequantized, "_rotated": r.rotated}


def _judge_inv_rope_fp8(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    """Bytes exact from the bf16 attention output (codes ``[T, G, hpg*512]`` and exponents
    ``[T, H, 4]``), then, if the kernel returns ``deq``, tier C on the dequantised values:
    ``|deq - rotated| <= block_mult * 2**e`` with ``e`` the kernel's own block exponent."""
    hpg = case.inputs["heads_per_group"]
    for k in ("codes", "exponents"):
        if k not in got:
            return _missing(k, got)
    T, H, _ = expected["exponents"].shape
    G = H // hpg
    ge = got["exponents"].cpu()
    if tuple(ge.shape) != (T, H, 4) or ge.dtype.is_floating_point:
        return Verdict(False, "shape", f"exponents: got {ge.dtype}{tuple(ge.shape)}, expected int[{T}, {H}, 4]", headroom=0.0)
    rep = bd.diff_output_fp8(expected["codes"], got["codes"].cpu(), expected["exponents"].reshape(T, G, hpg * 4),
                             ge.reshape(T, G, hpg * 4), heads_per_group=hpg)
    v = _bytes_verdict(rep)
    if not v.passed or "deq" not in got:
        return v
    tol = scope.tol().lookup(scope.kernel, "deq", _dtype_name(case, scope.policies), scope.arch, case.params)
    if tol.metric != "block_scale":
        fail("_judge_inv_rope_fp8", "tolerances", f"output 'deq' needs a block_scale record (got {tol.metric})")
    bound = tol.block_mult * torch.pow(2.0, ge.to(torch.float64)).repeat_interleave(128, dim=-1)
    err = (got["deq"].cpu().to(torch.float64) - expected["_rotated"].to(torch.float64)).abs()
    worst = float((err / bound).max())
    head = math.inf if worst == 0 else 1.0 / worst
    if worst > 1.0:
        return Verdict(False, "deq:block_scale", f"|deq - rotated| reaches {worst:.3g} x the tier C bound "
                       f"{tol.block_mult:g} * 2**e", headroom=head, details={"bytes": rep.to_dict()})
    return Verdict(True, "bit_exact+deq:block_scale", "", headroom=head, details={"bytes": rep.to_dict(), "deq_over_bound": worst})


def compressor_fires(inp: dict) -> torch.Tensor:
    """bool ``[M]``: the case's tokens the production compressor writes a record for (state slot
    ``>= 0``, boundary ``(p + 1) % ratio == 0``, compressed slot ``>= 0``; every token when the
    case carries no kernel contract)."""
    pos = inp["positions"].to(torch.int64).cpu()
    fires = (pos + 1) % int(inp["ratio"]) == 0
    for k in ("slot_mapping", "compressed_slot_mapping"):
        if k in inp:
            fires = fires & (inp[k].to(torch.int64).cpu() >= 0)
    return fires


def _expected_compressor(case: Case, policies: dict) -> dict:
    """``normed`` (fp32, compared as float64) and, when the case carries the kernel contract
    (``cache``, ``kv_block_size``, ``compressed_slot_mapping``: ``kernels/vllm_triton.py``
    ``compressor_args``), the ``cache`` after ``cache_model1.insert`` of the bf16 boundary rows of
    the firing tokens under the declared ``scale_rule`` / ``fp8`` (datapath 2.3: OCP on every
    platform), with the compressor tier's error bound ``_bound`` (``oracles.compressor_tier``)."""
    from dsv4_numerics.reference.pipeline.compressor import compressor_boundary

    from .compressor_tier import compressor_error_bound

    inp = case.inputs
    arith = _pol(policies, "rope_arith", RopeArithmetic.FMA_TRITON.value)
    b = compressor_boundary(inp["state"], inp["positions"], inp["ratio"], inp["norm_weight"], inp["eps"],
                            inp["cos_sin"], arithmetic=arith)
    out = {"normed": b.normed.to(torch.float64), "_row_bf16": b.row_bf16}
    if "cache" in inp and "compressed_slot_mapping" in inp:
        fires = compressor_fires(inp)
        slots = inp["compressed_slot_mapping"].to(torch.int64).cpu()[fires]
        out["cache"] = cache_model1.insert(
            inp["cache"], b.row_bf16[fires], slots, inp["kv_block_size"],
            rule=_pol(policies, "scale_rule", ScaleRule.SCALE_CLAMP.value),
            flavour=_pol(policies, "fp8", Fp8Flavour.E4M3FN.value),
            slot_skip=_pol(policies, "slot_skip", SlotSkip.ALL_NEGATIVE.value),
            subnormals=_pol(policies, "fp8_subnormals", Fp8Subnormals.KEEP.value))
        out["_slots"] = slots
        out["_bound"] = compressor_error_bound(inp["state"], inp["positions"][fires], inp["ratio"],
                                               inp["norm_weight"], inp["eps"], b.normed[fires])
    return out


def _judge_compressor(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    """``normed`` (fp32 ``[M, 512]``) by the tolerance record (H7: producers' reductions differ),
    and/or ``cache`` (the production kernel's output: the compressed 584-byte records) by the
    compressor tier of ``oracles.compressor_tier`` (E2's rounding-error model: NoPE bytes cannot be
    bit-exact across producers, H7; bytes outside the records must be untouched). At least one of
    the two must be returned; every returned one is judged."""
    from .compressor_tier import judge_compressed_records

    if "normed" not in got and "cache" not in got:
        return _missing("normed' or 'cache", got)
    checks: list[Verdict] = []
    if "normed" in got:
        g = got["normed"].detach().cpu()
        e = expected["normed"]
        if tuple(g.shape) != tuple(e.shape):
            return Verdict(False, "normed:shape", f"normed: got shape {tuple(g.shape)}, expected {tuple(e.shape)}", headroom=0.0)
        tol = scope.tol().lookup(scope.kernel, "normed", "*", scope.arch, case.params)
        r = nm.compare(g.to(torch.float64), e, atol=tol.atol, rtol=tol.rtol, cos_tol=tol.cos_tol, fmt="fp32", name="normed")
        checks.append(Verdict(r.passed, f"normed:{r.rule}", r.message, r.max_ulps_rel_regime, r.headroom,
                              {"normed": r.to_dict()}))
    if "cache" in got:
        if "cache" not in expected:
            return Verdict(False, "cache:no_contract", "the kernel returned 'cache' but the case carries no "
                           "compressed-cache contract (cache, kv_block_size, compressed_slot_mapping)", headroom=0.0)
        t = judge_compressed_records(got["cache"], expected["cache"], case.inputs["cache"], expected["_slots"],
                                     case.inputs["kv_block_size"], expected["_bound"])
        checks.append(Verdict(t.passed, t.rule, t.message, None, t.headroom, {"cache": t.details}))
    bad = [c for c in checks if not c.passed]
    if bad:
        return Verdict(False, bad[0].rule, "; ".join(f"{c.rule}: {c.message}" for c in bad), bad[0].worst_ulps,
                       min(c.headroom for c in checks), {k: v for c in checks for k, v in c.details.items()})
    binding = min(checks, key=lambda c: c.headroom)
    ulps = [c.worst_ulps for c in checks if c.worst_ulps is not None]
    return Verdict(True, binding.rule, "", max(ulps) if ulps else None, binding.headroom,
                   {k: v for c in checks for k, v in c.details.items()})


# --------------------------------------------------------------------------- MLA-family stages


def _expected_v32(case: Case, policies: dict) -> dict:
    from dsv4_numerics.reference.attention.ordered import Segment, sparse_attention
    from dsv4_numerics.reference.caches.v32 import dequantize_v32_cache
    from dsv4_numerics.reference.policies import IndexRule, V32ScaleDecode

    inp = case.inputs
    q = inp["q"]
    b, s, h, d = q.shape
    rows = dequantize_v32_cache(inp["kv_cache"], inp["block_size"],
                                _pol(policies, "v32_scale_decode", V32ScaleDecode.EXACT.value))
    idx = inp["indices"].reshape(b * s, -1)
    rule = _pol(policies, "index_rule", IndexRule.ANY_OUT_OF_RANGE_INVALID.value)
    seg = [Segment(rows, idx, None, IndexRule(rule))]
    nan = _pol(policies, "nan", NanPolicy.PROPAGATE.value)
    qf = q.reshape(b * s, h, d)
    ex = sparse_attention(qf, seg, inp["scale"], inp.get("sink"), d_v=inp["d_v"], nan_policy=nan)
    out = {"out": ex.out.reshape(b, s, h, -1), "lse": ex.lse.reshape(b, s, h),
           "_zero": _zero_rows(ex.n_valid, inp.get("sink"), h).reshape(b, s, h),
           "_vrms": torch.tensor(v_rms(seg, b * s, inp["d_v"]))}
    if _pol(policies, "attention_mode", AttentionMode.EXACT.value) == AttentionMode.BF16_P.value:
        bp = sparse_attention(qf, seg, inp["scale"], inp.get("sink"), d_v=inp["d_v"], nan_policy=nan,
                              mode=AttentionMode.BF16_P)
        out["_same_precision"] = bp.out.reshape(b, s, h, -1)
    return out


def _expected_dense_decode(case: Case, policies: dict) -> dict:
    from dsv4_numerics.reference.attention.mla_dense import dense_mla_decode

    inp = case.inputs
    qs, ks = float(inp.get("q_scale", 1.0)), float(inp.get("kv_scale", 1.0))
    q = inp["q"].to(torch.float64) * qs
    kv = inp["kv_cache"]
    kvf = kv.to(torch.float64) * ks if kv.dtype != torch.bfloat16 else kv
    kw = dict(d_v=512, causal=bool(inp.get("causal", True)))
    ex = dense_mla_decode(q, kvf, inp["block_table"], inp["seq_lens"], inp["block_size"], inp["softmax_scale"], **kw)
    from dsv4_numerics.reference.attention.ordered import Segment
    from dsv4_numerics.reference.attention.mla_dense import dense_kv_rows, dense_token_indices

    b, s, h, _ = q.shape
    rows = dense_kv_rows(kvf, inp["block_size"])
    idx, length = dense_token_indices(inp["block_table"], inp["seq_lens"], s, inp["block_size"],
                                      causal=kw["causal"], num_blocks=rows.shape[0] // inp["block_size"])
    out = {"out": ex.out, "lse": ex.lse, "_zero": (ex.n_valid == 0).reshape(b, s, 1).expand(b, s, h).clone(),
           "_vrms": torch.tensor(v_rms([Segment(rows, idx, length)], b * s, kw["d_v"]))}
    if _pol(policies, "attention_mode", AttentionMode.EXACT.value) == AttentionMode.BF16_P.value:
        out["_same_precision"] = dense_mla_decode(q, kvf, inp["block_table"], inp["seq_lens"], inp["block_size"],
                                                  inp["softmax_scale"], mode=AttentionMode.BF16_P, **kw).out
    return out


def _expected_dense_prefill(case: Case, policies: dict) -> dict:
    from dsv4_numerics.reference.attention.mla_dense import dense_mha_prefill

    inp = case.inputs
    cq, ck = inp["cu_seqlens_q"], inp["cu_seqlens_kv"]
    ex = dense_mha_prefill(inp["q"], inp["k"], inp["v"], cq, ck, inp["scale"], causal=bool(inp.get("causal", True)))
    T, h, _ = inp["q"].shape
    v = inp["v"].to(torch.float64)
    out = {"out": ex.out, "lse": ex.lse, "_zero": (ex.n_valid == 0).reshape(T, 1).expand(T, h).clone(),
           "_vrms": torch.tensor(math.sqrt(float((v * v).mean())))}
    if _pol(policies, "attention_mode", AttentionMode.EXACT.value) == AttentionMode.BF16_P.value:
        out["_same_precision"] = dense_mha_prefill(inp["q"], inp["k"], inp["v"], cq, ck, inp["scale"],
                                                   causal=bool(inp.get("causal", True)), mode=AttentionMode.BF16_P).out
    return out


# --------------------------------------------------------------------------- registry

STAGES: dict[str, StageSpec] = {}


def register(spec: StageSpec) -> StageSpec:
    if spec.kind not in ("bytes", "index", "numeric"):
        fail("stages.register", "spec.kind", "must be 'bytes', 'index' or 'numeric'", spec.kind)
    STAGES[spec.name] = spec
    return spec


def get(name: str) -> StageSpec:
    """The StageSpec of ``name``; ``KeyError`` naming the known stages otherwise."""
    if name not in STAGES:
        raise KeyError(f"no StageSpec for stage '{name}' (known: {sorted(STAGES)})")
    return STAGES[name]


_WRITE_DEFAULTS = {"fp8": Fp8Flavour.E4M3FN.value, "nonfinite": NonFinite.FINITE.value,
                   "slot_skip": SlotSkip.ALL_NEGATIVE.value, "fp8_subnormals": Fp8Subnormals.KEEP.value}

register(StageSpec("swa_write", "bytes", ("cache",), {"scale_rule": ScaleRule.AMAX_CLAMP.value, **_WRITE_DEFAULTS},
                   _expected_model1, _judge_model1,
                   "SWA writer: cache_model1.insert (Q_A by default, datapath 2.1, H1)"))
register(StageSpec("compressed_write", "bytes", ("cache",), {"scale_rule": ScaleRule.SCALE_CLAMP.value, **_WRITE_DEFAULTS},
                   _expected_model1, _judge_model1,
                   "compressed writer from the bf16 pre-quantisation rows (Q_S by default: the CuTe "
                   "compressor, every compressed cache on NVIDIA, datapath 2.4, H1, H7)"))
register(StageSpec("v41_write", "bytes", ("cache",),
                   {"v41_layout": V41Layout.INTERLEAVED.value, "scale_rule": ScaleRule.AMAX_CLAMP.value,
                    "nvfp4_rule": Nvfp4ScaleRule.RECIP_MUL.value, "nonfinite": NonFinite.FINITE.value},
                   _expected_v41, _judge_v41,
                   "DeepSeek-V4.1 writer of the 528-byte MXFP8 / 288-byte NVFP4 records (cache_v41.insert; "
                   "vLLM 0.33.0 interleaved byte order by default, datapath 1.6, H13)"))
register(StageSpec("plain_write", "bytes", ("cache",), {"slot_skip": SlotSkip.ALL_NEGATIVE.value},
                   _expected_plain, _judge_plain, "plain bf16 / per-tensor FP8 rows (datapath 2.7)"))
# ``gather_out`` (GatherOutput) is honoured with the default ``bf16`` but not listed here: the stage's
# defaults are the provenance the committed gather fixtures record.
register(StageSpec("gather", "bytes", ("out",), {"fp8": Fp8Flavour.E4M3FN.value, "ue8m0": Ue8m0Consumer.EXACT.value},
                   _expected_gather, _judge_gather, "dequantise + gather by block table (datapath 3, 4.5)"))
for _st in ("topk_global", "swa_indices", "c128a_indices", "compressed_slots", "combine_prefill",
            "flashinfer_mixed", "rocm_ragged"):
    register(StageSpec(_st, "index", (), {}, _expected_index, _judge_index,
                       "index plumbing (datapath 4): exact, outputs named by the case's builder"))
_ATTN_DEFAULTS = {"nan": NanPolicy.PROPAGATE.value, "attention_mode": AttentionMode.EXACT.value}
register(StageSpec("decode", "numeric", _ATTN_OUTPUTS,
                   dict(_ATTN_DEFAULTS, fp8=Fp8Flavour.E4M3FN.value, fp8_decode=Fp8Decode.EXACT.value),
                   _expected_decode, _judge_attention_stage,
                   "sparse decode: one softmax over SWA + compressed segments, sink (attention 2, 7)"))
register(StageSpec("prefill", "numeric", _ATTN_OUTPUTS, dict(_ATTN_DEFAULTS), _expected_prefill, _judge_attention_stage,
                   "sparse prefill over the bf16 workspace, one combined segment (attention 1.4, 2)"))
register(StageSpec("rope", "numeric", ("out",), {"rope_arith": RopeArithmetic.FMA.value}, _expected_rope, _judge_rope,
                   "RoPE / inverse RoPE on dims 448..511: bit-exact under the declared arithmetic (datapath H6)"))
register(StageSpec("compressor", "numeric", ("normed", "cache"),
                   {"rope_arith": RopeArithmetic.FMA_TRITON.value, "scale_rule": ScaleRule.SCALE_CLAMP.value,
                    "fp8": Fp8Flavour.E4M3FN.value, "slot_skip": SlotSkip.ALL_NEGATIVE.value,
                    "fp8_subnormals": Fp8Subnormals.KEEP.value},
                   _expected_compressor, _judge_compressor,
                   "compressor steps 3-7 for boundary positions of one request: fp32 normed rows by tolerance, "
                   "the written compressed records by the compressor tier (H7)"))
register(StageSpec("inv_rope_fp8", "bytes", ("codes", "exponents", "deq"), {"rope_arith": RopeArithmetic.FMA_TRITON.value},
                   _expected_inv_rope_fp8, _judge_inv_rope_fp8,
                   "output inverse RoPE + FP8 group quantiser: bytes exact, values tier C (attention 3.3, 7)"))
register(StageSpec("v32_decode", "numeric", ("out", "lse"), dict(_ATTN_DEFAULTS), _expected_v32,
                   lambda c, e, g, s: judge_attention(c, e, g, s, ("out", "lse")),
                   "DeepSeek V3.2 sparse decode over the 656-byte cache (attention 1.3, datapath 1.5)"))
register(StageSpec("dense_mla_decode", "numeric", ("out", "lse"), dict(_ATTN_DEFAULTS), _expected_dense_decode,
                   lambda c, e, g, s: judge_attention(c, e, g, s, ("out", "lse")), "dense paged MLA decode"))
register(StageSpec("dense_mla_prefill", "numeric", ("out", "lse"), dict(_ATTN_DEFAULTS), _expected_dense_prefill,
                   lambda c, e, g, s: judge_attention(c, e, g, s, ("out", "lse")), "dense ragged MHA prefill (R1)"))


__all__ = ["FAST", "FAST_ORACLE_STAGES", "JudgeScope", "ORDERED", "STAGES", "StageSpec", "Verdict", "decode_segments", "get", "identity_cos_sin", "identity_rotated_pairs", "judge_attention", "judge_gather_rows",
           "prefill_segments", "v_rms",
           "register", "writer_rows", "written_slots", "InputError"]

# Stage families kept in their own modules register on import (they import this one).
from . import stages_v41  # noqa: E402,F401  (v41_gather)
from . import stages_v41_attention  # noqa: E402,F401  (v41_sparse_decode / prefill, v41_query_quant)
from . import stages_v41_compress  # noqa: E402,F401  (v41_compress_insert)
from . import stages_v41_indexer  # noqa: E402,F401  (v41_indexer_k_store)
from . import stages_sglang  # noqa: E402,F401  (kv_norm_rope_store)
