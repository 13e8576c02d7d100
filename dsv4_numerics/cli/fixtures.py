"""``dsv4-numerics fixtures list|regen|verify|import``: the golden fixtures
(:mod:`dsv4_numerics.fixtures.golden`) from the command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dsv4_numerics.cli import (EXIT_FAIL, EXIT_OK, Parser, UsageError, add_root_argument, check_device, fixture_root,
                               progress)


def add_parser(sub) -> None:
    f = sub.add_parser("fixtures", help="golden fixtures: list, regen, verify, import")
    add_root_argument(f)
    f.set_defaults(handler=run)
    fs = f.add_subparsers(dest="fixtures_command", metavar="ACTION", parser_class=Parser)
    fl = fs.add_parser("list", help="list committed fixtures and catalog fixtures not yet pinned")
    fl.add_argument("--json", action="store_true")
    add_root_argument(fl)
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
    add_root_argument(fr)
    fv = fs.add_parser("verify", help="re-derive the fixtures and compare byte for byte; judge recorded kernel outputs")
    fv.add_argument("names", nargs="*", metavar="NAME")
    fv.add_argument("--device", default="cpu", help="device to re-derive reference outputs on (bytes must not depend on it)")
    fv.add_argument("-q", "--quiet", action="store_true")
    add_root_argument(fv)
    fi = fs.add_parser("import", help="bring fixtures recorded elsewhere (an --out-dir) into the fixture root")
    fi.add_argument("src", metavar="DIR", help="directory holding manifest.json and data/ (e.g. a GPU CI artifact)")
    fi.add_argument("names", nargs="*", metavar="NAME")
    fi.add_argument("--accept", action="store_true", help="accept fixtures that replace different pinned ones")
    add_root_argument(fi)


def print_outcome(o, what: str) -> int:
    """Print a regen/import outcome (one line per fixture, then the counts); EXIT_FAIL when it
    refused to change pinned fixtures without ``--accept``."""
    for s in o.statuses:
        print(s.line())
    counts = {k: o.count(k) for k in ("new", "restored", "changed", "removed", "unchanged", "too-large", "skipped")}
    print(f"{what}: " + ", ".join(f"{v} {k}" for k, v in counts.items() if v))
    if o.needs_accept and not o.wrote:
        print(f"{what}: REFUSED -- pinned fixtures would change (listed above); nothing was written. "
              "Re-run with --accept to accept the change.", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK


def run(args) -> int:
    action = args.fixtures_command
    if action is None:
        raise UsageError("fixtures: choose an action: list, regen, verify or import")
    act = {"list": run_list, "regen": run_regen, "verify": run_verify, "import": run_import}.get(action)
    if act is None:  # pragma: no cover - argparse rejects it
        raise UsageError(f"fixtures: unknown action {action!r}")
    return act(args, fixture_root(args))


def run_list(args, root: Path) -> int:
    from dsv4_numerics.fixtures import golden, store
    from dsv4_numerics.fixtures.catalog import default_catalog

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


def run_regen(args, root: Path) -> int:
    from dsv4_numerics.fixtures import golden
    from dsv4_numerics.fixtures.catalog import default_catalog

    out = Path(args.out_dir) if args.out_dir else root
    if out.exists() and not out.is_dir():
        raise UsageError(f"fixtures regen: --out-dir {out} is not a directory")
    check_device(args.device)
    if args.max_cases is not None and args.max_cases < 1:
        raise UsageError("fixtures regen: --max-cases must be >= 1")
    say = progress(args.quiet)
    if args.record_kernel:
        kwargs = {} if args.max_cases is None else {"max_cases": args.max_cases}
        o = golden.record_kernel(out, default_catalog(), args.record_kernel, args.names, device=args.device or "cuda",
                                 accept=args.accept, progress=say, **kwargs)
    else:
        if args.max_cases is not None:
            raise UsageError("fixtures regen: --max-cases applies to --record-kernel only")
        o = golden.regen(out, default_catalog(), args.names, accept=args.accept, device=args.device or "cpu", progress=say)
    return print_outcome(o, "regen")


def run_verify(args, root: Path) -> int:
    from dsv4_numerics.fixtures import golden, store
    from dsv4_numerics.fixtures.catalog import default_catalog

    root = fixture_root(args, must_exist=True)
    check_device(args.device)
    if not store.manifest_path(root).is_file():
        print(f"verify: FAILED -- nothing to verify: no {store.manifest_path(root).name} under {root}", file=sys.stderr)
        return EXIT_FAIL
    checks = golden.verify(root, default_catalog(), args.names, device=args.device, progress=progress(args.quiet))
    for c in checks:
        print(c.line())
    bad = [c for c in checks if not c.ok]
    print(f"verify: {len(checks) - len(bad)} ok, {len(bad)} failed" + (f" ({', '.join(c.name for c in bad)})" if bad else ""))
    if not checks:
        print(f"verify: FAILED -- nothing to verify: {store.manifest_path(root)} lists no fixtures", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_FAIL if bad else EXIT_OK


def run_import(args, root: Path) -> int:
    from dsv4_numerics.fixtures import golden

    src = Path(args.src)
    if not src.is_dir():
        raise UsageError(f"fixtures import: {src} is not a directory")
    o = golden.import_fixtures(src, root, accept=args.accept, names=args.names)
    return print_outcome(o, "import")
