"""``dsv4-numerics repro``: a minimal, standalone reproducer of one entry's divergence
(``dsv4_numerics.repro``).

    dsv4-numerics repro ENTRY [--case NAME] [--contract [KEYS]] --out DIR [--force] [--device DEV]
    dsv4-numerics repro --findings [--gpu] --out DIR

Exit status: 0 written (its summary printed), 2 bad input -- an unknown entry (close matches
named), a case that passes (nothing to reproduce), an entry that cannot run here (its probe's
reason), an existing output folder without ``--force``.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> argparse.ArgumentParser:
    r = sub.add_parser("repro", help="write a minimal standalone reproducer (repro.py, inputs, ISSUE.md) of a "
                                     "divergence",
                       description="Judge ENTRY's case, shrink it while the same output fails by the same rule, "
                                   "and write DIR/repro.py (torch + the production package only), its inputs and "
                                   "DIR/ISSUE.md.")
    r.set_defaults(handler=run)
    r.add_argument("entry", nargs="?", metavar="ENTRY", help="kernel entry name (`dsv4-numerics kernels` lists them)")
    r.add_argument("--case", default=None, metavar="NAME",
                   help="the case (default or full set of the entry's stage); default: the first failing default case")
    r.add_argument("--contract", nargs="?", const="all", default=None, metavar="KEYS",
                   help="judge under the stage's default contract instead of the declared departures: every "
                        "departure (no value) or KEY[=VALUE],... (e.g. fp8_subnormals, nonfinite=cuda_satfinite)")
    r.add_argument("--out", required=True, metavar="DIR", help="folder to write (must not exist unless --force)")
    r.add_argument("--force", action="store_true", help="replace DIR when it exists")
    r.add_argument("--device", default=None, help="device the case runs on (default: the CPU; cuda for GPU entries)")
    r.add_argument("--no-run", action="store_true", help="do not run the written repro.py here")
    r.add_argument("--findings", action="store_true",
                   help="instead of ENTRY: every divergence the documentation lists whose kernel runs here, one folder each")
    r.add_argument("--gpu", action="store_true", help="with --findings: the GPU findings (else the CPU ones)")
    return r


def run(args) -> int:
    from dsv4_numerics.reference.errors import InputError
    from dsv4_numerics.repro import repro_entry
    from dsv4_numerics.repro.findings import write_all

    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if args.findings:
        if args.entry:
            raise InputError("repro: give ENTRY or --findings, not both")
        n = write_all(args.out, gpu=args.gpu, log=print, device=args.device)
        print(f"{n} reproducer(s) written under {args.out}")
        return 0
    if not args.entry:
        raise InputError("repro: argument ENTRY is required (or --findings)")
    rep = repro_entry(args.entry, case=args.case, out=args.out, contract=args.contract, force=args.force,
                      device=args.device, run=not args.no_run, log=say)
    print(rep.summary())
    if rep.output:
        print(rep.output.rstrip())
    return 0
