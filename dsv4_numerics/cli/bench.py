"""``dsv4-numerics bench {cpu,oracle,gpu}``: hands its arguments to the benchmark module's
``main(argv)`` (:mod:`dsv4_numerics.bench`)."""

from __future__ import annotations

import argparse
import importlib

from dsv4_numerics.cli import UsageError


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks (delegates to dsv4_numerics.bench.cpu / .oracle / .gpu)")
    b.add_argument("which", choices=("cpu", "oracle", "gpu"))
    b.add_argument("args", nargs=argparse.REMAINDER, help="passed to the benchmark module")
    b.set_defaults(handler=run)


def run(args) -> int:
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
