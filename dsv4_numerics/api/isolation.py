"""Crash isolation for a kernel judged through the public API: ``judge`` /
``assert_matches_reference`` / ``explain`` with ``isolate=True`` (or the pytest plugin's
``--dsv4-isolate``, which makes it the default) call the kernel in a child process, so a
segfault, an ``abort`` in a C++ check, a hang or a device fault becomes an ``error`` Result for
the case that caused it, and the other cases still run (in a fresh child after a crash).

The child is the one the kernel matrix's built-in entries run in
(:func:`dsv4_numerics.runner.pool.run_isolated`, :mod:`dsv4_numerics.runner.child`): it runs the
cases one at a time from a case file (:mod:`dsv4_numerics.runner.case_files`), the parent watches
its event log, and a case that kills the child or makes no progress for ``timeout_s`` seconds
(default ``DSV4_KERNEL_CASE_TIMEOUT``, 180 s) is recorded with the signal or the time-out and the
tail of what the child wrote to stderr. Only the kernel's *call* runs in the child; its outputs
come back (:func:`save_outputs` / :func:`load_outputs`: each tensor's storage bytes in a
safetensors file, its dtype, sizes, strides and storage offset in JSON, so a gapped paged-cache
view keeps its page stride) and are checked and judged in this process exactly as without
isolation -- same output contract, runner, comparators, tolerance records and policy search. A
``KernelEntry``'s probe and ``supports`` run in this process too.

The child imports the kernel by its dotted path, ``module:qualname`` (:func:`target_of`): a
module-level function or callable object, a ``KernelEntry`` bound to a module-level name or
registered (built-in or an external entry), or that path given as a string. A lambda, a function
defined inside another function, a bound method or anything defined in ``__main__`` cannot be
imported there: ``InputError`` naming the argument and the rule. The child gets this process's
import path (the kernel module's root first), so a test module pytest imported is found again;
it checks that the module it imported is the same file.

Rules of the ``error`` Results (one per case): ``crash`` (the child died: the message names the
signal or exit code, ``details["stderr"]`` holds the tail of its stderr), ``timeout``,
``device_fault`` (an asynchronous CUDA fault caught after the case), ``setup_error`` (the child
could not import the kernel or read the cases), ``import`` (it imported another file of that
module name), ``not_run`` (the child crashed on more cases than there are). An exception the
kernel raises is the same ``call`` error as without isolation (its type name, message and the
child's traceback), an ``UnsupportedCase`` the same skip.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import sys
import tempfile
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

import torch

from dsv4_numerics.oracles.matrix import to_cpu
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.errors import InputError, UnsupportedCase

from dsv4_numerics.api.callable_entry import JudgedEntry, call_callable, is_entry_like

CHILD_JUDGE = f"{__name__}:call_in_child"  # the judge the kernel child runs (runner.child's --judge)
RULE = ("isolate=True runs the kernel in a child process, which imports it by its dotted path "
        "'module:qualname': a module-level function or callable object, a KernelEntry bound to a "
        "module-level name or registered (built-in or external), or that path as a string")
STDERR_MARK = "; stderr tail:"  # runner.pool's messages: '<what happened>; stderr tail:\n<tail>'
_DEFAULT = [False]


# ----------------------------------------------------------------------------- the default


def set_default(isolate: bool) -> bool:
    """Make ``isolate`` the default of the public API's ``isolate=None`` (the pytest plugin's
    ``--dsv4-isolate``); returns the previous default."""
    old, _DEFAULT[0] = _DEFAULT[0], bool(isolate)
    return old


def default() -> bool:
    """The current default of ``isolate`` (False unless :func:`set_default` changed it)."""
    return _DEFAULT[0]


# ----------------------------------------------------------------------------- the kernel's path


@dataclass(frozen=True)
class Target:
    """Where the child finds the kernel: ``spec`` (``module:qualname`` or an entry's worker
    spec, as ``runner.child.resolve_entry`` takes it), and for a module path the module's name
    and file (the child checks it imported the same file)."""

    spec: str
    module: str | None = None
    module_file: str | None = None


def _not_importable(fn_name: str, fn: Any, why: str) -> InputError:
    return InputError(f"{fn_name}: argument 'fn' ({_describe(fn)}) cannot be run isolated: {why}; {RULE}")


def _describe(fn: Any) -> str:
    q = getattr(fn, "__qualname__", None)
    if q:
        return f"{getattr(fn, '__module__', '?')}.{q}"
    name = getattr(fn, "name", None)
    return f"{type(fn).__name__} {name!r}" if isinstance(name, str) else type(fn).__name__


def _module_target(module: Any, attr: str) -> Target:
    return Target(f"{module.__name__}:{attr}", module.__name__, getattr(module, "__file__", None))


def _bound_name(module: Any, obj: Any) -> str | None:
    """The module-level name ``obj`` is bound to in ``module``, if any."""
    for k, v in list(vars(module).items()):
        if v is obj and not k.startswith("__"):
            return k
    return None


def _walk(module: Any, qualname: str) -> Any:
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _registered(fn: Any) -> str | None:
    """The worker spec of ``fn`` when it is a registered entry (built-in or external)."""
    name = getattr(fn, "name", None)
    if not isinstance(name, str):
        return None
    from dsv4_numerics.kernels import registry

    try:
        if registry.get(name) == fn:
            return name
    except Exception:  # noqa: BLE001 - not a built-in entry
        pass
    from dsv4_numerics.api import external

    try:
        if external.find(name) == fn:
            return external.worker_spec(name)
    except Exception:  # noqa: BLE001 - not an external one either
        pass
    return None


def target_of(fn: Any, fn_name: str) -> Target:
    """Where the child imports ``fn`` from (module docstring), or ``InputError`` naming the
    argument and the rule."""
    if isinstance(fn, str):
        resolve(fn, fn_name)
        mod = fn.partition(":")[0] if ":" in fn else None
        return Target(fn, mod, getattr(sys.modules.get(mod), "__file__", None) if mod else None)
    if is_entry_like(fn):
        spec = _registered(fn)
        if spec is not None:
            return Target(spec)
        for owner in (getattr(fn, "call", None), getattr(fn, "probe", None)):
            mod = sys.modules.get(getattr(owner, "__module__", None) or "")
            if mod is not None and mod.__name__ != "__main__":
                name = _bound_name(mod, fn)
                if name:
                    return _module_target(mod, name)
        raise _not_importable(fn_name, fn, "this entry is neither registered nor bound to a module-level name of "
                                           "the module that defines its call")
    qual = getattr(fn, "__qualname__", None)
    mod_name = getattr(fn, "__module__", None)
    if qual and "<lambda>" in qual:
        raise _not_importable(fn_name, fn, "a lambda has no name to import it by")
    if qual and "<locals>" in qual:
        raise _not_importable(fn_name, fn, "it is defined inside a function (a closure)")
    if mod_name is None and qual is None:  # a callable object: its class's module
        mod_name = type(fn).__module__
    if mod_name == "__main__":
        raise _not_importable(fn_name, fn, "it is defined in __main__ (a script), which the child cannot import: "
                                           "move it into a module")
    module = sys.modules.get(mod_name or "")
    if module is None:
        raise _not_importable(fn_name, fn, f"its module {mod_name!r} is not imported")
    if qual and _walk(module, qual) is fn:
        return _module_target(module, qual)
    name = _bound_name(module, fn)
    if name:
        return _module_target(module, name)
    why = ("a bound method is not a module-level name" if hasattr(fn, "__self__") and not isinstance(fn, type(len))
           else f"nothing in module {mod_name!r} is bound to it")
    raise _not_importable(fn_name, fn, why)


def resolve(spec: str, fn_name: str) -> Any:
    """The kernel a path names (``module:qualname``, or a registered entry's name); ``InputError``
    when it names nothing importable."""
    from dsv4_numerics.runner.child import resolve_entry

    if not spec or spec.startswith(":") or spec.endswith(":"):
        raise InputError(f"{fn_name}: argument 'fn' {spec!r} is not a dotted path 'module:qualname'")
    try:
        return resolve_entry(spec)
    except Exception as e:  # noqa: BLE001 - any import failure is the argument's fault
        raise InputError(f"{fn_name}: argument 'fn' {spec!r} names no importable kernel: "
                         f"{type(e).__name__}: {e}") from None


# ----------------------------------------------------------------------------- outputs across processes


class Opaque:
    """Stands in for an output value the child could not send back (not a tensor nor a plain
    JSON value); its class carries the original type's name, so the output contract's message
    names that type, as it does without isolation."""


def opaque(type_name: str) -> Opaque:
    return type(type_name, (Opaque,), {})()


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def save_outputs(outputs: Any, path: str | Path) -> dict:
    """Write ``outputs`` (a kernel's return value, tensors already on the CPU) for
    :func:`load_outputs`: every tensor's storage bytes into the safetensors file ``path`` (one
    blob per storage), and return the JSON description -- per output its dtype, sizes, strides
    and storage offset, or the plain value (None, bool, int, float, str), or only the type name of
    anything else; a return value that is not a dict is described by its type name alone."""
    from safetensors.torch import save_file

    if not isinstance(outputs, dict):
        return {"type": type(outputs).__name__}
    blobs: dict[str, torch.Tensor] = {}
    ptrs: dict[int, str] = {}
    desc: dict[str, dict] = {}
    for k, v in outputs.items():
        if isinstance(v, torch.Tensor) and v.layout == torch.strided and v.device.type == "cpu":
            storage = v.untyped_storage()
            key = ptrs.setdefault(storage.data_ptr(), f"s{len(ptrs)}")
            if key not in blobs:
                blobs[key] = torch.empty(0, dtype=torch.uint8).set_(storage)
            desc[str(k)] = {"blob": key, "dtype": str(v.dtype), "size": list(v.shape), "stride": list(v.stride()),
                            "offset": v.storage_offset()}
        elif v is None or isinstance(v, (bool, int, float, str)):
            desc[str(k)] = {"value": v}
        else:
            desc[str(k)] = {"type": type(v).__name__}
    save_file(blobs, str(path))
    return {"file": str(path), "outputs": desc}


def load_outputs(desc: dict) -> Any:
    """The outputs :func:`save_outputs` described (tensors with their sizes, strides and storage
    offset; :class:`Opaque` stand-ins where only a type name came back)."""
    from safetensors.torch import load_file

    if "type" in desc:
        return opaque(desc["type"])
    blobs = load_file(desc["file"])
    out: dict[str, Any] = {}
    for k, d in desc["outputs"].items():
        if "blob" in d:
            out[k] = torch.empty(0, dtype=_dtype(d["dtype"])).set_(
                blobs[d["blob"]].untyped_storage(), d["offset"], d["size"], d["stride"])
        elif "value" in d:
            out[k] = d["value"]
        else:
            out[k] = opaque(d["type"])
    return out


# ----------------------------------------------------------------------------- the child's side


def _same_file(a: str | None, b: str | None) -> bool:
    try:
        return os.path.samefile(a, b) if a and b else True
    except OSError:
        return False


def call_in_child(entry: Any, cases: list[Case], device: str, *, stage: str, out_dir: str,
                  call_device: str | None = None, module: str | None = None,
                  module_file: str | None = None) -> list[dict]:
    """The judge the kernel child runs (``runner.child``'s signature plus the job's options):
    calls ``entry`` -- a plain callable (as the public API calls one) or an entry-like object
    (``entry.call``) -- on each case moved to ``call_device`` (None: as loaded, on the CPU),
    brings the outputs to the CPU and writes them into ``out_dir`` (:func:`save_outputs`). One
    dict per case, verdict ``ran`` with ``outputs``, ``raised`` (type name, message, traceback)
    or ``unsupported``; verdict ``error`` (rule ``import``) if the child imported another file of
    the kernel's module than the parent. A fatal signal dumps the Python stack to stderr
    (``faulthandler``), which the parent reports with the crash."""
    import faulthandler

    faulthandler.enable()  # a fatal signal prints the kernel's Python stack to the child's stderr (its tail is reported)
    got_file = getattr(sys.modules.get(module or ""), "__file__", None)
    out = []
    for case in cases:
        if module and not _same_file(got_file, module_file):
            out.append({"case": case.name, "verdict": "error", "rule": "import",
                        "message": f"the child imported module {module!r} from {got_file}, not from {module_file} "
                                   "(another module of that name comes first on its import path)"})
            continue
        r: dict[str, Any] = {"case": case.name, "verdict": "ran"}
        try:
            dcase = case.to(call_device) if call_device is not None else case
            got = entry.call(dcase) if is_entry_like(entry) else call_callable(entry, dcase)
            got = to_cpu(got)  # the device-to-host copy waits for the kernel
        except UnsupportedCase as e:
            r["unsupported"] = str(e)
        except Exception as e:  # noqa: BLE001 - the kernel's failure is the result
            r["raised"] = {"type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc(limit=8)}
        else:
            safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", case.name)[:80]
            r["outputs"] = save_outputs(got, Path(out_dir) / f"{len(os.listdir(out_dir))}-{safe}.safetensors")
        out.append(r)
    return out


# ----------------------------------------------------------------------------- the parent's side


class KernelRaised(Exception):
    """An exception the kernel raised in the child, raised again here under its type's name."""


class KernelCrashed(Exception):
    """The child died, hung or faulted on this case (``rule``, ``message``, ``stderr``)."""

    def __init__(self, rule: str, message: str, stderr: str = ""):
        super().__init__(message)
        self.rule, self.message, self.stderr = rule, message, stderr


def _import_path(target: Target) -> list[str]:
    """The child's ``PYTHONPATH`` additions: the kernel module's root, then this process's import
    path except the interpreter's own folders (the child has those)."""
    roots: list[str] = []
    if target.module and target.module_file:
        p = Path(target.module_file).resolve().parent
        depth = target.module.count(".") + (1 if Path(target.module_file).name == "__init__.py" else 0)
        roots.append(str(p.parents[depth - 1] if depth else p))
    own = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    with_site = set(own)
    try:
        with_site |= {os.path.realpath(p) for p in [*site.getsitepackages(), site.getusersitepackages()]}
    except AttributeError:  # a virtualenv's old site module
        pass
    for p in sys.path:
        if not isinstance(p, str):
            continue
        rp = os.path.realpath(p or os.curdir)
        if os.path.exists(rp) and not any(rp == o or rp.startswith(o + os.sep) for o in with_site):
            roots.append(rp)
    return list(dict.fromkeys(roots))


@dataclass
class ChildCalls:
    """The kernel's calls on a case list, made in crash-isolated children (module docstring):
    the first :meth:`produce` runs every case the entry supports, one child after another,
    and later calls take their outcome."""

    target: Target
    entry: JudgedEntry
    cases: list[Case]
    stage: str
    device: Any
    timeout_s: float | None
    default_cases: bool  # the list is the stage's default cases: the shared case file serves
    outcomes: dict[str, dict] | None = None
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="dsv4-isolated-"))

    def _supported(self, case: Case) -> bool:
        try:
            return not self.entry.supports(case)
        except Exception:  # noqa: BLE001 - the runner calls supports again and reports it
            return True

    def run(self) -> dict[str, dict]:
        from dsv4_numerics.runner.case_files import CASES_SUFFIX, save_cases, stage_cases_file
        from dsv4_numerics.runner.pool import run_isolated

        names = [c.name for c in self.cases if self._supported(c)]
        if self.default_cases:
            cases_file = stage_cases_file(self.stage, "default")
        else:
            cases_file = str(Path(self.workdir) / f"cases{CASES_SUFFIX}")
            save_cases(self.cases, cases_file)
        out_dir = Path(self.workdir) / "outputs"
        out_dir.mkdir()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(_import_path(self.target) + [p for p in env.get("PYTHONPATH", "").split(
            os.pathsep) if p])
        options = {"stage": self.stage, "out_dir": str(out_dir),
                   "call_device": None if self.device is None else str(self.device),
                   "module": self.target.module, "module_file": self.target.module_file}
        self.outcomes = run_isolated(self.target.spec, names, device="cpu" if self.device is None else str(self.device),
                                     cases_file=cases_file, judge=CHILD_JUDGE, judge_options=options,
                                     case_timeout_s=self.timeout_s, max_restarts=len(names),
                                     workdir=str(Path(self.workdir) / "child"), env=env)
        return self.outcomes

    def produce(self, case: Case) -> Any:
        """The kernel's outputs on ``case`` (as ``JudgedEntry.produce``): loaded from the child,
        or the kernel's exception raised again, or :class:`KernelCrashed`."""
        if self.outcomes is None:
            self.run()
        r = self.outcomes.get(case.name)
        if r is None:  # not among the cases run (a supports() that changed its mind): run it alone
            r = replace(self, cases=[case], default_cases=False, outcomes=None,
                        workdir=tempfile.mkdtemp(prefix="dsv4-isolated-", dir=self.workdir)).run()[case.name]
            self.outcomes[case.name] = r
        if r.get("verdict") != "ran":
            msg = str(r.get("message", ""))
            head, _, tail = msg.partition(STDERR_MARK)
            raise KernelCrashed(str(r.get("rule") or "crash"), head.strip(), tail.strip())
        if "unsupported" in r:
            raise UnsupportedCase(r["unsupported"])
        if "raised" in r:
            e = r["raised"]
            raise type(str(e["type"]), (KernelRaised,), {})(e["message"])
        return load_outputs(r["outputs"])

    def mark(self, results: list) -> list:
        """Results whose call failed in the child: rule and message of the crash, hang or fault
        (``details["stderr"]``: the child's stderr tail), or the kernel's own traceback for an
        exception; ``duration_s`` of every case the child ran is the child's time for the call."""
        for res in results:
            r = (self.outcomes or {}).get(res.case)
            if r is None:
                continue
            if r.get("seconds") is not None:
                res.duration_s = float(r["seconds"])
            if res.verdict != "error" or res.rule != "call":
                continue
            if r.get("verdict") != "ran":
                head, _, tail = str(r.get("message", "")).partition(STDERR_MARK)
                res.rule = str(r.get("rule") or "crash")
                res.message = head.strip()
                res.details = {"stderr": tail.strip()} if tail.strip() else {}
            elif "raised" in r:
                res.details = {"traceback": r["raised"].get("traceback", "")}
        return results

    def close(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)


@contextmanager
def isolated(entry: JudgedEntry, target: Target, cases: list[Case], *, device: Any, timeout_s: float | None,
             default_cases: bool) -> Iterator[tuple[JudgedEntry, ChildCalls]]:
    """``entry`` with its calls made in crash-isolated children (:class:`ChildCalls`), and the
    calls (``mark`` the Results judged from them); the children's files are removed after."""
    calls = ChildCalls(target, entry, list(cases), entry.stage, device, timeout_s, default_cases)
    try:
        yield replace(entry, produce=calls.produce, memo={}), calls
    finally:
        calls.close()


def check_timeout(fn_name: str, timeout_s: Any) -> float | None:
    """``timeout_s`` validated: None or a positive finite number of seconds."""
    if timeout_s is None:
        return None
    ok = isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and 0 < float(timeout_s) < float("inf")
    if not ok:
        raise InputError(f"{fn_name}: argument 'timeout_s' must be a positive number of seconds (how long one case "
                         f"may run in the isolated child) or None, got {timeout_s!r}")
    return float(timeout_s)


__all__ = ["CHILD_JUDGE", "ChildCalls", "KernelCrashed", "KernelRaised", "Opaque", "RULE", "Target",
           "call_in_child", "check_timeout", "default", "isolated", "load_outputs", "opaque", "resolve",
           "save_outputs", "set_default", "target_of"]
