"""The ``dsv4-numerics`` command line.

Commands::

    dsv4-numerics check [--json PATH] [--device DEV] [--entry ENTRY_OR_GLOB]... [--no-kernels] [--no-fixtures]
                        [--require ENTRY_OR_GLOB]... [--require-available]
                        [--entries-from FILE_OR_MODULE]... [--no-external] [--cases default|full]
                        [--case GLOB]... [--jobs N]
    dsv4-numerics kernels [--json] [--available] [--entries-from FILE_OR_MODULE]... [--no-external]
    dsv4-numerics fixtures list [--json]
    dsv4-numerics fixtures regen [NAME...] [--accept] [--device DEV] [--out-dir DIR]
    dsv4-numerics fixtures regen [CASE...] --record-kernel ENTRY [--accept] [--device DEV] [--out-dir DIR]
    dsv4-numerics fixtures verify [NAME...] [--device DEV]
    dsv4-numerics fixtures import DIR [NAME...] [--accept]
    dsv4-numerics inspect FILE [--key K] [--page-size BS] [--stride BYTES] [--layout model1] ...
    dsv4-numerics bench {cpu,oracle,gpu} [ARGS...]
    dsv4-numerics report merge REPORT... [--json OUT.json] [--html OUT.html] [--title TEXT]
    dsv4-numerics report diff BASE NEW [--ratio R] [--json OUT.json]

``--root DIR`` (before or after the subcommand) points the fixture commands at another fixture
root (a directory holding ``manifest.json`` and ``data/``); default: the installed package's.

Exit status: 0 success; 1 a check, verification or inspection found a problem, ``check`` judged
nothing or a required entry was not judged, ``fixtures verify`` had nothing to verify, or
regen/import refused to change pinned fixtures without ``--accept``; 2 a usage or input error (missing file,
corrupt fixture, bad stride, unknown kernel name...), reported as one line on stderr, never a
traceback (``DSV4_TRACEBACK=1`` shows one for internal errors).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import metadata
from pathlib import Path

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
PROG = "dsv4-numerics"


def _version() -> str:
    try:
        return metadata.version("dsv4-numerics")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class UsageError(Exception):
    """A command-line mistake; printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _err(msg: str) -> None:
    print(f"{PROG}: error: {msg}", file=sys.stderr)


def _progress(quiet: bool):
    if quiet:
        return lambda s: None

    def say(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    return say


def _add_root(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", default=argparse.SUPPRESS, metavar="DIR",
                   help="fixture root holding manifest.json and data/ (default: the installed package's)")


def _add_external(p: argparse.ArgumentParser) -> None:
    p.add_argument("--entries-from", action="append", default=[], metavar="FILE_OR_MODULE",
                   help="also take kernel entries from this .py file or module (its ENTRIES list or entries() "
                        "function; repeatable)")
    p.add_argument("--no-external", action="store_true",
                   help="ignore entries of installed packages (entry-point group dsv4_numerics.kernels)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="Reference-first numerics and correctness suite for DeepSeek-V4 sparse attention.")
    p.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    p.add_argument("--root", default=None, metavar="DIR", help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    c = sub.add_parser("check", help="run every available kernel entry and verify the committed fixtures (the main job)",
                       description="Run every kernel entry available here over the built-in cases, verify the committed "
                                   "fixtures (reference and kernel-recorded), print the matrix, exit non-zero on any failure.")
    c.add_argument("--json", metavar="PATH", help="write the report (schema dsv4-numerics/check/2) to PATH")
    c.add_argument("--device", default=None, help="device for kernels and the reference (default: cuda if available, else cpu)")
    c.add_argument("--entry", action="append", metavar="ENTRY_OR_GLOB",
                   help="only the kernel entries this name or glob matches, as --require (repeatable)")
    c.add_argument("--no-kernels", action="store_true", help="skip the kernel entries")
    c.add_argument("--no-fixtures", action="store_true", help="skip fixture verification")
    c.add_argument("--no-isolate", action="store_true", help="run GPU kernels in this process (no crash isolation)")
    c.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="crash-isolated kernel children run at once, spread over the visible GPUs "
                        "(default: 8 per GPU, at most one per two CPUs)")
    c.add_argument("--cases", choices=("default", "full"), default=None,
                   help="kernel case set: default (CPU-sized) or full (decode/prefill sweep over page sizes, "
                        "top-k up to 16384, batch up to 321, magnitudes; for a GPU runner). Default: $DSV4_CASES "
                        "or 'default'")
    c.add_argument("--case", action="append", default=[], metavar="GLOB",
                   help="only the kernel cases whose names match this glob, e.g. 'full-b74-h128-*' (repeatable; "
                        "an entry with no matching case is a skip row; fixtures are verified whole)")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    c.add_argument("--require", action="append", default=[], metavar="ENTRY_OR_GLOB",
                   help="fail unless this entry (every entry matching the glob) was judged: an unavailable or "
                        "all-skip required entry fails the check with its probe's reason (repeatable)")
    c.add_argument("--require-available", action="store_true",
                   help="fail unless every entry whose architectures match the hardware here was judged")
    _add_external(c)
    _add_root(c)

    from dsv4_numerics.cli import repro as _repro  # one module per command

    _repro.add_parser(sub)
    k = sub.add_parser("kernels", help="list kernel entries with availability and reasons")
    k.add_argument("--json", action="store_true", help="print JSON instead of a table")
    k.add_argument("--available", action="store_true", help="only entries that can run here")
    _add_external(k)

    f = sub.add_parser("fixtures", help="golden fixtures: list, regen, verify, import")
    _add_root(f)
    fs = f.add_subparsers(dest="fixtures_command", metavar="ACTION", parser_class=_Parser)
    fl = fs.add_parser("list", help="list committed fixtures and catalog fixtures not yet pinned")
    fl.add_argument("--json", action="store_true")
    _add_root(fl)
    fr = fs.add_parser("regen", help="regenerate reference fixtures, or record a kernel's outputs",
                       description="Regenerate reference fixtures (all, or NAME...). With --record-kernel ENTRY, record that "
                                   "entry's outputs on a few default cases of its stage (or CASE... names). Refuses to "
                                   "change or remove a pinned fixture unless --accept is given.")
    fr.add_argument("names", nargs="*", metavar="NAME", help="fixture names (or case names with --record-kernel)")
    fr.add_argument("--record-kernel", metavar="ENTRY", help="record kernel entry ENTRY (a registry name) on this machine")
    fr.add_argument("--accept", action="store_true", help="accept changed and removed fixtures")
    fr.add_argument("--device", default=None, help="device (reference default cpu; --record-kernel default cuda)")
    fr.add_argument("--out-dir", metavar="DIR", help="write into DIR (manifest.json + data/) instead of the fixture root")
    fr.add_argument("--max-cases", type=int, default=None, help="--record-kernel: at most this many cases (default 3)")
    fr.add_argument("-q", "--quiet", action="store_true")
    _add_root(fr)
    fv = fs.add_parser("verify", help="re-derive the fixtures and compare byte for byte; judge recorded kernel outputs")
    fv.add_argument("names", nargs="*", metavar="NAME")
    fv.add_argument("--device", default="cpu", help="device to re-derive reference outputs on (bytes must not depend on it)")
    fv.add_argument("-q", "--quiet", action="store_true")
    _add_root(fv)
    fi = fs.add_parser("import", help="bring fixtures recorded elsewhere (an --out-dir) into the fixture root")
    fi.add_argument("src", metavar="DIR", help="directory holding manifest.json and data/ (e.g. a GPU CI artifact)")
    fi.add_argument("names", nargs="*", metavar="NAME")
    fi.add_argument("--accept", action="store_true", help="accept fixtures that replace different pinned ones")
    _add_root(fi)

    i = sub.add_parser("inspect", help="decode a KV-cache dump into a per-slot table and flag impossible content")
    i.add_argument("file", metavar="FILE", help="safetensors file or raw bytes")
    i.add_argument("--key", help="tensor name inside a safetensors file (default: its only uint8 tensor)")
    i.add_argument("--format", default="auto", choices=("auto", "safetensors", "raw"))
    i.add_argument("--page-size", type=int, default=None, metavar="BS", help="entries per page (block size)")
    i.add_argument("--stride", type=int, default=None, metavar="BYTES", help="page stride in bytes (raw dumps)")
    i.add_argument("--layout", default="model1", help="cache layout: model1 (584-byte fp8_ds_mla), or detect: tell "
                   "MODEL1 pages from V4.1 528/288-byte caches and their interleaved / page-footer byte order, and say why")
    i.add_argument("--fp8", default="e4m3fn", help="NoPE code flavour: e4m3fn or e4m3fnuz (gfx942 SWA cache)")
    i.add_argument("--producer", default="vllm", help="vllm (pad byte must be 0), flashmla or unknown")
    i.add_argument("--slots", default=None, help="slots to examine, e.g. 0-63,100 (default: all)")
    i.add_argument("--limit", type=int, default=64, help="at most this many table rows (default 64)")
    i.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH ('-' for stdout only)")

    sv = sub.add_parser("stage-vllm", help="stage vLLM 0.33.0's DSv4 kernels from its wheel into one folder (use it with DSV4_STAGED=DIR)",
                        description="Copy vLLM's DSv4 kernel files out of a vllm-0.33.0 wheel into DEST (additive) with small "
                                    "stand-ins for the engine modules they import; DEST/MANIFEST.json lists every file. "
                                    "Then set DSV4_STAGED=DEST for check, the tests and .ci/gpu-matrix.")
    from dsv4_numerics.staging import vllm as staging

    staging.add_arguments(sv)

    sg = sub.add_parser("stage-sglang", help="stage SGLang 0.5.23's DSv4 kernel sources from its wheel into one folder "
                                             "(additive, next to stage-vllm parts; use it with DSV4_STAGED=DIR)",
                        description="Copy SGLang's DSv4 Triton and JIT-CUDA kernel sources out of an sglang-0.5.23 wheel "
                                    "into DEST/sglang/ with small stand-ins for the engine modules they import; "
                                    "DEST/MANIFEST.json lists every file.")
    from dsv4_numerics.staging import sglang as staging_sglang

    staging_sglang.add_arguments(sg)

    _add_report(sub)

    b = sub.add_parser("bench", help="benchmarks (delegates to dsv4_numerics.bench.cpu / .oracle / .gpu)")
    b.add_argument("which", choices=("cpu", "oracle", "gpu"))
    b.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark module")
    return p


def _add_report(sub) -> None:
    r = sub.add_parser("report", help="merge reports of many runs into one matrix (JSON, HTML page); diff two runs")
    rs = r.add_subparsers(dest="report_command", metavar="ACTION", parser_class=_Parser)
    m = rs.add_parser("merge", help="one matrix (entries x architectures) from check and pytest reports",
                      description="Merge check --json and --dsv4-report reports of any number of runners into one "
                                  "matrix: per entry and architecture the verdict, cases judged, worst ulps, headroom "
                                  "and the decoded diff of failures; divergences and conflicts called out.")
    m.add_argument("reports", nargs="+", metavar="REPORT")
    m.add_argument("--json", metavar="OUT", help="write the matrix (schema dsv4-numerics/matrix/1)")
    m.add_argument("--html", metavar="OUT", help="write the self-contained HTML page")
    m.add_argument("--title", default="dsv4-numerics matrix", help="the page's title")
    d = rs.add_parser("diff", help="what changed from BASE to NEW; exit 1 on a regression",
                      description="Compare two runs (reports or merged matrices) cell by cell: verdict changes, "
                                  "entries that became unavailable or lost cases, headroom / worst-ulps drift beyond "
                                  "--ratio, new entries. Exit status 1 on any regression.")
    d.add_argument("base", metavar="BASE")
    d.add_argument("new", metavar="NEW")
    d.add_argument("--ratio", type=float, default=None, metavar="R",
                   help="drift threshold: headroom shrinking or worst ulps growing by more than R (default 2: one binade)")
    d.add_argument("--json", metavar="OUT", help="write the changes as JSON")
    d.add_argument("--base-release", metavar="R", help="only release R's rows of BASE (e.g. 0.31.0)")
    d.add_argument("--new-release", metavar="R", help="only release R's rows of NEW (e.g. 0.32.0)")
    from dsv4_numerics.report import history

    history.add_arguments(rs.add_parser("history", help="per entry and architecture, the verdict, worst ulps and "
                                                          "policies per release; the first release where anything changed"))


def cmd_report(args) -> int:
    from dsv4_numerics.fixtures import store

    action = args.report_command
    if action == "merge":
        from dsv4_numerics.report import merge as report_merge

        for flag, out in (("--json", args.json), ("--html", args.html)):
            if out:
                _check_writable(out, flag)
        m = report_merge.merge_reports(args.reports)
        print(report_merge.format_matrix(m))
        if args.json:
            store.atomic_write_bytes(args.json, (json.dumps(m, indent=1, allow_nan=False) + "\n").encode())
            print(f"matrix written to {args.json}")
        if args.html:
            from dsv4_numerics.report import html as report_html

            report_html.write_html(m, args.html, args.title)
            print(f"page written to {args.html}")
        return EXIT_OK
    if action == "diff":
        from dsv4_numerics.report import diff as report_diff

        if args.json:
            _check_writable(args.json)
        ratio = report_diff.DEFAULT_RATIO if args.ratio is None else args.ratio
        base, new, changes = report_diff.diff_paths([args.base], [args.new], ratio, args.base_release, args.new_release)
        print(report_diff.format_diff(base, new, changes))
        if args.json:
            data = {"base": base["runs"], "new": new["runs"], "ratio": ratio, "changes": [c.to_dict() for c in changes],
                    "regressions": sum(c.regression for c in changes)}
            store.atomic_write_bytes(args.json, (json.dumps(data, indent=1, allow_nan=False) + "\n").encode())
        return EXIT_FAIL if any(c.regression for c in changes) else EXIT_OK
    if action == "history":
        from dsv4_numerics.report import history

        return history.run(args)
    raise UsageError("report: choose an action: merge, diff or history")


# ----------------------------------------------------------------------------- commands
def _root(args, must_exist: bool = False) -> Path:
    from dsv4_numerics.fixtures import store

    r = getattr(args, "root", None)
    if r is None:
        return store.PACKAGE_ROOT
    p = Path(r)
    if p.exists() and not p.is_dir():
        raise UsageError(f"--root {r} is not a directory")
    if must_exist and not p.exists():
        raise UsageError(f"--root {r}: no such directory")
    return p


def cmd_check(args) -> int:
    from dsv4_numerics.runner import check

    if args.no_kernels and args.no_fixtures:
        raise UsageError("check: --no-kernels and --no-fixtures together leave nothing to do")
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"check: --jobs must be >= 1 (kernel children run at once), got {args.jobs}")
    if args.json:
        _check_writable(args.json)
    if args.no_kernels and (args.require or args.require_available):
        raise UsageError("check: --require/--require-available name kernel entries; they cannot go with --no-kernels")
    if args.cases is not None:  # the isolated children inherit it (case_files.ENV_CASES)
        from dsv4_numerics.runner.case_files import ENV_CASES

        os.environ[ENV_CASES] = args.cases
    try:
        rep = check.run_check(_root(args, must_exist=True), device=_check_device(args.device), entries=args.entry,
                              kernels=not args.no_kernels, fixtures=not args.no_fixtures,
                              progress=_progress(args.quiet), isolate=not args.no_isolate, require=args.require,
                              require_available=args.require_available, entries_from=args.entries_from,
                              include_installed=not args.no_external, jobs=args.jobs, case_globs=args.case)
    except check.CheckInterrupted as e:  # what was judged before the stop is still printed and written
        if e.report is None:
            raise
        rep = e.report
    check.print_report(rep)
    if args.json:
        from dsv4_numerics.fixtures import store

        store.atomic_write_bytes(args.json, (json.dumps(rep.to_dict(), indent=1, allow_nan=False) + "\n").encode())
        print(f"report written to {args.json}")
    if rep.meta.get("interrupted"):
        _err(rep.required_failures[0] if rep.required_failures else "interrupted")
        return 130
    return rep.exit_code


def _check_device(dev: str | None) -> str | None:
    """A usable torch device string, or UsageError (unknown name, or CUDA asked for without a GPU)."""
    if dev is None:
        return None
    import torch

    try:
        d = torch.device(dev)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {dev!r} is not a torch device name (cpu, cuda, cuda:1, ...)") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {dev}: no CUDA/ROCm device is visible to torch {torch.__version__}")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise UsageError(f"--device {dev}: only {torch.cuda.device_count()} GPU(s) visible")
    if d.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {dev}: only cpu and cuda devices are supported")
    return str(dev)


def _check_writable(path: str, flag: str = "--json") -> None:
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {parent} does not exist")
    if Path(path).is_dir():
        raise UsageError(f"{flag} {path} is a directory")


def kernel_rows(entries_from=(), include_installed: bool = True) -> list[dict]:
    """``registry.listing()`` rows with ``package`` (``dsv4-numerics`` for built-ins), then the
    external entries' rows, then one unavailable row per broken external entry (``problem``)."""
    from dsv4_numerics.api import external
    from dsv4_numerics.kernels import registry

    rows = [dict(r, package=external.BUILTIN_PACKAGE) for r in registry.listing()]
    provided, problems = external.collect(entries_from, include_installed=include_installed)
    rows += [dict(p.entry.describe(), package=p.package) for p in provided]
    rows += [{"name": p.name, "stage": "?", "family": "?", "source": "", "archs": [], "dtypes": [], "policies": {},
              "tolerance_scope": "", "available": False, "reason": f"invalid external entry: {p.message}",
              "notes": "", "package": p.package, "problem": True} for p in problems]
    return rows


def cmd_kernels(args) -> int:
    rows = kernel_rows(args.entries_from, include_installed=not args.no_external)
    if args.available:
        rows = [r for r in rows if r["available"]]
    if args.json:
        print(json.dumps(rows, indent=1))
        return EXIT_OK
    if not rows:
        print("no kernel entries registered" if not args.available else "no kernel entry can run here")
        return EXIT_OK
    nw = max(len(r["name"]) for r in rows)
    sw = max(len(r["stage"]) for r in rows)
    aw = max(len("archs"), *(len(",".join(r["archs"])) for r in rows))
    pw = max(len("package"), *(len(r["package"]) for r in rows))
    print(f"{'entry':<{nw}}  {'stage':<{sw}}  {'family':<11}  {'archs':<{aw}}  {'package':<{pw}}  status")
    for r in rows:
        status = "available" if r["available"] else (r["reason"] if r.get("problem") else f"unavailable: {r['reason']}")
        print(f"{r['name']:<{nw}}  {r['stage']:<{sw}}  {r['family']:<11}  {','.join(r['archs']):<{aw}}  "
              f"{r['package']:<{pw}}  {status}")
    n = sum(r["available"] for r in rows)
    print(f"{n} of {len(rows)} entries available here")
    from dsv4_numerics.kernels import staged

    print(staged.describe())
    return EXIT_OK


def _print_outcome(o, what: str) -> int:
    for s in o.statuses:
        print(s.line())
    counts = {k: o.count(k) for k in ("new", "restored", "changed", "removed", "unchanged", "too-large", "skipped")}
    print(f"{what}: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v))
    if o.needs_accept and not o.wrote:
        print(f"{what}: REFUSED -- pinned fixtures would change (listed above); nothing was written. "
              "Re-run with --accept to accept the change.", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK


def cmd_fixtures(args) -> int:
    from dsv4_numerics.fixtures import golden, store
    from dsv4_numerics.fixtures.catalog import default_catalog

    action = args.fixtures_command
    if action is None:
        raise UsageError("fixtures: choose an action: list, regen, verify or import")
    root = _root(args)
    if action == "list":
        rows = golden.list_rows(root, default_catalog())
        if args.json:
            print(json.dumps(rows, indent=1))
            return EXIT_OK
        if not rows:
            print("no fixtures (catalog empty, manifest empty)")
            return EXIT_OK
        nw = max(len(r["name"]) for r in rows)
        for r in rows:
            size = f"{r['bytes'] / 1024:.1f} KiB" if r["bytes"] is not None else "-"
            print(f"{r['name']:<{nw}}  {r['kind']:<9}  {r['stage']:<16}  {size:>10}  {r['origin']}")
        pinned = [r for r in rows if r["pinned"]]
        total = golden.total_bytes(store.load_manifest(root))
        print(f"{len(pinned)} pinned ({total / 1024:.1f} KiB on disk, shared inputs counted once), "
              f"{len(rows) - len(pinned)} not pinned")
        return EXIT_OK
    if action == "regen":
        out = Path(args.out_dir) if args.out_dir else root
        if out.exists() and not out.is_dir():
            raise UsageError(f"fixtures regen: --out-dir {out} is not a directory")
        _check_device(args.device)
        if args.max_cases is not None and args.max_cases < 1:
            raise UsageError("fixtures regen: --max-cases must be >= 1")
        say = _progress(args.quiet)
        if args.record_kernel:
            kwargs = {} if args.max_cases is None else {"max_cases": args.max_cases}
            o = golden.record_kernel(out, default_catalog(), args.record_kernel, args.names, device=args.device or "cuda",
                                     accept=args.accept, progress=say, **kwargs)
        else:
            if args.max_cases is not None:
                raise UsageError("fixtures regen: --max-cases applies to --record-kernel only")
            o = golden.regen(out, default_catalog(), args.names, accept=args.accept, device=args.device or "cpu", progress=say)
        return _print_outcome(o, "regen")
    if action == "verify":
        root = _root(args, must_exist=True)
        _check_device(args.device)
        if not store.manifest_path(root).is_file():
            print(f"verify: FAILED -- nothing to verify: no {store.manifest_path(root).name} under {root}", file=sys.stderr)
            return EXIT_FAIL
        checks = golden.verify(root, default_catalog(), args.names, device=args.device, progress=_progress(args.quiet))
        for c in checks:
            print(c.line())
        bad = [c for c in checks if not c.ok]
        print(f"verify: {len(checks) - len(bad)} ok, {len(bad)} failed" + (f" ({', '.join(c.name for c in bad)})" if bad else ""))
        if not checks:
            print(f"verify: FAILED -- nothing to verify: {store.manifest_path(root)} lists no fixtures", file=sys.stderr)
            return EXIT_FAIL
        return EXIT_FAIL if bad else EXIT_OK
    if action == "import":
        src = Path(args.src)
        if not src.is_dir():
            raise UsageError(f"fixtures import: {src} is not a directory")
        o = golden.import_fixtures(src, root, accept=args.accept, names=args.names)
        return _print_outcome(o, "import")
    raise UsageError(f"fixtures: unknown action {action!r}")  # pragma: no cover - argparse rejects it


def cmd_inspect(args) -> int:
    from dsv4_numerics.inspect import cache as ic

    cache, desc = ic.load_dump(args.file, args.key, args.format)
    if args.limit < 0:
        raise UsageError("inspect: --limit must be >= 0")
    if args.layout == "detect":
        from dsv4_numerics.inspect import layout as il

        if cache.dim() == 1:
            if not args.stride or cache.numel() % args.stride:
                raise UsageError("inspect --layout detect: a raw dump needs --stride dividing its length")
            cache = cache.reshape(-1, args.stride)
        verdict = il.detect_layout(cache, args.page_size)
        print(f"{desc}\n{il.format_verdict(verdict)}")
        return EXIT_OK if verdict.best else EXIT_FAIL
    rep = ic.inspect_cache(cache, args.page_size, args.stride, fp8=args.fp8, producer=args.producer, slots=args.slots, layout=args.layout)
    if args.json != "-":
        print(ic.format_report(rep, desc, args.limit))
    if args.json:
        text = json.dumps(rep.to_dict(), indent=1, allow_nan=False)
        if args.json == "-":
            print(text)
        else:
            from dsv4_numerics.fixtures import store

            store.atomic_write_bytes(args.json, (text + "\n").encode())
    return EXIT_FAIL if rep.impossible else EXIT_OK


def cmd_bench(args) -> int:
    import importlib

    mod_name = f"dsv4_numerics.bench.{args.which}"
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name == mod_name:
            raise UsageError(f"bench {args.which}: module {mod_name} is not installed in this build") from None
        raise
    main = getattr(mod, "main", None)
    if main is None:
        raise UsageError(f"bench {args.which}: {mod_name} has no main(argv)")
    rc = main(list(args.args))
    return int(rc or 0)


def cmd_stage_vllm(args) -> int:
    from dsv4_numerics.staging import vllm as staging

    try:
        return staging.run(args, log=lambda m: print(m, file=sys.stderr))
    except staging.StagingError as e:
        raise UsageError(f"stage-vllm: {e}") from None


def cmd_stage_sglang(args) -> int:
    from dsv4_numerics.staging import vllm as staging
    from dsv4_numerics.staging import sglang as staging_sglang

    try:
        return staging_sglang.run(args, log=lambda m: print(m, file=sys.stderr))
    except staging.StagingError as e:
        raise UsageError(f"stage-sglang: {e}") from None


def cmd_repro(args) -> int:
    from dsv4_numerics.cli import repro

    return repro.run(args)


COMMANDS = {"check": cmd_check, "kernels": cmd_kernels, "fixtures": cmd_fixtures, "inspect": cmd_inspect, "bench": cmd_bench, "stage-vllm": cmd_stage_vllm,
            "stage-sglang": cmd_stage_sglang,
            "report": cmd_report, "repro": cmd_repro}


def main(argv: list[str] | None = None) -> int:
    from dsv4_numerics.reference.errors import InputError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return EXIT_OK
        return COMMANDS[args.command](args)
    except UsageError as e:
        _err(str(e))
        return EXIT_USAGE
    except InputError as e:  # includes store.FixtureError and registry.UnknownKernelError
        _err(str(e))
        return EXIT_USAGE
    except OSError as e:
        _err(f"{e.strerror or e}{': ' + str(e.filename) if getattr(e, 'filename', None) else ''}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except Exception as e:  # noqa: BLE001 - an internal error: still one line unless asked
        if os.environ.get("DSV4_TRACEBACK") == "1":
            raise
        _err(f"internal error: {type(e).__name__}: {e} (set DSV4_TRACEBACK=1 for the traceback)")
        return EXIT_INTERNAL

