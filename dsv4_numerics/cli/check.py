"""``dsv4-numerics check``: the main job (:mod:`dsv4_numerics.runner.check`) from the command line."""

from __future__ import annotations

import json
import os

from dsv4_numerics.cli import (UsageError, add_external_arguments, add_root_argument, check_device, check_writable,
                               err, fixture_root, progress)


def add_parser(sub) -> None:
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
    add_external_arguments(c)
    add_root_argument(c)
    c.set_defaults(handler=run)


def run(args) -> int:
    from dsv4_numerics.runner import check

    if args.no_kernels and args.no_fixtures:
        raise UsageError("check: --no-kernels and --no-fixtures together leave nothing to do")
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"check: --jobs must be >= 1 (kernel children run at once), got {args.jobs}")
    if args.json:
        check_writable(args.json)
    if args.no_kernels and (args.require or args.require_available):
        raise UsageError("check: --require/--require-available name kernel entries; they cannot go with --no-kernels")
    if args.cases is not None:  # the isolated children inherit it (case_files.ENV_CASES)
        from dsv4_numerics.runner.case_files import ENV_CASES

        os.environ[ENV_CASES] = args.cases
    try:
        opts = check.CheckOptions(fixture_root(args, must_exist=True), device=check_device(args.device),
                                  entries=args.entry, kernels=not args.no_kernels, fixtures=not args.no_fixtures,
                                  isolate=not args.no_isolate, require=args.require,
                                  require_available=args.require_available, entries_from=args.entries_from,
                                  include_installed=not args.no_external, jobs=args.jobs, case_globs=args.case)
        rep = check.run_check(opts, progress=progress(args.quiet))
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
        err(rep.required_failures[0] if rep.required_failures else "interrupted")
        return 130
    return rep.exit_code
