"""The machinery of the mutation suite: the entry-like ``MutantEntry``, the reference entry
(the positive control every stage must pass), ``mutant(...)`` that declares one mutant, and the
helpers several stage families share (the reference re-run with one knob turned)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dsv4_numerics.oracles import stages as st
from dsv4_numerics.oracles.matrix import expected_outputs
from dsv4_numerics.reference.caches import model1 as cache_model1
from dsv4_numerics.reference.caches import v41 as cache_v41
from dsv4_numerics.reference.attention.ordered import sparse_attention
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.constants import DATA_ROW_BYTES, RECORD_BYTES
from dsv4_numerics.reference.policies import ScaleRule


@dataclass(frozen=True)
class MutantEntry:
    """Entry-like wrapper (the ``KernelEntry`` fields ``run_entry`` reads)."""

    name: str
    stage: str
    bug: str  # the bug class and where it was seen
    call: Callable[[Case], dict]
    policies: dict[str, str] = field(default_factory=dict)
    family: str = "mutant"
    source: str = "tests/mutants/"
    archs: tuple[str, ...] = ("cpu",)
    dtypes: tuple[str, ...] = ("bfloat16",)
    dimension: str = ""  # the case-sweep dimension that alone catches it (reference/cases/attention_sweep.py)

    @property
    def tolerance_scope(self) -> str:
        return f"mutant.{self.name}"

    def probe(self) -> str | None:
        return None


def entry_outputs(d: dict) -> dict:
    return {k: v for k, v in d.items() if not k.startswith("_")}


def reference_entry(stage: str, policies: dict | None = None, bf16_p: bool = False,
                    memo: dict | None = None) -> MutantEntry:
    """The reference wrapped as an entry (positive control). ``bf16_p``: a numeric stage returns
    the oracle's bf16-kernel emulation instead (must pass the same tolerance tier). ``memo``: the
    ``expected_cache`` dict given to ``run_entry`` (same key), so the reference runs once."""
    spec = st.get(stage)
    pol = dict(policies or {})
    if bf16_p:
        pol["attention_mode"] = "bf16_p"

    def call(case: Case) -> dict:
        full = spec.policies(pol)
        e = expected_outputs(spec, stage, case, full, memo)
        out = entry_outputs(e)
        if bf16_p:
            out["out"] = e["_same_precision"].to(torch.bfloat16)
        elif spec.kind == "numeric" and "out" in out and stage != "rope":
            out["out"] = out["out"].to(torch.bfloat16)  # what a bf16 kernel returns
        return out

    return MutantEntry(f"reference.{stage}" + (".bf16_p" if bf16_p else ""), stage, "none (positive control)",
                       call, pol, family="reference")


def fp32_compressor_entry() -> MutantEntry:
    """The fp32 producer model the compressor tolerance was derived from (positive control)."""
    from dsv4_numerics.oracles.derive import compressor_fp32
    from dsv4_numerics.reference.pipeline.compressor import state_windows

    def call(case: Case) -> dict:
        inp = case.inputs
        kv, score, valid = state_windows(inp["state"], inp["positions"], inp["ratio"])
        return {"normed": compressor_fp32(kv, score, valid, inp["norm_weight"], inp["eps"])}

    return MutantEntry("reference.pipeline.compressor.fp32_model", "compressor", "none (positive control)", call,
                       family="reference")


def _flat(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(-1) if cache.is_contiguous() else cache.reshape(-1)


def write_records(case: Case, data: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor,
                   layout: str = "planar") -> dict:
    """Write record parts at ``slots`` under a (possibly wrong) layout into a copy of the cache."""
    inp = case.inputs
    out = inp["cache"].clone()
    flat = _flat(out)
    bs, P = inp["block_size"], inp["cache"].stride(0)
    for t, s in enumerate(slots.tolist()):
        page, e = divmod(s, bs)
        if layout == "interleaved":  # V4.1-style per-token records (vFMLA :119-131, H10)
            base = page * P + e * RECORD_BYTES
            flat[base:base + DATA_ROW_BYTES] = data[t]
            flat[base + DATA_ROW_BYTES:base + RECORD_BYTES] = scales[t]
            continue
        pstride = {"packed": bs * RECORD_BYTES,  # packed: stride(0) ignored (H12)
                   "sglang_padded": -(-bs * RECORD_BYTES // DATA_ROW_BYTES) * DATA_ROW_BYTES}.get(layout, P)
        d0 = page * pstride + e * DATA_ROW_BYTES
        s0 = page * pstride + bs * DATA_ROW_BYTES + e * 8
        if s0 + 8 > flat.numel():  # past the allocation: an out-of-bounds write, lost here
            continue
        flat[d0:d0 + DATA_ROW_BYTES] = data[t]
        flat[s0:s0 + 8] = scales[t]
    return {"cache": out}


def kept_rows(case: Case):
    s = case.inputs["slot_mapping"].to(torch.int64)
    keep = s >= 0
    return case.inputs["k"][: s.shape[0]][keep], s[keep]


def layout_mutant(layout: str, rule: str = ScaleRule.AMAX_CLAMP.value):
    def call(case: Case) -> dict:
        k, slots = kept_rows(case)
        data, scales = cache_model1.encode_records(k, rule)
        return write_records(case, data, scales, slots, layout)
    return call


_PLAIN: dict[int, tuple[Case, Any]] = {}  # id(case) -> (case, the ordered oracle on its own segments)


def _copy(r):
    return type(r)(**{k: v.clone() for k, v in r.as_dict().items()})


def run_oracle(case: Case, segs: list, **kw: Any):
    """The ordered oracle on ``case`` with ``segs`` (and ``kw``: ``scale``, ``sink``, ``sparse_attention``'s
    options). The plain call -- the case's own segments (``case_segments``), nothing overridden -- is what
    most attention mutants start from: it runs once per case and process, and each caller gets its
    own copies of the outputs (a mutant may change them in place)."""
    inp = case.inputs
    hit = _SEGS.get(id(case))
    plain = not kw and hit is not None and hit[0] is case and segs is hit[1]
    if plain:
        memo = _PLAIN.get(id(case))
        if memo is not None and memo[0] is case:
            return _copy(memo[1])
    res = sparse_attention(inp["q"], segs, kw.pop("scale", inp["scale"]), kw.pop("sink", inp.get("sink")), **kw)
    if plain:
        if len(_PLAIN) >= 64:  # bounded as _SEGS
            _PLAIN.clear()
        _PLAIN[id(case)] = (case, _copy(res))
    return res


def attn_out(res, lse: torch.Tensor | None = None) -> dict:
    return {"out": res.out.to(torch.bfloat16), "lse": (res.lse if lse is None else lse).to(torch.float32),
            "max_logits": res.max_logits.to(torch.float32)}


_SEGS: dict[int, tuple[Case, list]] = {}  # id(case) -> (case, segments): the mutants share one dequantisation


def case_segments(case: Case) -> list:
    hit = _SEGS.get(id(case))
    if hit is not None and hit[0] is case:
        return hit[1]
    if case.stage == "decode":
        segs = st.decode_segments(case, {})
    else:
        segs = st.prefill_segments(case, {"index_rule": case.params.get("index_rule", "minus1_only")})
    if len(_SEGS) >= 64:  # bounded: the default cases of both stages fit
        _SEGS.clear()
    _SEGS[id(case)] = (case, segs)
    return segs


def v41_nonfinite_entry(name: str, call: Callable[[Case], dict]) -> MutantEntry:
    """A ``v41_write`` entry declaring vLLM's non-finite rule (``nonfinite = triton``) for the
    non-finite cases of ``tests/kernels/test_vllm_v41.py`` (default cases are finite, so these are
    not in ``MUTANTS``)."""
    return MutantEntry(name, "v41_write", "see the test", call, {"nonfinite": "triton"})


def v41_nvfp4_nan_as_zero(case: Case) -> dict:
    """vLLM's NVFP4 writer modelled with NaN -> code 0 (as if cvt flushed NaN) instead of +6."""
    inp = case.inputs
    k = inp["k"].clone()
    k = torch.where(torch.isnan(k), torch.zeros_like(k), k)
    return {"cache": cache_v41.insert(inp["cache"], k, inp["slot_mapping"], inp["block_size"], inp["record"],
                                      "interleaved", nonfinite="triton")}


def v41_nvfp4_poisoned(case: Case) -> dict:
    """FlashInfer's POISON rule where vLLM's Triton writer saturates (the two producers disagree)."""
    inp = case.inputs
    return {"cache": cache_v41.insert(inp["cache"], inp["k"], inp["slot_mapping"], inp["block_size"], inp["record"],
                                      "interleaved", nonfinite="poison")}


def mutant(name: str, stage: str, bug: str, call: Callable, dimension: str = "", **policies: str) -> MutantEntry:
    """One mutant of ``stage``: ``call`` reproduces ``bug`` (cited); ``policies`` are the ones its
    entry declares; ``dimension`` names the sweep dimension whose default cases alone catch it."""
    return MutantEntry(name, stage, bug, call, dict(policies), dimension=dimension)
