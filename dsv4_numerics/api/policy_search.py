"""``explain``: which declared policy set a kernel matches (the search behind
``dsv4_numerics.explain``).

A stage's reference depends on a few named policies (``reference.policies``; which ones is read
off its ``expected`` function in ``oracles/stages/``): :data:`AXES` lists them per stage, each
as an *axis* of alternative values (an axis value may set several keys: the FNUZ writer flavour
with the gfx942 clamp is ``fp8=e4m3fnuz, fp8_clamp=224.0``).

The search, for a kernel and a case list:

1. the kernel is called once per case (its outputs are memoised and checked against the stage's
   output contract; a contract violation ends the search with that message);
2. an axis is *exercised* by the cases when some other value of it changes the reference output
   of some case (under the declared values of the other axes) -- an axis the cases cannot tell
   apart (e.g. ``nonfinite`` on finite-only cases) stays at its declared value and is reported as
   not exercised;
3. the kernel's outputs are judged, by the matrix runner, under every combination of the values
   of the exercised axes (their product); a combination *matches* when no case fails or errors
   and at least one passes. Matches are listed closest to the stage defaults first; ``closest``
   is the best combination (a match if there is one, else the one with the fewest failing cases,
   then the smallest error: differing bytes for bytes stages, ``1/headroom`` for numeric ones).

Cost: the reference runs once per (case, distinct policy set); the judges once per (case,
combination); the kernel once per case.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dsv4_numerics.oracles import stages as st
from dsv4_numerics.oracles.matrix import to_cpu, expected_outputs, run_entry
from dsv4_numerics.oracles.report import Result
from dsv4_numerics.reference.constants import FNUZ_GFX942_CLAMP
from dsv4_numerics.reference.policies import (
    Fp8Decode,
    Fp8Flavour,
    Fp8Subnormals,
    GatherOutput,
    IndexRule,
    MissingLengths,
    NanPolicy,
    NonFinite,
    RopeArithmetic,
    ScaleRule,
    SlotSkip,
    Ue8m0Consumer,
    V32ScaleDecode,
    V41Layout,
    Nvfp4ScaleRule,
)

from dsv4_numerics.api.callable_entry import JudgedEntry, mark_contract_errors

Axis = tuple[str, tuple[dict[str, str], ...]]  # (label, alternative partial policy sets)


def _enum(key: str, enum: Any) -> Axis:
    return key, tuple({key: m.value} for m in enum)


_FP8_WRITER: Axis = ("fp8", ({"fp8": Fp8Flavour.E4M3FN.value}, {"fp8": Fp8Flavour.E4M3FNUZ.value},
                             {"fp8": Fp8Flavour.E4M3FNUZ.value, "fp8_clamp": repr(FNUZ_GFX942_CLAMP)}))
_WRITER = (_enum("scale_rule", ScaleRule), _FP8_WRITER, _enum("fp8_subnormals", Fp8Subnormals),
           _enum("nonfinite", NonFinite),
           ("slot_skip", ({"slot_skip": SlotSkip.MINUS1_ONLY.value}, {"slot_skip": SlotSkip.ALL_NEGATIVE.value})))
_ATTN = (_enum("nan", NanPolicy), _enum("index_rule", IndexRule))

# stage -> the policy axes its reference reads (oracles/stages/, the expected functions);
# stages not listed (index plumbing, dense MLA) have no policies.
AXES: dict[str, tuple[Axis, ...]] = {
    "swa_write": _WRITER,
    "compressed_write": _WRITER,
    "plain_write": (_enum("slot_skip", SlotSkip), _enum("nonfinite", NonFinite),
                    ("round_to_bf16_first", ({"round_to_bf16_first": "true"}, {"round_to_bf16_first": "false"}))),
    "gather": (_enum("fp8", Fp8Flavour), _enum("ue8m0", Ue8m0Consumer), _enum("gather_out", GatherOutput)),
    # V4.1 writer: byte order (vLLM interleaved vs FlashInfer page footer, H13) and both scale rules
    "v41_write": (_enum("v41_layout", V41Layout), _enum("scale_rule", ScaleRule), _enum("nvfp4_rule", Nvfp4ScaleRule)),
    "decode": (*_ATTN, _enum("fp8", Fp8Flavour), _enum("ue8m0", Ue8m0Consumer), _enum("fp8_decode", Fp8Decode)),
    "prefill": (*_ATTN, _enum("missing_lengths", MissingLengths)),
    "v32_decode": (*_ATTN, _enum("v32_scale_decode", V32ScaleDecode)),
    "rope": (_enum("rope_arith", RopeArithmetic),),
    "inv_rope_fp8": (_enum("rope_arith", RopeArithmetic),),
    # the compressed cache is OCP on every platform (datapath 2.3): no fp8 axis
    "compressor": (_enum("rope_arith", RopeArithmetic), _enum("scale_rule", ScaleRule),
                   _enum("fp8_subnormals", Fp8Subnormals)),
    # SGLang's uniform-FP8 store: negative slots wrapped or skipped; saturating or torch 2.11's cast
    "kv_norm_rope_store": (_enum("rope_arith", RopeArithmetic),
                           ("slot_skip", ({"slot_skip": SlotSkip.ALL_NEGATIVE.value},
                                          {"slot_skip": SlotSkip.NEGATIVE_WRAPS.value})),
                           ("nonfinite", ({"nonfinite": NonFinite.FINITE.value}, {"nonfinite": NonFinite.TORCH.value}))),
}


def _norm(v: Any) -> str:
    v = v.value if hasattr(v, "value") else v
    return "none" if v in (None, "", "none") else str(v)


def _keys(axis: Axis) -> set[str]:
    return {k for v in axis[1] for k in v}


def _apply(declared: dict[str, str], axis: Axis, value: dict[str, str]) -> dict[str, str]:
    out = {k: v for k, v in declared.items() if k not in _keys(axis)}
    out.update(value)
    return out


def _is_current(axis: Axis, value: dict[str, str], full: dict[str, Any]) -> bool:
    return all(_norm(value.get(k)) == _norm(full.get(k)) for k in _keys(axis))


def _label(pol: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in pol.items()) or "(the stage has no policies)"


@dataclass
class Combination:
    """One policy set tried: ``policies`` (the searched keys), ``declared`` (the full declaration
    that was judged), verdict ``counts``, ``badness`` (0 on a match) and the first problem."""

    policies: dict[str, str]
    declared: dict[str, str]
    counts: dict[str, int]
    badness: float
    first_problem: str = ""

    @property
    def matches(self) -> bool:
        return (self.counts.get("fail", 0) == 0 and self.counts.get("error", 0) == 0
                and self.counts.get("unjudged", 0) == 0 and self.counts.get("pass", 0) > 0)


@dataclass
class Explanation:
    """What :func:`search` found (module docstring). ``matches``: the matching policy sets
    (searched keys), closest to the stage defaults first; ``closest``: the best policy set (the
    first match, or the nearest miss); ``declare``: what to put in the entry's ``policies`` for
    ``closest`` (the values that differ from the stage defaults); ``combinations``: every set
    tried with its verdict counts; ``not_exercised``: policy keys the cases cannot tell apart;
    ``error``: why nothing could be searched (e.g. the outputs break the contract)."""

    stage: str
    entry: str
    cases: int
    matches: list[dict[str, str]] = field(default_factory=list)
    closest: dict[str, str] = field(default_factory=dict)
    declare: dict[str, str] = field(default_factory=dict)
    combinations: list[Combination] = field(default_factory=list)
    searched: list[str] = field(default_factory=list)
    not_exercised: list[str] = field(default_factory=list)
    error: str = ""

    @property
    def matched(self) -> bool:
        return bool(self.matches)

    def counts(self) -> dict[str, dict[str, int]]:
        """Per combination label: its verdict counts."""
        return {_label(c.policies): dict(c.counts) for c in self.combinations}

    def __str__(self) -> str:
        head = f"explain {self.entry} on stage '{self.stage}' ({self.cases} cases)"
        if self.error:
            return f"{head}: {self.error}"
        lines = [head + (f"; searched: {', '.join(self.searched)}" if self.searched else "; the stage has no policies")
                 + (f"; not exercised by these cases (kept as declared): {', '.join(self.not_exercised)}"
                    if self.not_exercised else "")]
        decl = "{" + ", ".join(f"{k!r}: {v!r}" for k, v in self.declare.items()) + "}"
        if self.matches:
            lines.append(f"matches: {_label(self.matches[0])}  -> declare policies={decl}")
            lines += [f"also matches: {_label(m)}" for m in self.matches[1:]]
        else:
            lines.append(f"matches: none; closest: {_label(self.closest)} (policies={decl})")
        n = self.cases
        w = max((len(_label(c.policies)) for c in self.combinations), default=10)
        lines.append(f"  {'policy set':<{w}}  pass/fail/error/skip/unjudged of {n}")
        for c in sorted(self.combinations, key=lambda c: (not c.matches, _misses(c), c.badness)):
            k = c.counts
            lines.append(f"  {_label(c.policies):<{w}}  {k.get('pass', 0)}/{k.get('fail', 0)}/{k.get('error', 0)}/"
                         f"{k.get('skip', 0)}/{k.get('unjudged', 0)}" + (f"  {c.first_problem[:100]}" if c.first_problem and not c.matches else ""))
        return "\n".join(lines)


def _misses(c: Combination) -> int:
    return c.counts.get("fail", 0) + c.counts.get("error", 0) + c.counts.get("unjudged", 0)


def _same(a: dict, b: dict) -> bool:
    ka = sorted(k for k in a if not k.startswith("_"))
    if ka != sorted(k for k in b if not k.startswith("_")):
        return False
    for k in ka:
        x, y = a[k], b[k]
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            if x != y:
                return False
            continue
        if x.dtype != y.dtype or x.shape != y.shape:
            return False
        if x.dtype.is_floating_point:
            if not bool(((x == y) | (torch.isnan(x) & torch.isnan(y))).all()):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def _badness(results: list[Result]) -> float:
    total = 0.0
    for r in results:
        if not r.verdict.bad:
            continue
        d = r.details or {}
        diff = d.get("differing")
        if diff is None:
            diff = sum(v.get("differing", 0) for v in d.values() if isinstance(v, dict)) or None
        if diff is not None:
            total += float(diff)
        elif r.headroom is not None and r.headroom > 0:
            total += 1.0 / r.headroom
        else:
            total += math.inf
    return total


def _raw_diff(got: Any, exp: dict) -> float:
    """Elements of the returned outputs that differ bit for bit from the reference's (NaN equal
    to NaN); ``inf`` when an output's dtype or shape differs or nothing comparable was returned."""
    if not isinstance(got, dict):
        return math.inf
    keys = [k for k in got if k in exp and not k.startswith("_")]
    if not keys:
        return math.inf
    n = 0.0
    for k in keys:
        g, e = got[k], exp[k]
        if not isinstance(g, torch.Tensor) or g.dtype != e.dtype or g.shape != e.shape:
            return math.inf
        g = to_cpu(g)
        ne = g != e
        if g.dtype.is_floating_point:
            ne &= ~(torch.isnan(g) & torch.isnan(e))
        n += float(ne.sum())
    return n


def _expected_or_exc(spec: Any, entry: JudgedEntry, case: Any, declared: dict) -> Any:
    try:
        return expected_outputs(spec, entry.stage, case, spec.policies(declared), entry.expected_cache)
    except Exception as e:  # noqa: BLE001 - a rejection is a different outcome
        return e


def _bytes_screen(e: JudgedEntry, cases: list, run, expected, judge: bool = True,
                  device: Any = None) -> tuple[list[Result], list[str], float]:
    """Bytes / index stages under one policy set, cheaply: a case whose returned outputs equal
    the reference's bit for bit passes (the reference's own outputs pass its judge: the positive
    control of the mutation suite); the others are judged by the matrix runner, fewest differing
    elements first, until the first ``fail`` (or ``error``) proves the set does not match -- the
    rest are listed as unjudged. Returns (results, unjudged case names, their differing elements)."""
    results: list[Result] = []
    differ: list[tuple[float, Any]] = []
    for case in cases:
        exp = expected(case, e.policies)
        try:
            # on the device the runner would use (the memo is keyed by case: run_entry reuses it)
            got = e.call(case.to(device) if device is not None else case)
        except Exception:  # noqa: BLE001 - the runner reports it (an error Result, cheap)
            results.extend(run(e, [case]))
            continue
        d = math.inf if isinstance(exp, Exception) else _raw_diff(got, exp)
        if d == 0:
            results.append(Result(entry=e.name, stage=e.stage, case=case.name, verdict="pass", rule="bit_exact",
                                  headroom=math.inf, policies=dict(e.policies)))
        else:
            differ.append((d, case))
    differ.sort(key=lambda x: x[0])
    unjudged: list[str] = []
    raw = 0.0
    for d, case in differ:
        if not judge or any(r.verdict.bad for r in results):
            unjudged.append(case.name)
            raw += d
            continue
        results.extend(run(e, [case]))
    return results, unjudged, raw


def search(entry: JudgedEntry, cases: list, *, device: Any = None, arch: str | None = None,
           tolerances: Any = None) -> Explanation:
    """The search of the module docstring for ``entry`` (a :class:`JudgedEntry`) on ``cases``."""
    stage = entry.stage
    spec = st.get(stage)
    ex = Explanation(stage=stage, entry=entry.name, cases=len(cases))

    def run(e: JudgedEntry, subset: list | None = None) -> list[Result]:
        return mark_contract_errors(run_entry(e, cases=cases if subset is None else subset, device=device, arch=arch,
                                              tolerances=tolerances, expected_cache=entry.expected_cache))

    try:
        reason = entry.probe()
    except Exception as e:  # noqa: BLE001
        reason = f"probe raised {type(e).__name__}: {e}"
    if reason:
        ex.error = f"nothing was judged: the kernel cannot run here ({reason})"
        return ex
    if spec.kind == "numeric":
        first = run(entry)
    else:  # bytes / index: bit-equal outputs pass without the (costly) decoded diff
        first = _bytes_screen(entry, cases, run, lambda c, d: _expected_or_exc(spec, entry, c, d), judge=False,
                              device=device)[0]
    broken = [r for r in first if r.rule == "outputs"]
    if broken:
        ex.error = f"the outputs break the stage's output contract: {broken[0].message}"
        return ex
    if first and all(r.verdict == "error" for r in first):  # no policy can explain a kernel that never ran
        ex.error = "nothing was judged: every case errored (" + first[0].message[:300] + ")"
        return ex
    if first and all(r.verdict == "skip" for r in first):
        ex.error = "nothing was judged: every case was skipped (" + "; ".join(sorted({r.message for r in first}))[:200] + ")"
        return ex

    def expected(case, declared: dict) -> Any:
        return _expected_or_exc(spec, entry, case, declared)

    full = spec.policies(entry.policies)
    axes = AXES.get(stage, ())
    exercised: list[Axis] = []
    base = [expected(c, entry.policies) for c in cases]
    for axis in axes:
        others = [v for v in axis[1] if not _is_current(axis, v, full)]
        hit = False
        for v in others:
            alt_decl = _apply(entry.policies, axis, v)
            for c, b in zip(cases, base):
                a = expected(c, alt_decl)
                if isinstance(a, Exception) or isinstance(b, Exception) or not _same(a, b):
                    hit = True
                    break
            if hit:
                break
        if hit:
            exercised.append(axis)
        else:
            ex.not_exercised.append(axis[0])
    ex.searched = [a[0] for a in exercised]
    shown = sorted({k for a in axes for k in _keys(a)} - {"fp8_clamp"})
    combos = []
    for values in itertools.product(*[a[1] for a in exercised]):
        declared = dict(entry.policies)
        for axis, v in zip(exercised, values):
            declared = _apply(declared, axis, v)
        combos.append(declared)
    screened: dict[int, tuple] = {}
    if spec.kind != "numeric":  # bit-equal sets first: if one matches outright, no decoded diff is needed
        for i, declared in enumerate(combos):
            screened[i] = _bytes_screen(entry.with_policies(declared), cases, run, expected, judge=False, device=device)
        if not any(not s[1] and not any(r.verdict.bad for r in s[0]) for s in screened.values()):
            for i in sorted(screened, key=lambda i: screened[i][2] + len(screened[i][1])):
                screened[i] = _bytes_screen(entry.with_policies(combos[i]), cases, run, expected, judge=True, device=device)
    for i, declared in enumerate(combos):
        if declared == entry.policies and spec.kind == "numeric":
            results, unjudged, raw = first, [], 0.0
        elif spec.kind == "numeric":
            results, unjudged, raw = run(entry.with_policies(declared)), [], 0.0
        else:
            results, unjudged, raw = screened[i]
        counts = {k: sum(1 for r in results if r.verdict == k) for k in ("pass", "fail", "error", "skip")}
        counts["unjudged"] = len(unjudged)
        full_c = spec.policies(declared)
        pol = {k: _norm(full_c.get(k)) for k in shown if k in full_c or k in declared}
        if _norm(full_c.get("fp8_clamp")) != "none":
            pol["fp8_clamp"] = _norm(full_c.get("fp8_clamp"))
        bad = next((r for r in results if r.verdict.bad), None)
        ex.combinations.append(Combination(pol, declared, counts, _badness(results) + raw,
                                           f"{bad.case}: {bad.rule}: {bad.message}" if bad else ""))

    def n_nondefault(c: Combination) -> int:
        return sum(1 for k, v in c.declared.items() if _norm(v) != _norm(spec.defaults.get(k)))

    matching = sorted([c for c in ex.combinations if c.matches], key=lambda c: (-c.counts["pass"], n_nondefault(c)))
    ex.matches = [c.policies for c in matching]
    best = matching[0] if matching else min(
        ex.combinations, key=lambda c: (_misses(c), c.badness, n_nondefault(c)))
    ex.closest = best.policies
    ex.declare = {k: v for k, v in best.declared.items() if _norm(v) != _norm(spec.defaults.get(k))}
    return ex


__all__ = ["AXES", "Combination", "Explanation", "search"]
