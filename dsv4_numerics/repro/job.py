"""Make one reproducer folder: judge, shrink, write, run (``dsv4_numerics.repro`` docstring).

``make(kernel, stage, case=None, out=..., contract=None, force=False)`` ->
:class:`Reproducer`. ``kernel``: a registry ``KernelEntry`` (its adapter's ``OP_CALLS`` give the
op call, ``kernels.op_call``) or a plain callable ``fn(inputs) -> dict`` importable by its dotted
path (the script imports it and calls it on the saved canonical inputs).
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from dsv4_numerics.api.callable_entry import is_entry_like
from dsv4_numerics.kernels.op_call import OpCall, op_call_for, python_loader
from dsv4_numerics.oracles import stages as st
from dsv4_numerics.oracles.matrix import device_arch
from dsv4_numerics.reference.cases import Case, default_cases, stage_cases
from dsv4_numerics.reference.constants import DATA_ROW_BYTES, NOPE_DIM, RECORD_BYTES, TILE
from dsv4_numerics.reference.errors import InputError

from . import issue, shrink as sh
from .judge import Signature, contract_policies, declared_policies, expected_outputs, judge_case
from .write import MAX_INPUT_BYTES, write_files

RUN_TIMEOUT_S = 600
# the 584-byte record layout a script decodes bytes with (reference.constants)
LAYOUT = {"data_row_bytes": DATA_ROW_BYTES, "record_bytes": RECORD_BYTES, "nope_dim": NOPE_DIM, "tile": TILE}


class NothingToReproduce(InputError):
    """The case passes (or is skipped) under the judged policies: there is no divergence to write."""


class Unavailable(InputError):
    """The kernel cannot run here (its probe's reason)."""


@dataclass
class Reproducer:
    """What was written: the folder, the sizes before and after shrinking, the script's length, the
    saved input bytes, and the script's exit status and output when it was run here."""

    out: Path
    entry: str
    case: str
    rule: str
    size_before: dict
    size_after: dict
    steps: list[str]
    lines: int
    input_bytes: int
    file_bytes: int
    exit_status: int | None
    output: str
    policies: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        ran = "not run here" if self.exit_status is None else f"exits {self.exit_status}"
        return (f"{self.entry} [{self.case}] {self.rule}: {self.out}\n"
                f"  before: {sh.size_line(self.size_before)}\n  after:  {sh.size_line(self.size_after)}\n"
                f"  repro.py {self.lines} lines, inputs {self.input_bytes} bytes "
                f"(inputs.safetensors {self.file_bytes} bytes); {ran}")

    def to_dict(self) -> dict:
        return {"out": str(self.out), "entry": self.entry, "case": self.case, "rule": self.rule,
                "size_before": self.size_before, "size_after": self.size_after, "steps": self.steps,
                "lines": self.lines, "input_bytes": self.input_bytes, "file_bytes": self.file_bytes,
                "exit_status": self.exit_status, "output": self.output, "policies": self.policies}


# --------------------------------------------------------------------------- inputs


def check_out(out: Any, force: bool) -> Path:
    """``out`` as a Path; ``InputError`` when it is missing, or exists and ``force`` is false."""
    if out is None:
        raise InputError("repro: argument 'out' is required (the folder to write the reproducer into)")
    path = Path(out)
    if path.exists() and not force:
        raise InputError(f"repro: argument 'out': {path} already exists (pass --force / force=True to replace it)")
    return path


def prepare_out(out: Any, force: bool) -> Path:
    """``check_out``, then the existing folder (or file) removed."""
    path = check_out(out, force)
    if path.exists():
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return path


def find_case(stage: str, name: str) -> Case:
    for size in ("default", "full"):
        for c in stage_cases(stage, size):
            if c.name == name:
                return c
    import difflib

    known = [c.name for c in default_cases(stage)]
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.4)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(known)}"
    raise InputError(f"repro: argument 'case': stage {stage!r} has no case {name!r}{hint}")


def dotted_path(fn: Callable) -> tuple[str, str]:
    """``(module, qualname)`` of a callable importable by that path; ``InputError`` otherwise."""
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not mod or mod == "__main__" or "<" in qual:
        raise InputError(f"repro: argument 'kernel' must be importable by a dotted path (a module-level function "
                         f"of an importable module); {fn!r} is {mod or '?'}.{qual or '?'}")
    obj = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part, None)
    if obj is not fn:
        raise InputError(f"repro: argument 'kernel': {mod}.{qual} does not import back to the same function")
    return mod, qual


def _module_root(mod: str) -> str:
    m = importlib.import_module(mod)
    f = Path(getattr(m, "__file__", "") or "").resolve()
    root = f.parent
    for _ in mod.split(".")[1:]:
        root = root.parent
    if f.name == "__init__.py":
        root = root.parent
    return str(root)


def user_op_call(fn: Callable, stage: str, case: Case) -> OpCall:
    """The op boundary of a plain callable: it is called on the canonical inputs (a dict) and
    returns the canonical outputs by name."""
    mod, qual = dotted_path(fn)
    spec = st.get(stage)
    inputs = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.inputs.items()}
    kind = {"bytes": "bytes", "index": "exact"}.get(spec.kind, "numeric")
    outs = tuple(spec.outputs)
    return OpCall(op=f"{mod}.{qual}", fn=fn, loader=python_loader("", mod, qual), args=[inputs],
                  outputs={o: ("return", o) for o in outs}, finish=lambda ret: ret,
                  to_op=lambda exp: {o: exp[o] for o in outs if o in exp},
                  compare={o: kind for o in outs},
                  decode={o: "model1_584" for o in outs if o == "cache" and stage in ("swa_write", "compressed_write")},
                  meta={"block_size": case.inputs.get("block_size")}, masks=_canonical_masks(stage))


def _canonical_masks(stage: str) -> Callable | None:
    if stage not in ("swa_write", "compressed_write"):
        return None

    def masks(exp: dict, c: Case) -> dict:
        from dsv4_numerics.reference.caches import model1

        inp = c.inputs
        slots = inp.get("slot_mapping")
        if slots is None or "cache" not in exp:
            return {}
        return {"cache": model1.defined_byte_mask(exp["cache"], slots[: inp["k"].shape[0]] if "k" in inp else slots,
                                                  int(inp["block_size"]))}

    return masks


def _checks(call: OpCall, result: Any) -> dict:
    checks = {}
    for label, kind in call.compare.items():
        c: dict[str, Any] = {"kind": kind}
        if kind == "numeric":
            rep = result.details.get(label) or result.details.get("out") or {}
            c.update(atol=float(rep.get("atol", 0.0)), rtol=float(rep.get("rtol", 0.0)),
                     cos_tol=float(rep.get("cos_tol", 0.0)))
            tol = rep.get("tolerance") or {}
            if tol.get("line"):
                c["record"] = str(tol["line"])
            if call.meta.get("sources"):
                c.update(sources=list(call.meta["sources"]), **LAYOUT)
        if call.decode.get(label) == "model1_584":
            c.update(layout="model1_584", block_size=int(call.meta.get("block_size") or 1), **LAYOUT)
        checks[label] = c
    return checks


def _differing(r: Any) -> tuple[int, str]:
    d = r.details or {}
    if "differing" in d:
        return int(d["differing"]), "bytes"
    n = sum(int(v.get("mismatch_count", 0)) for v in d.values() if isinstance(v, dict) and "mismatch_count" in v)
    return n, "elements"


def run_script(out: Path, args: list[str], timeout: float = RUN_TIMEOUT_S) -> tuple[int, str]:
    """Run ``out/repro.py`` with ``args`` in a fresh interpreter (``-I``: no user site, no
    PYTHONPATH); ``(exit status, stdout + stderr)``."""
    p = subprocess.run([sys.executable, "-I", str(out / "repro.py"), *args], capture_output=True, text=True,
                       timeout=timeout, cwd=str(out))
    return p.returncode, (p.stdout + p.stderr)


def library_args(call: OpCall) -> list[str]:
    """The script arguments that find the op here: the library file the adapter loaded (a staged
    folder) or the folder its Python module was imported from."""
    loader = call.loader
    if loader["kind"] == "torch_library":
        from dsv4_numerics.kernels import staged

        dist = loader.get("dist")  # the newest staged release's library, as the adapter loads it
        found = staged.staged_file(loader["file"], dist if dist in staged.RELEASE_KEYS else None)
        return ["--library", str(found[0])] if found else []
    if loader["module"] not in sys.modules:
        return []
    root = Path(_module_root(loader["module"]))
    out = ["--path", str(root)]
    if (root / "site").is_dir():  # a staged folder's packages (dsv4-numerics stage-vllm --site-wheels)
        out += ["--path", str(root / "site")]
    return out


# --------------------------------------------------------------------------- the job


def make(kernel: Any, stage: str, case: Case | str | None = None, out: Any = None, contract: str | None = None,
         force: bool = False, device: str | None = None, run: bool = True, impact: bool = True,
         policies: dict | None = None, log: Callable[[str], None] = lambda s: None, releases: str = "") -> Reproducer:
    """Write the reproducer of ``kernel``'s failure on ``case`` (default: its first failing
    default case) into ``out`` (module docstring); ``contract``: ``None`` (the declared policies),
    ``"all"`` or ``"KEY[=VALUE],..."`` (``judge.contract_policies``); ``policies``: declared on
    top of the entry's own (as ``judge(..., policies=)``); ``releases``: the finding's history across
    the releases judged, written into ISSUE.md as its "Releases" section ("" leaves it out)."""
    if not isinstance(stage, str) or stage not in st.STAGES:
        raise InputError(f"repro: unknown stage {stage!r}; known stages: {sorted(st.STAGES)}")
    check_out(out, force)
    entry_like = is_entry_like(kernel)
    name = getattr(kernel, "name", None) if entry_like else None
    if entry_like:
        ok, reason = kernel.available()
        if not ok:
            raise Unavailable(f"repro: {name} cannot run here: {reason}")
        make_call = op_call_for(name)
        if make_call is None:
            raise InputError(f"repro: {name}'s adapter exposes no op call (OP_CALLS in its module): its op cannot "
                             "be called standalone yet")
    elif callable(kernel):
        dotted_path(kernel)
        make_call = lambda c: user_op_call(kernel, stage, c)  # noqa: E731
        name = f"{kernel.__module__}.{kernel.__qualname__}"
    else:
        raise InputError(f"repro: argument 'kernel' must be a KernelEntry or a callable (got {type(kernel).__name__})")
    declared = {**(declared_policies(kernel) if entry_like else {}),
                **{k: (v.value if hasattr(v, "value") else str(v)) for k, v in (policies or {}).items()}}
    judged = contract_policies(declared, stage, contract) if contract else dict(declared)
    under = "its stage's contract" if contract else "its declared policies"

    def judge(c: Case, pol: dict) -> Any:
        return judge_case(kernel, stage, c, pol, device)

    if isinstance(case, str):
        case = find_case(stage, case)
    if case is None:
        found = None
        for c in default_cases(stage):
            r = judge(c, judged)
            log(f"  {r.line()[:160]}")
            if r.verdict == "fail":
                found = (c, r)
                break
        if found is None:
            raise NothingToReproduce(f"repro: {name} passes every default case of {stage!r} under {under} "
                                     f"({issue.policies_text(judged)}): nothing to reproduce")
        case, first = found
    else:
        if not isinstance(case, Case) or case.stage != stage:
            raise InputError(f"repro: argument 'case' must be a case name or a Case of stage {stage!r}")
        first = judge(case, judged)
    if first.verdict != "fail":
        what = {"pass": "passes", "skip": "is skipped", "error": "errors"}[first.verdict]
        raise NothingToReproduce(f"repro: {name} {what} on case {case.name!r} under {under} "
                                 f"({issue.policies_text(judged)}){': ' + first.message if first.message else ''}: "
                                 "nothing to reproduce")
    sig = Signature.of(first)
    log(f"failing: {first.line()[:200]}")

    def still_fails(c: Case) -> bool:
        if Signature.of(judge(c, judged)) != sig:
            return False
        return not contract or judge(c, declared).verdict == "pass"

    before = sh.size(case)
    small, steps = sh.shrink(still_fails, case)
    final = judge(small, judged)
    after = sh.size(small)
    for s in steps:
        log(f"  shrink {s}")
    dcase = small.to(device) if device else small
    call = make_call(dcase)
    exp = expected_outputs(stage, small, judged)
    op_exp = {k: v.cpu() for k, v in call.to_op(exp).items()}
    for label, t in op_exp.items():  # bit for bit on values that are not bytes: compared as values
        if call.compare.get(label) == "bytes" and t.dtype != torch.uint8:
            call.compare[label] = "exact"
    masks = call.masks(exp, small) if call.masks else {}
    dev = device_kind(call)
    path = prepare_out(out, force)
    written = write_files(path, call, op_exp, masks, _checks(call, final), dev)
    if written["input_bytes"] > MAX_INPUT_BYTES:
        log(f"warning: the reduced inputs hold {written['input_bytes']} bytes (more than {MAX_INPUT_BYTES})")
    args = library_args(call)
    status, output = run_script(path, args) if run else (None, "")
    counts: list[tuple[str, str, int]] = []
    total = 0
    unit = "elements"
    if impact:
        for c in default_cases(stage):
            r = judge(c, judged)
            if r.verdict == "fail":
                n, unit = _differing(r)
                counts.append((c.name, r.rule, n))
                total += n
    version = kernel.version() if entry_like and callable(getattr(kernel, "version", None)) else ""
    arch = (kernel.run_arch() if entry_like and callable(getattr(kernel, "run_arch", None)) else None) \
        or device_arch(device)
    cmd = " ".join(["python", "repro.py", *(["--library", "/path/to/" + call.loader["file"]]
                                            if call.loader["kind"] == "torch_library" else
                                            ["--path", "/path/to/the/package/root"] if not call.loader["dist"] else [])])
    info = {
        "op": call.op, "title": _title(first, judged, declared), "source": getattr(kernel, "source", call.op),
        "version": version or "", "arch": arch, "stage": stage, "case": case.name,
        "size_before": before, "size_after": after, "departures": issue.departures(declared, judged),
        "judged": judged, "notes": getattr(kernel, "notes", ""), "rule": final.rule, "message": final.message,
        "impact": counts, "impact_failed": len(counts), "impact_total": len(default_cases(stage)),
        "impact_count": total, "impact_unit": unit, "command": cmd, "lines": written["lines"],
        "input_bytes": written["input_bytes"], "dist": call.loader.get("dist", ""), "output": output,
        "releases": releases,
    }
    (path / "ISSUE.md").write_text(issue.render(info))
    rep = Reproducer(path, name, case.name, final.rule, before, after, steps, written["lines"],
                     written["input_bytes"], written["file_bytes"], status, output, judged)
    (path / "report.json").write_text(json.dumps(rep.to_dict(), indent=1, default=str) + "\n")
    return rep


def device_kind(call: OpCall) -> str:
    for a in list(call.args) + list(call.kwargs.values()):
        if isinstance(a, torch.Tensor):
            return "cuda" if a.device.type == "cuda" else "cpu"
    return "cpu"


def _title(r: Any, judged: dict, declared: dict) -> str:
    deps = issue.departures(declared, judged)
    if deps:
        return "; ".join(f"{k}={actual} where the contract is {k}={contract}" for k, contract, actual in deps)
    return f"fails the reference ({r.rule})"


__all__ = ["NothingToReproduce", "Reproducer", "Unavailable", "dotted_path", "find_case", "check_out", "make", "prepare_out",
           "run_script", "user_op_call"]
