"""Judge one case of one kernel under a given policy set: the failure a reproducer is made of.

A kernel is a registry ``KernelEntry`` (judged as the matrix judges it, its declared policies
replaced by ``policies``) or a plain callable ``fn(inputs) -> dict`` (judged as ``dn.judge``
judges it). Every judgement goes through the matrix runner (``oracles.matrix.run_entry``), one
case at a time, with a fresh entry object so nothing is memoised across shrink candidates.

``contract_policies(declared, stage, spec)`` is the policy set ``--contract`` judges under:
``spec`` is ``"all"`` (every declared departure -- a key of ``kernels.registry.POLICY_ENUMS`` --
reset to the stage default; keys describing how the adapter feeds or returns the op, such as
``writer_rope`` or ``output_inv_roped``, and ``INPUT_CONTRACT_KEYS`` are kept) or ``"KEY[=VALUE],..."`` (those keys reset to
the stage default, or set to VALUE: a contract another producer follows, e.g.
``nonfinite=cuda_satfinite``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dsv4_numerics.api.callable_entry import from_callable, from_entry, is_entry_like, mark_contract_errors
from dsv4_numerics.kernels.registry import POLICY_ENUMS
from dsv4_numerics.oracles import stages as st
from dsv4_numerics.oracles.matrix import run_entry
from dsv4_numerics.oracles.report import Result
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.errors import InputError


# policy keys that say which inputs an adapter accepts, not how the op computes: ``all`` keeps them
# (``index_rule=minus1_only``: the adapter declines other index values, so resetting it changes
# no verdict and names no finding)
INPUT_CONTRACT_KEYS = frozenset({"index_rule"})


@dataclass(frozen=True)
class Signature:
    """What makes a failure the same failure: the verdict ``fail``, on the same output, by the
    same rule (``Result.rule``, e.g. ``out:elementwise_abs_or_rel``, ``bit_exact``)."""

    rule: str

    @classmethod
    def of(cls, r: Result) -> "Signature | None":
        return cls(r.rule) if r.verdict == "fail" else None


def declared_policies(kernel: Any) -> dict[str, str]:
    pol = getattr(kernel, "policies", None) or {}
    return {k: (v.value if hasattr(v, "value") else str(v)) for k, v in pol.items()}


def contract_policies(declared: dict[str, str], stage: str, spec: str) -> dict[str, str]:
    """The policy set ``--contract spec`` judges under (module docstring); ``InputError`` for a
    malformed spec or a key that is not a policy."""
    defaults = {k: (v.value if hasattr(v, "value") else str(v)) for k, v in st.get(stage).defaults.items()}
    out = dict(declared)
    if spec in ("all", "", None):
        for k in list(out):
            if k in POLICY_ENUMS and k not in INPUT_CONTRACT_KEYS:
                if k in defaults:
                    out[k] = defaults[k]
                else:
                    del out[k]
        return out
    for item in str(spec).split(","):
        key, _, value = item.strip().partition("=")
        if key not in POLICY_ENUMS:
            raise InputError(f"repro: argument 'contract' names {key!r}, not a policy key (known: "
                             f"{sorted(POLICY_ENUMS)}); give 'all' or KEY[=VALUE],...")
        if value:
            allowed = {m.value for m in POLICY_ENUMS[key]}
            if value not in allowed:
                raise InputError(f"repro: argument 'contract': {key}={value!r} is not one of {sorted(allowed)}")
            out[key] = value
        elif key in defaults:
            out[key] = defaults[key]
        else:
            out.pop(key, None)
    return out


def judge_case(kernel: Any, stage: str, case: Case, policies: dict[str, str], device: str | None = None) -> Result:
    """The Result of ``kernel`` on ``case`` (CPU tensors; the runner moves them to ``device``)
    under exactly ``policies`` (module docstring)."""
    if is_entry_like(kernel):
        ent = dataclasses.replace(kernel, policies=dict(policies)) if dataclasses.is_dataclass(kernel) else kernel
        judged = from_entry(ent, {} if ent is not kernel else dict(policies), [case])
    else:
        judged = from_callable(kernel, stage, dict(policies), None, [case])
    return mark_contract_errors(run_entry(judged, cases=[case], device=device,
                                          expected_cache=judged.expected_cache))[0]


def expected_outputs(stage: str, case: Case, policies: dict[str, str]) -> dict:
    """The oracle's outputs for ``case`` under ``policies`` (stage defaults for the rest)."""
    spec = st.get(stage)
    return spec.expected(case, spec.policies(policies))


__all__ = ["INPUT_CONTRACT_KEYS", "Signature", "contract_policies", "declared_policies", "expected_outputs", "judge_case"]
