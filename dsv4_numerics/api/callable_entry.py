"""Turn a kernel author's plain callable (or a ``KernelEntry``) into the entry-like object that
``oracles.matrix.run_entry`` judges, so the public API goes through the matrix's own runner,
comparators and tolerance records (used by :mod:`dsv4_numerics.api.testing` and
:mod:`dsv4_numerics.api.policy_search`).

A plain callable is called as ``fn(inputs)`` where ``inputs`` is a :class:`CaseInputs`: a dict of
the case's canonical inputs (fresh copies on the run's device, so the callable may write into
them in place, e.g. insert into ``inputs["cache"]`` and return it) that also carries the case's
``name``, ``stage`` and JSON-able ``params`` as attributes. Its outputs are checked against the
stage's output contract (:mod:`dsv4_numerics.api.output_contract`) before they are judged.

Outputs are memoised per case name (``memo``), so judging the same outputs under several policy
sets (``explain``) calls the kernel once per case. Each call is announced first
(:func:`dsv4_numerics.api.result_sink.announce`), so a call that takes the process down still
leaves a trace the pytest plugin can report.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dsv4_numerics.kernels.registry import BOOL_POLICY_KEYS, POLICY_ENUMS
from dsv4_numerics.oracles import stages as st
from dsv4_numerics.oracles.matrix import expected_outputs
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.errors import InputError, UnsupportedCase
from dsv4_numerics.reference.policies import V32ScaleDecode
from dsv4_numerics.reference.storage import clone_storage

from dsv4_numerics.api.output_contract import OutputContractError, check_outputs
from dsv4_numerics.api.result_sink import announce

# policy keys honoured by oracles/stages/ beyond the enum and boolean keys of the registry
# (its module docstring lists them): key -> allowed values (None: a positive float)
EXTRA_POLICY_KEYS: dict[str, tuple[str, ...] | None] = {
    "fp8_clamp": None,
    "writer_rope": ("none", "identity"),
    "round_to_bf16_first": ("true", "false"),
    "v32_scale_decode": tuple(m.value for m in V32ScaleDecode),
}
CONTRACT_PREFIX = f"call raised {OutputContractError.__name__}: "


def known_policy_keys() -> list[str]:
    return sorted(set(POLICY_ENUMS) | set(BOOL_POLICY_KEYS) | set(EXTRA_POLICY_KEYS))


def check_policies(fn: str, policies: Any) -> dict[str, str]:
    """``policies`` validated and normalised to strings (enum members -> values, bools ->
    ``"true"``/``"false"``); ``InputError`` naming the key or value and the known ones."""
    if policies is None:
        return {}
    if not isinstance(policies, dict):
        raise InputError(f"{fn}: argument 'policies' must be a dict of policy name -> value "
                         f"(got {type(policies).__name__}); known policies: {known_policy_keys()}")
    out: dict[str, str] = {}
    for k, v in policies.items():
        if k not in POLICY_ENUMS and k not in BOOL_POLICY_KEYS and k not in EXTRA_POLICY_KEYS:
            raise InputError(f"{fn}: argument 'policies' has unknown policy {k!r}; known policies: {known_policy_keys()}")
        v = v.value if hasattr(v, "value") else v
        if isinstance(v, bool):
            v = "true" if v else "false"
        if k in POLICY_ENUMS:
            allowed = tuple(m.value for m in POLICY_ENUMS[k])
        elif k in BOOL_POLICY_KEYS:
            allowed = ("true", "false")
        else:
            allowed = EXTRA_POLICY_KEYS[k]
        if allowed is None:  # fp8_clamp: a positive finite float, or none
            if v in (None, "none", ""):
                continue
            try:
                f = float(v)
            except (TypeError, ValueError):
                f = math.nan
            if not (math.isfinite(f) and f > 0):
                raise InputError(f"{fn}: argument 'policies' has {k}={v!r}; it must be a positive finite "
                                 f"float (e.g. 224.0, the gfx942 FNUZ writer clamp) or 'none'")
            out[k] = repr(f)
            continue
        if str(v) not in allowed:
            raise InputError(f"{fn}: argument 'policies' has {k}={v!r}; known values of {k}: {list(allowed)}")
        out[k] = str(v)
    return out


class CaseInputs(dict):
    """The canonical inputs of one case (a plain dict of tensors and values) handed to a plain
    callable, with the case's ``name``, ``stage`` and ``params`` as attributes (e.g. the index
    stages name their builder in ``params["builder"]``)."""

    def __init__(self, case: Case, inputs: dict[str, Any]):
        super().__init__(inputs)
        self.name: str = case.name
        self.stage: str = case.stage
        self.params: dict[str, Any] = dict(case.params)


def fresh(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its sizes, strides and storage offset kept (a gapped paged-cache view
    keeps its page stride), so a callable may write into it without touching the case."""
    if t.is_contiguous():
        return t.clone()
    return clone_storage(t)


def callable_name(fn: Any) -> str:
    """A test-id-safe entry name for a plain callable: ``user.<module>.<qualname>``."""
    q = getattr(fn, "__qualname__", None) or type(fn).__name__
    mod = getattr(fn, "__module__", None) or ""
    raw = f"user.{mod + '.' if mod and mod != '__main__' else ''}{q}"
    return re.sub(r"[^A-Za-z0-9_.\-]+", "_", raw)


def is_entry_like(fn: Any) -> bool:
    """A ``KernelEntry`` or an object with its fields (``call``, ``stage``, ``probe``)."""
    return callable(getattr(fn, "call", None)) and isinstance(getattr(fn, "stage", None), str) \
        and callable(getattr(fn, "probe", None))


@dataclass(frozen=True)
class JudgedEntry:
    """The entry-like object ``run_entry`` judges (module docstring). ``produce(case)`` returns the
    outputs (a plain callable wrapped, or a ``KernelEntry``'s ``call``); ``contract``: check the
    outputs against the stage's output contract first (plain callables only -- a ``KernelEntry``
    is judged exactly as the matrix judges it)."""

    name: str
    stage: str
    policies: dict[str, str]
    tolerance_scope: str
    produce: Callable[[Case], Any]
    contract: bool
    family: str = "user"
    probe_fn: Callable[[], Any] | None = None
    supports_fn: Callable[[Case], Any] | None = None
    cpu_cases: dict[str, Case] = field(default_factory=dict, compare=False)
    memo: dict[str, Any] = field(default_factory=dict, compare=False)
    expected_cache: dict = field(default_factory=dict, compare=False)

    def probe(self) -> str | None:
        return self.probe_fn() if self.probe_fn is not None else None

    def supports(self, case: Case) -> str | None:
        return self.supports_fn(case) if self.supports_fn is not None else None

    def with_policies(self, policies: dict[str, str]) -> "JudgedEntry":
        """The same kernel (sharing the output memo and the reference cache) declaring ``policies``."""
        return dataclasses.replace(self, policies=dict(policies))

    def call(self, case: Case) -> Any:
        hit = self.memo.get(case.name)
        if hit is None:
            announce({"entry": self.name, "stage": self.stage, "case": case.name, "family": self.family,
                      "device": case_device(case), "policies": dict(self.policies)})
            try:
                got = self.produce(case)
                if self.contract:
                    self._check(case, got)
                hit = ("ok", got)
            except Exception as e:  # noqa: BLE001 - remembered, re-raised for run_entry to report
                hit = ("raised", e)
            self.memo[case.name] = hit
        if hit[0] == "raised":
            raise hit[1]
        got = hit[1]
        return dict(got) if isinstance(got, dict) else got

    def _check(self, case: Case, got: Any) -> None:
        spec = st.get(self.stage)
        cpu_case = self.cpu_cases.get(case.name, case)
        try:
            exp = expected_outputs(spec, self.stage, cpu_case, spec.policies(self.policies), self.expected_cache)
        except (InputError, UnsupportedCase):
            return  # the runner reports the reference's rejection of the case
        check_outputs(self.stage, spec.kind, case.name, cpu_case.inputs, exp, got)


def case_device(case: Case) -> str:
    """The device of the case's first tensor input (``"cpu"`` when it has none)."""
    return next((str(v.device) for v in case.inputs.values() if isinstance(v, torch.Tensor)), "cpu")


def call_callable(fn: Callable[[CaseInputs], dict], case: Case) -> Any:
    """``fn(inputs)`` on ``case`` the way a plain callable is called (module docstring): its
    tensors as fresh copies, wrapped in a :class:`CaseInputs`."""
    inputs = {k: fresh(v) if isinstance(v, torch.Tensor) else v for k, v in case.inputs.items()}
    return fn(CaseInputs(case, inputs))


def from_callable(fn: Callable[[CaseInputs], dict], stage: str, policies: dict[str, str], name: str | None,
                  cases: list[Case]) -> JudgedEntry:
    nm = name or callable_name(fn)
    return JudgedEntry(nm, stage, dict(policies), nm, lambda case: call_callable(fn, case), True,
                       cpu_cases={c.name: c for c in cases})


def from_entry(entry: Any, policies: dict[str, str], cases: list[Case]) -> JudgedEntry:
    """A ``KernelEntry`` (or entry-like object) with ``policies`` overriding its declared ones."""
    declared = {k: (v.value if hasattr(v, "value") else str(v)) for k, v in (getattr(entry, "policies", {}) or {}).items()}
    sup = getattr(entry, "supports", None)
    return JudgedEntry(getattr(entry, "name", "?"), entry.stage, {**declared, **policies},
                       getattr(entry, "tolerance_scope", getattr(entry, "name", "?")), entry.call, False,
                       family=getattr(entry, "family", ""), probe_fn=entry.probe,
                       supports_fn=sup if callable(sup) else None, cpu_cases={c.name: c for c in cases})


def mark_contract_errors(results: list) -> list:
    """Results whose call broke the output contract: rule ``outputs``, the contract message alone."""
    for r in results:
        if r.verdict == "error" and r.rule == "call" and r.message.startswith(CONTRACT_PREFIX):
            r.rule = "outputs"
            r.message = r.message[len(CONTRACT_PREFIX):]
            r.details = {}
    return results


__all__ = ["CaseInputs", "EXTRA_POLICY_KEYS", "JudgedEntry", "call_callable", "callable_name", "case_device",
           "check_policies", "fresh", "from_callable", "from_entry", "is_entry_like", "known_policy_keys", "mark_contract_errors"]
