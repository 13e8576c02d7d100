"""``dsv4-numerics kernels``: the kernel entries (built-in, installed, ``--entries-from``) with
their availability here and the probe's reason."""

from __future__ import annotations

import json

from dsv4_numerics.cli import EXIT_OK, add_external_arguments


def add_parser(sub) -> None:
    k = sub.add_parser("kernels", help="list kernel entries with availability and reasons")
    k.add_argument("--json", action="store_true", help="print JSON instead of a table")
    k.add_argument("--available", action="store_true", help="only entries that can run here")
    add_external_arguments(k)
    k.set_defaults(handler=run)


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


def run(args) -> int:
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
