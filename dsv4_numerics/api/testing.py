"""The public API: judge your own kernel against the reference, from your own repository and CI,
the way ``torch.testing.assert_close`` is used (re-exported as ``dsv4_numerics.cases`` etc.)::

    import dsv4_numerics as dn

    def my_writer(inputs):                         # inputs: the canonical inputs of one case
        cache = inputs["cache"]                    # a fresh copy: write into it in place
        my_kernel(inputs["k"], inputs["slot_mapping"], cache, inputs["block_size"])
        return {"cache": cache}                    # the canonical outputs

    dn.stages()                                    # {stage name: one-line description}
    dn.cases("swa_write")                          # the matrix's canonical cases of a stage
    dn.judge(my_writer, "swa_write")               # -> list[Result] (pass/fail/skip/error per case)
    dn.assert_matches_reference(my_writer, "swa_write", policies={"scale_rule": "scale_clamp"})
    print(dn.explain(my_writer, "swa_write"))      # which declared policy set the kernel matches

The kernel under test (``fn``) is either

* a plain callable ``fn(inputs) -> dict[str, Tensor]``: ``inputs`` is a
  :class:`~dsv4_numerics.api.callable_entry.CaseInputs`, a dict of the case's canonical inputs
  (tensors are fresh copies on ``device``, so ``fn`` may write into them; plain values as they
  are) carrying the case's ``name``, ``stage`` and ``params`` as attributes. It returns the
  canonical outputs of the stage (the table in ``oracles/stages/__init__.py``; e.g. ``{"cache": ...}``
  for the cache writers, ``{"out": bf16 [T, H, 512], "lse": [T, H]}`` for decode, LSE natural
  log and sink-free). Wrong keys, dtypes or shapes give an ``error`` Result (rule ``outputs``)
  with one message naming the output and what was expected; or
* a :class:`~dsv4_numerics.kernels.registry.KernelEntry` (or an object with its fields): judged
  exactly as the matrix judges it (its probe, ``supports``, declared policies and tolerance scope;
  ``policies`` given here override the declared ones); or
* either of them named by its dotted path, ``"my_pkg.kernels:my_writer"`` (or a registered
  entry's name).

A kernel that can take its process down (a segfault, an ``abort``, a hang, a device fault) is
judged with ``isolate=True``: it is then called in a child process
(:mod:`dsv4_numerics.api.isolation`, the isolation the matrix's built-in entries run in), so
such a failure becomes an ``error`` Result of that case (rule ``crash`` with the signal,
``timeout`` after ``timeout_s`` seconds without progress, ``device_fault``) and the other cases
still run; the outputs come back and are judged here exactly as without isolation. The child
imports the kernel by its dotted path: a module-level function or callable, a module-level or
registered ``KernelEntry`` (a lambda or a closure is an ``InputError``). The pytest plugin's
``--dsv4-isolate`` (ini ``dsv4_isolate = true``) makes isolation the default; a kernel the
child cannot import is then judged in this process, with a warning saying why.

Everything goes through the matrix's own runner (``oracles.matrix.run_entry``), comparators and
tolerance records. Bytes and index stages are bit-exact; numeric stages use the tolerance record
of the callable's scope (a plain callable has no records of its own: it is judged under the tier
A defaults, the strictest numeric tier; ``tolerances`` substitutes a whole record set). Policies
(``policies={"scale_rule": "scale_clamp"}``) declare where the kernel follows a named producer
behaviour (``reference.policies``); keys a stage does not use are ignored by it, unknown keys or
values are an ``InputError`` naming the known ones.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Union

import torch

from dsv4_numerics.kernels.registry import KernelEntry
from dsv4_numerics.oracles import stages as st
from dsv4_numerics.oracles.bytes_diff import BytesReport, Difference
from dsv4_numerics.oracles.text import format_number
from dsv4_numerics.oracles.matrix import run_entry
from dsv4_numerics.oracles.report import Result
from dsv4_numerics.oracles.tolerances import Tolerances
from dsv4_numerics.reference.cases import Case, default_cases, stage_cases
from dsv4_numerics.reference.errors import InputError

from dsv4_numerics.api.callable_entry import (
    CaseInputs,
    JudgedEntry,
    check_policies,
    from_callable,
    from_entry,
    is_entry_like,
    mark_contract_errors,
)
from dsv4_numerics.api import isolation
from dsv4_numerics.api.result_sink import publish, publish_judged

Kernel = Union[Callable[[CaseInputs], dict], KernelEntry, Any]
SIZES = ("default", "small", "full")
SMALL_CASES = 2  # size="small": the first SMALL_CASES default cases (each builder lists a broad case first)
MAX_CASE_LINES = 12  # failing cases listed one line each in an assertion message


def stages() -> dict[str, str]:
    """Every stage that can be judged: ``{name: one-line description}`` (kind in brackets:
    ``bytes`` and ``index`` are bit-exact, ``numeric`` by tolerance)."""
    return {name: f"[{spec.kind}] {spec.doc}" for name, spec in sorted(st.STAGES.items())}


def _stage(fn_name: str, stage: Any) -> st.StageSpec:
    if not isinstance(stage, str) or stage not in st.STAGES:
        raise InputError(f"{fn_name}: unknown stage {stage!r}; known stages: {sorted(st.STAGES)}")
    return st.STAGES[stage]


def cases(stage: str, *, size: str = "default") -> list[Case]:
    """The canonical cases of ``stage``: the ones the kernel matrix, the mutation suite and
    ``dsv4-numerics check`` use (``reference.cases.default_cases``; CPU tensors, deterministic on
    every call and machine; fresh objects each call). ``size``: ``"default"`` (all of them),
    ``"small"`` (the first two, a broad case and the stage's first edge case) or ``"full"`` (the
    GPU-sized sweep of ``decode`` / ``prefill``: the default cases plus page sizes 2-576, top-k up
    to 16384, batch up to 321, magnitudes; other stages: their default set)."""
    _stage("cases", stage)
    if size not in SIZES:
        raise InputError(f"cases: unknown size {size!r}; known sizes: {list(SIZES)}")
    if size == "full":
        return stage_cases(stage, "full")
    out = default_cases(stage)
    return out[:SMALL_CASES] if size == "small" else out


def resolve_cases(fn_name: str, stage: str, given: Iterable[Case] | None) -> list[Case]:
    if given is None:
        return default_cases(stage)
    if isinstance(given, (str, Case)) or not isinstance(given, Iterable):
        raise InputError(f"{fn_name}: argument 'cases' must be a list of Case (e.g. dsv4_numerics.cases("
                         f"{stage!r})), got {type(given).__name__}")
    out = list(given)
    for c in out:
        if not isinstance(c, Case):
            raise InputError(f"{fn_name}: argument 'cases' must hold Case objects, got {type(c).__name__}")
        if c.stage != stage:
            raise InputError(f"{fn_name}: argument 'cases' holds case {c.name!r} of stage {c.stage!r}, "
                             f"not {stage!r}")
    if not out:
        raise InputError(f"{fn_name}: argument 'cases' is empty: nothing to judge")
    return out


def build_entry(fn_name: str, fn: Kernel, stage: str, policies: Any, case_list: list[Case],
           name: str | None) -> JudgedEntry:
    pol = check_policies(fn_name, policies)
    if isinstance(fn, str):
        fn = isolation.resolve(fn, fn_name)
    if is_entry_like(fn):
        if fn.stage != stage:
            raise InputError(f"{fn_name}: kernel entry {getattr(fn, 'name', '?')!r} is for stage {fn.stage!r}, "
                             f"not {stage!r}")
        check_policies(f"{fn_name} (entry {getattr(fn, 'name', '?')!r} declared)", getattr(fn, "policies", None))
        return from_entry(fn, pol, case_list)
    if not callable(fn):
        raise InputError(f"{fn_name}: argument 'fn' must be a callable fn(inputs) -> dict of outputs, or a "
                         f"KernelEntry (got {type(fn).__name__})")
    return from_callable(fn, stage, pol, name, case_list)


def _target(fn_name: str, fn: Kernel, isolate: Any) -> isolation.Target | None:
    """Where an isolated child imports ``fn`` from, or None when ``fn`` runs in this process
    (``isolate`` False, or None with the default off; with the plugin's default on, a kernel
    the child cannot import runs here, with a warning)."""
    if isolate is not None and not isinstance(isolate, bool):
        raise InputError(f"{fn_name}: argument 'isolate' must be True, False or None (the default: "
                         f"{isolation.default()}), got {isolate!r}")
    if not (isolation.default() if isolate is None else isolate):
        return None
    try:
        return isolation.target_of(fn, fn_name)
    except InputError as e:
        if isolate:
            raise
        warnings.warn(f"{e} -- judged in this process instead (isolation is the default here); pass "
                      f"isolate=False to say so", stacklevel=3)
        return None


def _run(entry: JudgedEntry, case_list: list[Case], device: Any, arch: str | None,
         tolerances: Tolerances | None, fn_name: str) -> list[Result]:
    if tolerances is not None and not isinstance(tolerances, Tolerances):
        raise InputError(f"{fn_name}: argument 'tolerances' must be an oracles.tolerances.Tolerances "
                         f"(got {type(tolerances).__name__})")
    if device is not None:
        try:
            torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise InputError(f"{fn_name}: argument 'device' is not a torch device: {e}") from None
    return mark_contract_errors(run_entry(entry, cases=case_list, device=device, arch=arch, tolerances=tolerances,
                                          expected_cache=entry.expected_cache))


def _prepare(fn_name: str, fn: Kernel, stage: Any, policies: Any, cases: Any, name: str | None, isolate: Any,
             timeout_s: Any) -> tuple[list[Case], JudgedEntry, isolation.Target | None, float | None]:
    """The arguments checked: the case list, the entry, where an isolated child finds the kernel
    (None: called here) and the per-case time limit."""
    _stage(fn_name, stage)
    case_list = resolve_cases(fn_name, stage, cases)
    timeout = isolation.check_timeout(fn_name, timeout_s)
    entry = build_entry(fn_name, fn, stage, policies, case_list, name)
    return case_list, entry, _target(fn_name, fn, isolate), timeout


@contextmanager
def _calls(entry: JudgedEntry, target: isolation.Target | None, case_list: list[Case], device: Any,
           timeout: float | None, default_cases: bool) -> Iterator[tuple[JudgedEntry, isolation.ChildCalls | None]]:
    """``entry`` as it is judged: itself (``target`` None), or with its calls made in isolated
    children (and those calls, to ``mark`` the Results)."""
    if target is None:
        yield entry, None
        return
    with isolation.isolated(entry, target, case_list, device=device, timeout_s=timeout,
                            default_cases=default_cases) as pair:
        yield pair


def _judge(fn_name: str, fn: Kernel, stage: str, policies: Any, cases: Any, device: Any, arch: str | None,
           tolerances: Any, name: str | None, isolate: Any, timeout_s: Any) -> tuple[list[Result], list[Case]]:
    """(Results, the Case objects judged) of one judge call."""
    case_list, entry, target, timeout = _prepare(fn_name, fn, stage, policies, cases, name, isolate, timeout_s)
    if target is not None:
        _run(entry, [], device, arch, tolerances, fn_name)  # argument checks, before any child starts
    with _calls(entry, target, case_list, device, timeout, cases is None) as (judged, calls):
        results = _run(judged, case_list, device, arch, tolerances, fn_name)
    return (calls.mark(results) if calls is not None else results), case_list


def judge(fn: Kernel, stage: str, *, policies: dict[str, Any] | None = None, cases: Iterable[Case] | None = None,
          device: str | torch.device | None = None, arch: str | None = None,
          tolerances: Tolerances | None = None, name: str | None = None, isolate: bool | None = None,
          timeout_s: float | None = None) -> list[Result]:
    """Judge ``fn`` (module docstring) on ``cases`` of ``stage`` (default: all canonical cases);
    one :class:`~dsv4_numerics.oracles.report.Result` per case (``verdict`` pass / fail / skip /
    error, the deciding ``rule``, ``worst_ulps``, ``headroom`` = tolerance / observed, the one-line
    ``message`` and the decoded diff or numeric reports in ``details``).

    policies:   the policies ``fn`` declares (stage defaults for the rest); validated.
    device:     where the case inputs are placed before ``fn`` is called (default: CPU).
    arch:       the architecture tag the tolerance records are looked up for (default: the
                device's, e.g. ``sm90``, ``cpu``).
    tolerances: another record set (``oracles.tolerances.Tolerances``) instead of the shipped one.
    name:       the entry name shown in results and used as tolerance scope (default
                ``user.<module>.<function>``).
    isolate:    call ``fn`` in a crash-isolated child process (module docstring); None: the
                default (off, unless the pytest plugin's ``--dsv4-isolate`` turned it on).
    timeout_s:  with isolation, how long one case may run without finishing before its child is
                killed (an ``error`` Result, rule ``timeout``; default ``DSV4_KERNEL_CASE_TIMEOUT``
                or 180 s).
    Bad arguments raise ``InputError``; the kernel's own failures are ``error`` Results.
    Inside a pytest test (the plugin installed) the Results are also attached to the test's
    report (``dsv4_numerics.api.result_sink``), whatever the test does next.
    """
    results, case_list = _judge("judge", fn, stage, policies, cases, device, arch, tolerances, name, isolate,
                                timeout_s)
    publish(results)  # to the pytest plugin's per-test sink, if any: they reach --dsv4-report even if the test fails
    publish_judged(fn, stage, case_list, dict(policies or {}), results)  # --dsv4-repro, if any
    return results


# --------------------------------------------------------------------------- the explained diff


def _f(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    return format_number(v)


def _is_bytes_report(d: Any) -> bool:
    return isinstance(d, dict) and "layout" in d and "differences" in d


def _bytes_text(d: dict, max_lines: int = 8) -> str:
    import dataclasses

    keep = {f.name for f in dataclasses.fields(BytesReport)}
    dkeep = {f.name for f in dataclasses.fields(Difference)}
    diffs = [Difference(**{k: v for k, v in x.items() if k in dkeep}) for x in d.get("differences", [])]
    rep = BytesReport(**{**{k: v for k, v in d.items() if k in keep}, "differences": diffs})
    return rep.summary(max_lines=max_lines)


def _numeric_text(name: str, d: dict) -> str:
    if "max_abs" not in d:  # three-output or other rule report
        return f"{name}: {'PASS' if d.get('passed') else 'FAIL'} [{d.get('rule', '?')}] {d.get('message', '')}".rstrip()
    tol = d.get("tolerance") or {}
    unit = tol.get("atol_unit")
    atol = f"{_f(d.get('atol'))}" + (f" (scaled by the case's V rms {_f(tol.get('vrms'))})" if unit == "vrms" else "")
    s = (f"{name}: {'PASS' if d.get('passed') else 'FAIL'} [{d.get('rule')}] "
         f"{d.get('mismatch_count', 0)} of {d.get('numel', 0)} elements outside tolerance; "
         f"max abs err {_f(d.get('max_abs'))} at {d.get('max_abs_index')}"
         + (f" (got {_f(d['max_abs_values'][0])}, ref {_f(d['max_abs_values'][1])})" if d.get("max_abs_values") else "")
         + f"; max {_f(d.get('max_ulps'))} ulps ({d.get('fmt')}) at {d.get('max_ulps_index')}"
         f"; cos diff {_f(d.get('cos_diff'))}; headroom {_f(d.get('headroom'))}"
         f"\n    tolerance: atol {atol}, rtol {_f(d.get('rtol'))}, cos_tol {_f(d.get('cos_tol'))}")
    if tol:
        s += f" (tier {tol.get('tier')} {tol.get('kind')} record, line {tol.get('line')})"
    if d.get("anomaly_mismatch"):
        s += f"\n    NaN/Inf positions differ: {d['anomaly_mismatch']}"
    if d.get("message"):
        s += f"\n    {d['message']}"
    return s


def explain_result(r: Result) -> str:
    """The explained diff of one Result: the decoded byte diff (slot / tile / scale byte, and the
    alternative policy that explains it) for bytes and index stages; per output elements, ulps,
    headroom and tolerance (and the three-output rule where it applies) for numeric stages."""
    head = (f"{r.case}: {r.verdict.upper()} [{r.rule}] worst {_f(r.worst_ulps)} ulps, headroom {_f(r.headroom)}"
            f"\n  {r.message}" if r.message else f"{r.case}: {r.verdict.upper()} [{r.rule}]")
    d = r.details or {}
    parts: list[str] = []
    if _is_bytes_report(d):
        parts.append(_bytes_text(d))
    else:
        for k, v in d.items():
            if k == "traceback":
                parts.append(str(v).rstrip())
            elif k == "stderr":  # an isolated child's last words (api.isolation)
                parts.append("stderr of the child:\n" + str(v).rstrip())
            elif _is_bytes_report(v):
                parts.append(_bytes_text(v))
            elif isinstance(v, dict) and ("max_abs" in v or "rule" in v):
                parts.append(_numeric_text(k, v))
            elif isinstance(v, dict) and v:
                parts.append(f"{k}: " + ", ".join(f"{a}={_f(b) if isinstance(b, (int, float)) else b}"
                                                   for a, b in list(v.items())[:8]))
    body = "\n".join("  " + line for p in parts for line in p.splitlines())
    return head + ("\n" + body if body else "")


def failure_message(results: list[Result], stage: str, policies: dict[str, str] | None = None) -> str:
    """'' if ``results`` show a match; else the assertion message: counts, one line per failing
    case, the first failing case explained in full (``explain_result``), and the policy that
    explains a byte difference (declare it if it is intended)."""
    bad = [r for r in results if r.verdict in ("fail", "error")]
    judged = [r for r in results if r.verdict in ("pass", "fail")]
    entry = results[0].entry if results else "?"
    pol = ", ".join(f"{k}={v}" for k, v in sorted((policies or {}).items()))
    if not bad and judged:
        return ""
    if not results:
        return f"{entry} on {stage}: no cases were judged (the case list is empty)"
    if not bad:
        reasons = sorted({r.message for r in results})
        return (f"{entry} on {stage}: nothing was judged -- all {len(results)} cases were skipped: "
                + "; ".join(reasons[:3]) + (" ..." if len(reasons) > 3 else ""))
    lines = [f"{entry} does not match the reference on stage '{stage}': {len(bad)} of {len(results)} cases "
             f"failed or errored (declared policies: {pol or 'the stage defaults'})"]
    w = max(len(r.case) for r in bad)
    for r in bad[:MAX_CASE_LINES]:
        lines.append(f"  {r.verdict.upper():<5} {r.case:<{w}}  {r.rule}: {r.message[:160]}")
    if len(bad) > MAX_CASE_LINES:
        lines.append(f"  ... {len(bad) - MAX_CASE_LINES} more")
    lines.append("first one in full:")
    lines.extend("  " + ln for ln in explain_result(bad[0]).splitlines())
    hint = _policy_hint(bad)
    if hint:
        lines.append(hint)
    return "\n".join(lines)


def _policy_hint(bad: list[Result]) -> str:
    import re

    found: list[str] = []
    for r in bad:
        for m in re.finditer(r"bytes match ((?:[a-z0-9_]+)=(?:[a-z0-9_.]+))", r.message + " " + str(r.details)):
            if m.group(1) not in found:
                found.append(m.group(1))
    if not found:
        return ""
    return (f"the differences are explained by {', '.join(found)}: if that is your kernel's intended behaviour, "
            f"declare it (policies={{{', '.join(repr(f.split('=')[0]) + ': ' + repr(f.split('=')[1]) for f in found)}}}); "
            f"dsv4_numerics.explain(fn, stage) finds the whole policy set")


def assert_matches_reference(fn: Kernel, stage: str, *, policies: dict[str, Any] | None = None,
                             cases: Iterable[Case] | None = None, device: str | torch.device | None = None,
                             arch: str | None = None, tolerances: Tolerances | None = None,
                             name: str | None = None, isolate: bool | None = None,
                             timeout_s: float | None = None) -> list[Result]:
    """:func:`judge`, then ``AssertionError`` unless every judged case passes and at least one
    case was judged (skipped cases -- outside the kernel's contract -- are allowed, all skipped is
    not). The message is the explained diff (:func:`failure_message`). Returns the Results."""
    results = judge(fn, stage, policies=policies, cases=cases, device=device, arch=arch, tolerances=tolerances,
                    name=name, isolate=isolate, timeout_s=timeout_s)
    msg = failure_message(results, stage, results[0].policies if results else None)
    if msg:
        raise AssertionError(msg)
    return results


def explain(fn: Kernel, stage: str, *, policies: dict[str, Any] | None = None, cases: Iterable[Case] | None = None,
            device: str | torch.device | None = None, arch: str | None = None,
            tolerances: Tolerances | None = None, name: str | None = None, isolate: bool | None = None,
            timeout_s: float | None = None):
    """Which declared policy set ``fn`` matches on ``stage``: the cases are judged under every
    combination of the values of the stage's policies that the cases can tell apart
    (``policy_search.AXES``), ``fn`` is called once per case. Returns an
    :class:`~dsv4_numerics.api.policy_search.Explanation` (``matches``, ``closest``, ``declare``,
    per-combination counts; ``str()`` is readable). ``policies`` fixes the keys not searched.
    ``isolate`` / ``timeout_s``: as for :func:`judge` (the kernel is called once per case, in the
    child; a case it crashes on counts as an ``error`` in every combination)."""
    from dsv4_numerics.api.policy_search import search

    case_list, entry, target, timeout = _prepare("explain", fn, stage, policies, cases, name, isolate, timeout_s)
    _run(entry, [], device, arch, tolerances, "explain")  # argument checks only
    with _calls(entry, target, case_list, device, timeout, cases is None) as (judged, _):
        return search(judged, case_list, device=device, arch=arch, tolerances=tolerances)


__all__ = ["CaseInputs", "SIZES", "assert_matches_reference", "cases", "explain", "explain_result",
           "failure_message", "judge", "stages"]
