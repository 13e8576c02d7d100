"""The one matrix runner: judge any entry-like object on its stage's cases (docs/architecture.md).

``run_entry(entry, cases=None, device=None, arch=None, tolerances=None) -> list[Result]``

``entry`` is anything with the ``KernelEntry`` fields the runner uses: ``name``, ``stage``,
``policies`` (dict), ``tolerance_scope``, ``probe()`` and ``call(case)``; ``family`` is read if
present, and an optional ``supports(case) -> str | None`` lets an entry decline a case. Mutants,
the reference positive control, recorded-fixture replays and real kernels all go through here.

Per case:

1. ``probe()`` returns a reason -> every case is a ``skip`` carrying it (a probe that raises is an
   ``error``);
2. ``supports(case)`` returns a reason, or ``call`` raises ``reference.errors.UnsupportedCase``
   -> ``skip`` with that reason (outside the kernel's documented contract);
3. ``call`` raises anything else -> ``error`` with the exception type and message;
4. the reference (``StageSpec.expected`` under the stage defaults overridden by the entry's
   policies) is computed; if it rejects the case (``InputError``) -> ``error`` naming it.
   Oracle mode (``oracle_mode``; None = auto): ``fast`` on a CUDA ``device`` -- the attention
   stages (``stages.FAST_ORACLE_STAGES``) compute their attention on the kernel's device with
   ``reference.attention.fast`` (unordered float64 GEMMs, a returned a-priori bound on the
   distance to the ordered oracle) -- else ``ordered`` (the fixed-order oracle on the CPU, as the
   fixtures use). Every Result records it in ``details["oracle"]`` (mode, device, bound);
5. otherwise ``StageSpec.judge`` decides ``pass``/``fail`` (an exception in the judge is an
   ``error``, never a pass).

Outputs are moved to CPU before judging; the case handed to ``call`` is moved to ``device``.
The tolerance arch is ``arch`` if given, else the entry's ``run_arch()`` (a CPU production
kernel's x86 ISA tag), else the device's (``sm90``, ``sm100``, ``gfx942`` ..., ``cpu``); every
Result records it (``Result.arch``) with the entry's ``version()`` (``Result.kernel_version``).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from dsv4_numerics.reference.cases import Case, default_cases
from dsv4_numerics.reference.errors import InputError, UnsupportedCase

from . import stages as st
from .digest import outputs_digest
from .report import Result, Verdict
from .tolerances import Tolerances


def device_arch(device: str | torch.device | None) -> str:
    """Architecture tag of ``device``: ``sm<major><minor>`` (``sm90``, ``sm100``, ``sm120``),
    the ROCm gfx name, or ``cpu``."""
    if device is None:
        return "cpu"
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return dev.type
    props = torch.cuda.get_device_properties(dev)
    if getattr(torch.version, "hip", None):
        return str(getattr(props, "gcnArchName", "rocm")).split(":")[0]
    return f"sm{props.major}{props.minor}"


def _cpu_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU with its sizes, strides and storage offset kept: a gapped view (a paged
    cache ``[nb, bs, 584]`` with ``stride(0) > bs*584``) keeps its page stride, so the judge sees
    the geometry the kernel wrote."""
    t = t.detach()
    if t.device.type == "cpu":
        return t
    if t.is_contiguous():
        return t.cpu()
    storage = t.untyped_storage().cpu()
    out = torch.empty(0, dtype=t.dtype)
    out.set_(storage, t.storage_offset(), t.size(), t.stride())
    return out


def to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return _cpu_tensor(x)
    if isinstance(x, dict):
        return {k: to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_cpu(v) for v in x)
    return x


def _msg(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()


def expected_outputs(spec: Any, stage: str, case: Case, policies: dict, cache: dict | None = None) -> dict:
    """``spec.expected(case, policies)`` (``policies``: the full set, ``spec.policies(...)``),
    memoised in ``cache`` (when given) under ``(stage, case name, sorted policies)``: the key of
    :func:`run_entry`'s ``expected_cache``, so any caller sharing that dict computes a reference
    output once. Exceptions of ``spec.expected`` propagate and nothing is stored."""
    key = (stage, case.name, tuple(sorted((k, str(v)) for k, v in policies.items())))
    if cache is not None and key in cache:
        return cache[key]
    exp = spec.expected(case, policies)
    if cache is not None:
        cache[key] = exp
    return exp


class _CaseDecided(Exception):
    """A case's Result decided before (or instead of) its judgement: a ``skip`` outside the
    kernel's contract, or an ``error`` of the call, the reference or the judge."""

    def __init__(self, verdict: Verdict, rule: str, message: str, details: dict | None = None) -> None:
        super().__init__(message)
        self.verdict, self.rule, self.message, self.details = verdict, rule, message, details or {}


def _guarded(rule: str, fn: Any, *args: Any, unsupported: str | None = None, rejected: str | None = None) -> Any:
    """``fn(*args)``, one phase of judging a case (``rule``: ``call``, ``reference`` or ``judge``);
    its exception becomes a :class:`_CaseDecided`:

    * ``UnsupportedCase``, where ``unsupported`` is given: ``skip``, rule ``unsupported``, the
      message ``unsupported`` followed by the exception's;
    * ``InputError``, where ``rejected`` is given: ``error`` saying ``"<rejected>: <exception>"``;
    * anything else: ``error`` saying ``"<rule> raised <type>: <message>"``, with the traceback
      in ``details["traceback"]`` -- never a silent pass.
    """
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the kernel's (or the harness's) failure is the result
        if unsupported is not None and isinstance(e, UnsupportedCase):
            raise _CaseDecided(Verdict.SKIP, "unsupported", f"{unsupported}{e}") from None
        if rejected is not None and isinstance(e, InputError):
            raise _CaseDecided(Verdict.ERROR, rule, f"{rejected}: {e}") from None
        raise _CaseDecided(Verdict.ERROR, rule, f"{rule} raised {_msg(e)}",
                          {"traceback": traceback.format_exc(limit=6)}) from None


@dataclass(frozen=True)
class _Plan:
    """What judging every case of one entry shares: the stage's spec, the policies (``pol`` for
    the judge, ``pol_exp`` for the reference: ``pol`` plus the fast oracle's keys), the judge's
    scope, the device and the reference cache."""

    spec: Any
    stage: str
    pol: dict
    pol_exp: dict
    scope: Any
    device: Any
    expected_cache: dict | None
    on_device: bool = False  # judged on the device: the outputs stay there


def _judge_case(entry: Any, case: Case, plan: _Plan) -> dict[str, Any]:
    """The Result fields of ``entry`` on ``case`` (steps 3-5 of the module docstring); a
    :class:`_CaseDecided` where the call, the reference or the judge decided it first."""
    device = plan.device
    dcase = _guarded("call", case.to, device, unsupported="") if device is not None else case
    t_call = time.perf_counter()
    got = _guarded("call", entry.call, dcase, unsupported="")
    # (a device-to-host copy waits for the kernel: its time is the call's; judged on the device,
    # the outputs stay there and the call's time is the time its launch returned in)
    got = got if plan.on_device else to_cpu(got)
    t_call = time.perf_counter() - t_call
    if not isinstance(got, dict):
        raise _CaseDecided(Verdict.ERROR, "call", f"call returned {type(got).__name__}, not a dict of outputs")
    t_ref = time.perf_counter()
    exp = _guarded("reference", expected_outputs, plan.spec, plan.stage, case, plan.pol_exp, plan.expected_cache,
                  unsupported="reference: ", rejected=f"the reference rejects this case under policies {plan.pol}")
    t_judge = time.perf_counter()
    t_ref = t_judge - t_ref
    v = _guarded("judge", plan.spec.judge, case, exp, got, plan.scope)
    details = dict(v.details)
    details.setdefault("oracle", {"mode": st.ORDERED, "device": "cpu"})
    details["outputs_sha256"] = outputs_digest(got)
    # where the case's time went (seconds): the kernel call (its outputs copied back to the CPU
    # included, which waits for the device), the reference, the comparison
    details["timing"] = {"call_s": round(t_call, 4), "reference_s": round(t_ref, 4),
                         "judge_s": round(time.perf_counter() - t_judge, 4)}
    return dict(verdict=Verdict.PASS if v.passed else Verdict.FAIL, rule=v.rule, worst_ulps=v.worst_ulps,
                headroom=v.headroom, message=v.message, details=details)


def run_entry(entry: Any, cases: Iterable[Case] | None = None, device: str | torch.device | None = None,
              arch: str | None = None, tolerances: Tolerances | None = None,
              expected_cache: dict | None = None, oracle_mode: str | None = None,
              judge_device: bool = False) -> list[Result]:
    """Judge ``entry`` on ``cases`` (default: ``default_cases(entry.stage)``); one Result per case.

    ``expected_cache``: a dict shared between calls that judge the *same case objects* (e.g. a
    test running many entries over one list of default cases); reference outputs are memoised in
    it by ``(stage, case name, policies)``. Never share it across differently built cases.
    ``oracle_mode``: ``"fast"``, ``"ordered"`` or None (fast on a CUDA device, else ordered).
    ``judge_device``: where the fast oracle judges (the attention stages; on ``device``), keep the
    kernel's outputs and the reference outputs there and compare them there (``numeric.compare``
    is device-generic; its element rules are exact elementwise float64 operations and its cosine
    uses ``fixed_sum``, whose bits are the same on every device), reading only the verdict's
    figures back; the decode caches are dequantised only at the slots some index reads
    (``stages.attention.decode_segments(compact=True)``). Default False: outputs are copied to
    the CPU and judged there.
    """
    name = getattr(entry, "name", "?")
    stage = getattr(entry, "stage", "?")
    family = getattr(entry, "family", "")
    policies = dict(getattr(entry, "policies", {}) or {})
    dev_str = str(device) if device is not None else "cpu"
    run_arch, version = getattr(entry, "run_arch", None), getattr(entry, "version", None)
    arch = arch or (run_arch() if callable(run_arch) else None) or device_arch(device)
    try:
        kernel_version = (version() if callable(version) else "") or ""
    except Exception as e:  # noqa: BLE001 - provenance must not stop judging
        kernel_version = f"unknown ({type(e).__name__}: {e})"

    def res(case_name: str, verdict: Verdict, **kw: Any) -> Result:
        return Result(entry=name, stage=stage, case=case_name, verdict=verdict, family=family,
                      device=dev_str, policies={k: str(v) for k, v in policies.items()}, arch=arch,
                      kernel_version=kernel_version, **kw)

    try:
        spec = st.get(stage)
    except KeyError as e:
        spec, spec_err = None, str(e.args[0]) if e.args else str(e)
    else:
        spec_err = ""
    try:
        case_list = list(cases) if cases is not None else default_cases(stage)
    except KeyError as e:
        return [res("-", Verdict.ERROR, rule="no_cases", message=str(e.args[0]) if e.args else str(e))]
    try:
        reason = entry.probe()
    except Exception as e:  # noqa: BLE001 - a broken probe is reported, not raised
        return [res(c.name, Verdict.ERROR, rule="probe", message=f"probe raised {_msg(e)}") for c in case_list]
    if reason:
        return [res(c.name, Verdict.SKIP, rule="probe", message=str(reason)) for c in case_list]
    if spec is None:
        return [res(c.name, Verdict.ERROR, rule="no_stage_spec", message=spec_err) for c in case_list]
    pol = spec.policies(policies)
    scope = st.JudgeScope(kernel=getattr(entry, "tolerance_scope", name), arch=arch, policies=pol,
                          tolerances=tolerances)
    supports = getattr(entry, "supports", None)
    if oracle_mode is None:
        oracle_mode = st.FAST if device is not None and torch.device(device).type == "cuda" else st.ORDERED
    if oracle_mode not in (st.FAST, st.ORDERED):
        return [res(c.name, Verdict.ERROR, rule="oracle_mode", message=f"oracle_mode must be 'fast', 'ordered' or None "
                    f"(got {oracle_mode!r})") for c in case_list]
    fast = oracle_mode == st.FAST and stage in st.FAST_ORACLE_STAGES
    pol_exp = dict(pol, oracle=st.FAST, oracle_device=dev_str) if fast else pol
    on_device = bool(judge_device) and fast
    if on_device:
        pol_exp = dict(pol_exp, judge_device="true")
    plan = _Plan(spec, stage, pol, pol_exp, scope, device, expected_cache, on_device)
    out: list[Result] = []
    for case in case_list:
        t0 = time.perf_counter()
        why = supports(case) if callable(supports) else None
        if why:
            out.append(res(case.name, Verdict.SKIP, rule="unsupported", message=str(why)))
            continue
        try:
            fields = _judge_case(entry, case, plan)
        except _CaseDecided as d:
            fields = dict(verdict=d.verdict, rule=d.rule, message=d.message, details=d.details)
        out.append(res(case.name, **fields, duration_s=time.perf_counter() - t0))
    return out


__all__ = ["device_arch", "expected_outputs", "run_entry"]
