"""The kernel child: the job protocol and the serving loop of a crash-isolated kernel run.

The parent side (:mod:`dsv4_numerics.runner.pool`) never calls a production kernel in its own
process: it starts this module as a child (``python -m dsv4_numerics.runner.child --serve``) and
watches the job's event log. This module is what runs in that child.

A job runs an entry's cases one at a time and appends one JSON line per event to the job's LOG
(``out``), flushed and ``fsync``-ed before and after each case: ``cases`` (the case names), then
per case ``start`` (with the child's ``pid``) and ``result`` (with ``seconds``), then ``done``.
A setup failure (unknown entry, unreadable cases, bad judge) is one ``setup_error`` event;
with ``probe``, a failed availability probe is one ``unavailable`` event and nothing runs.

The child checks the device after every case (``torch.cuda.synchronize``): an asynchronous
fault is attributed to the case that caused it (``result`` with rule ``device_fault``, then
``poisoned``), and the child exits with status 3, so the next case starts in a fresh one.

Protocol of a serving child (``--serve``): one JSON object per line on stdin, a job --
``{"entry", "out", "device", "start", "cases", "mode", "judge", "judge_options", "probe", "names"}``
(:func:`run_job`'s arguments; ``entry`` and ``out`` required) -- run one after the other; its events go to the job's
``out`` file, never to stdout. Before the first job the child warms up (torch, the device context,
the staged kernels, the judge's modules). Between jobs it collects garbage and empties the CUDA
caching allocator. End of stdin: exit 0. A ``setup_error`` is that job's: the child serves the
next one. A device fault ends the child (exit 3). A malformed line: exit 2 with the reason on
stderr. The one-shot form ``python -m dsv4_numerics.runner.child ENTRY --out LOG [--device
--start --cases --mode --judge]`` runs one job and exits 0 / 2 / 3.

Two modes:

* ``judge`` (default): ``oracles.matrix.run_entry(entry, cases=[case], device=...)`` per case
  (or the ``judge`` given as ``module:function`` with its signature, called with the job's
  ``judge_options`` as keyword arguments too); each JSON result is that ``Result`` made
  JSON-ready (:func:`jsonable`);
* ``raw``: ``entry.call(case.to(device))`` per case; the outputs (CPU tensors, plain values) are
  written to ``LOG.<index>.safetensors`` (:func:`dsv4_numerics.runner.case_files.write_outputs`;
  read back with ``load_outputs``, nothing unpickled) and the JSON result says ``verdict: "ran"``. Used to record
  kernel fixtures and by GPU fuzz tests that compare outputs in their own process.

``ENTRY`` is a registry name or ``module:qualname`` naming an entry-like object or a callable
(tests use this for fake entries that abort or hang; ``dsv4_numerics.api.isolation`` for a user's
kernel). ``--cases FILE`` loads a case file (safetensors and JSON,
:func:`dsv4_numerics.runner.case_files.save_cases`) of ``reference.cases.Case`` (:func:`dsv4_numerics.runner.case_files.stage_cases_file` builds them once for
all children) instead of building the stage's default cases.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time
import traceback
from typing import Any

from dsv4_numerics.runner import timeline
from dsv4_numerics.runner.case_files import load_cases, selected_case_size, write_outputs

# the most characters of a traceback (here) or of a child's stderr (the parent) carried in a result
STDERR_TAIL = 2000


# ----------------------------------------------------------------------------- JSON helpers

def jsonable(obj: Any) -> Any:
    """JSON-ready copy of a result (``oracles.report.jsonable``: ``to_dict``, enums, non-finite
    floats as strings, small tensors as lists)."""
    from dsv4_numerics.oracles.report import jsonable as _jsonable

    return _jsonable(obj)


def _write(log, event: dict) -> None:
    event.setdefault("t", round(time.time(), 3))
    log.write(json.dumps(event) + "\n")
    log.flush()
    os.fsync(log.fileno())


def resolve_entry(spec: str):
    """A registry name, or ``package.module:attribute`` for an entry-like object or a callable;
    an attribute the module does not have whole (``external``'s module ``__getattr__`` takes a
    dotted entry name whole) is looked up as a dotted qualname (``module:Class.attribute``)."""
    if ":" in spec:
        mod, _, qualname = spec.partition(":")
        obj = importlib.import_module(mod)
        try:
            return getattr(obj, qualname)
        except AttributeError:
            if "." not in qualname:
                raise
        for attr in qualname.split("."):
            obj = getattr(obj, attr)
        return obj
    from dsv4_numerics.kernels import registry

    return registry.get(spec)


def _load_cases(entry, cases_file: str | None):
    if cases_file:
        return load_cases(cases_file)
    from dsv4_numerics.reference.cases import stage_cases

    return stage_cases(entry.stage, selected_case_size())


# ----------------------------------------------------------------------------- timeline rows
# Under DSV4_TIMELINE=DIR (the suite's timeline, dsv4_numerics/runner/timeline.py) a serving child appends
# one row per warm-up, job and case to DIR/children/<pid>.tsv (``timeline.row_line``: phase
# ``warmup`` | ``job`` | ``case``, what ``-`` | the entry | ``entry::case``, no children's CPU: a
# child waits for none of its own), so the run's breakdown shows what the kernel children did:
# start-up, first-use costs per entry, idle time.


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


@contextlib.contextmanager
def _timeline_row(phase: str, what: str = "-"):
    folder = os.environ.get(timeline.ENV)
    if not folder:
        yield
        return
    t0, c0 = time.time(), _cpu_s()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.makedirs(os.path.join(folder, "children"), exist_ok=True)
            with open(os.path.join(folder, "children", f"{os.getpid()}.tsv"), "a", encoding="utf-8") as f:
                f.write(timeline.row_line(t0, time.time(), phase, what, c0, _cpu_s()))


def _device_fault(device: str) -> str | None:
    """Synchronise the device; the error text if an asynchronous fault surfaced."""
    if not device.startswith("cuda"):
        return None
    import torch

    try:
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def _judge_one(judge, entry, case, device: str, options: dict | None = None) -> list:
    results = judge(entry, cases=[case], device=device, **(options or {}))
    return [jsonable(r) for r in results]


def _raw_one(entry, case, device: str, out_prefix: str, index: int) -> dict:
    import torch

    moved = case.to(device) if device != "cpu" else case
    outputs = entry.call(moved)
    fault = _device_fault(device)
    if fault:
        raise RuntimeError(f"device fault after the call: {fault}")
    cpu = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in outputs.items()}
    path = f"{out_prefix}.{index}.safetensors"
    write_outputs(path, cpu)
    return {"case": case.name, "verdict": "ran", "outputs_file": path,
            "outputs": {k: jsonable(v) if not isinstance(v, torch.Tensor)
                        else {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")}
                        for k, v in cpu.items()}}


DEFAULT_JUDGE = "dsv4_numerics.oracles.matrix:run_entry"
# exit codes of a job (one-shot CLI) and of a serving child
EXIT_OK, EXIT_SETUP_ERROR, EXIT_POISONED = 0, 2, 3


def _probe_reason(ent) -> str:
    """The entry's availability probe here, as a reason ('' = can run): ``available()`` of a
    registry entry, ``probe()`` of an entry-like object; a probe that raises is a reason too."""
    try:
        if hasattr(ent, "available"):
            ok, reason = ent.available()
            return "" if ok else str(reason or "unavailable")
        if hasattr(ent, "probe"):
            return str(ent.probe() or "")
    except Exception as e:  # noqa: BLE001 - reported, as the parent's probe would
        return f"probe raised {type(e).__name__}: {e}"
    return ""


def run_job(entry: str, out: str, *, device: str = "cuda:0", start: int = 0, cases: str | None = None,
            mode: str = "judge", judge: str | None = None, probe: bool = False,
            names: list[str] | None = None, judge_options: dict | None = None) -> int:
    """Run one job in this process: ``entry``'s cases from index ``start``, one JSON line per event
    appended to ``out`` (``setup_error`` | ``cases``, then ``start`` / ``result`` per case, then
    ``done``, or ``poisoned`` after a device fault). ``probe``: first run the entry's availability
    probe here; when it fails, write ``unavailable`` (with the reason) and run nothing -- so a
    caller may hand entries over unprobed (``check``). ``names``: run only these cases of the
    case list, in this order (``start`` then indexes this list). ``judge_options``: keyword
    arguments the judge gets besides ``cases`` and ``device`` (JSON values). Returns :data:`EXIT_OK`,
    :data:`EXIT_SETUP_ERROR` or :data:`EXIT_POISONED` (this process must not run another case)."""
    if mode not in ("judge", "raw"):
        raise ValueError(f"mode must be 'judge' or 'raw', got {mode!r}")
    with open(out, "a", encoding="utf-8") as log:
        try:
            ent = resolve_entry(entry)
            if probe:
                reason = _probe_reason(ent)
                if reason:
                    _write(log, {"event": "unavailable", "reason": reason})
                    return EXIT_OK
            case_list = _load_cases(ent, cases)
            if names is not None:
                by_name = {c.name: c for c in case_list}
                case_list = [by_name[n] for n in names if n in by_name]
            judge_fn = None
            if mode == "judge":
                mod, _, fn = (judge or DEFAULT_JUDGE).partition(":")
                judge_fn = getattr(importlib.import_module(mod), fn)
        except Exception as e:  # noqa: BLE001 - setup failure: every case is an error
            _write(log, {"event": "setup_error", "message": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-STDERR_TAIL:]})
            return EXIT_SETUP_ERROR
        _write(log, {"event": "cases", "names": [c.name for c in case_list]})
        for i in range(start, len(case_list)):
            case = case_list[i]
            _write(log, {"event": "start", "index": i, "case": case.name, "pid": os.getpid()})
            t0 = time.perf_counter()
            try:
                with _timeline_row("case", f"{entry}::{case.name}"):
                    if judge_fn is not None:
                        res = _judge_one(judge_fn, ent, case, device, judge_options)
                    else:
                        res = [_raw_one(ent, case, device, out, i)]
                event = {"event": "result", "index": i, "case": case.name, "results": res}
            except Exception as e:  # noqa: BLE001 - the judge should catch; this is a backstop
                event = {"event": "result", "index": i, "case": case.name,
                         "results": [{"case": case.name, "verdict": "error", "rule": "exception",
                                      "message": f"{type(e).__name__}: {e}",
                                      "traceback": traceback.format_exc()[-STDERR_TAIL:]}]}
            event["seconds"] = round(time.perf_counter() - t0, 4)
            fault = _device_fault(device)
            if fault:
                for r in event["results"]:
                    if isinstance(r, dict):
                        r["verdict"] = "error"
                        r["rule"] = "device_fault"
                        r["message"] = f"device fault after this case: {fault}"
                _write(log, event)
                _write(log, {"event": "poisoned", "index": i, "message": fault})
                return EXIT_POISONED
            _write(log, event)
        _write(log, {"event": "done"})
    return EXIT_OK


_JOB_KEYS = {"entry", "out", "device", "start", "cases", "mode", "judge", "judge_options", "probe", "names"}


def _between_jobs() -> None:
    """Drop what the last job left reachable only through garbage, and the CUDA caching
    allocator's free blocks (so the next entry does not inherit a full cache)."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()


# Set to "cpu" by a parent whose child will only run CPU jobs: the warm-up then creates no CUDA
# context (half a second to a second of start-up and device memory per child on a GPU host).
CHILD_DEVICE_ENV = "DSV4_WORKER_DEVICE"


def _warm_up() -> None:
    """What every job needs first, done before the first job arrives: torch, the device context
    (when a GPU is visible, unless ``DSV4_WORKER_DEVICE=cpu``), the staged kernels' activation and
    the judge's modules. Failures are left to the job, which reports them as its setup error."""
    with contextlib.suppress(Exception):
        import torch

        from dsv4_numerics.kernels import registry, staged  # noqa: F401
        from dsv4_numerics.oracles import matrix  # noqa: F401

        staged.activate()
        if torch.cuda.is_available() and os.environ.get(CHILD_DEVICE_ENV) != "cpu":
            torch.zeros(1, device="cuda")


def serve(jobs) -> int:
    """Serve jobs from the text stream ``jobs``: one JSON object per line (:func:`run_job`'s
    arguments: ``entry`` and ``out`` required; ``device``, ``start``, ``cases``, ``mode``,
    ``judge`` optional), run one after the other. End of stream: return 0. A job that ends
    poisoned ends the process (return 3): a device fault leaves the context unusable. A setup
    error is that job's and the process serves the next one. A malformed line: message on
    stderr, return 2."""
    with _timeline_row("warmup"):
        _warm_up()
    while True:
        line = jobs.readline()
        if not line:
            return EXIT_OK
        if not line.strip():
            continue
        try:
            job = json.loads(line)
            if not isinstance(job, dict) or not {"entry", "out"} <= set(job) or set(job) - _JOB_KEYS:
                raise ValueError(f"a job is an object with keys entry, out and optionally "
                                 f"{sorted(_JOB_KEYS - {'entry', 'out'})}")
        except ValueError as e:
            print(f"worker_child --serve: bad job line {line.strip()[:200]!r}: {e}", file=sys.stderr, flush=True)
            return EXIT_SETUP_ERROR
        with _timeline_row("job", str(job["entry"])):
            rc = run_job(**job)
        if rc == EXIT_POISONED:
            return rc
        _between_jobs()


def worker_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4_numerics.runner.child")
    ap.add_argument("entry", nargs="?", help="registry name or module:attribute (one-shot mode)")
    ap.add_argument("--serve", action="store_true",
                    help="read one JSON job per line on stdin and run them one after the other")
    ap.add_argument("--out", help="JSON-lines event log (appended; one-shot mode)")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--start", type=int, default=0, help="index of the first case to run")
    ap.add_argument("--cases", default=None, help="case file (case_files.save_cases; default: the stage's cases)")
    ap.add_argument("--mode", choices=("judge", "raw"), default="judge")
    ap.add_argument("--judge", default=DEFAULT_JUDGE,
                    help="module:function with run_entry's signature (judge mode)")
    args = ap.parse_args(argv)
    if args.serve:
        if args.entry is not None or args.out is not None:
            ap.error("--serve takes its jobs on stdin, not ENTRY / --out")
        # the jobs come on a private copy of stdin; fd 0 becomes /dev/null so a kernel that
        # reads stdin cannot swallow the next job
        jobs = os.fdopen(os.dup(0), "r", encoding="utf-8")
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        with jobs:
            rc = serve(jobs)
        from dsv4_numerics.runner.cuda_context import exit_now, fast_exit_enabled

        if fast_exit_enabled():  # every result is written (fsync'd per event): skip the shutdown
            exit_now(rc)
        return rc
    if args.entry is None or args.out is None:
        ap.error("ENTRY and --out are required (or --serve)")
    return run_job(args.entry, args.out, device=args.device, start=args.start, cases=args.cases,
                   mode=args.mode, judge=args.judge)


main = worker_main

if __name__ == "__main__":
    sys.exit(main())
