"""``dsv4-numerics report merge|diff|history``: one matrix from many runs' reports, what changed
between two runs (or two releases), and every release side by side (:mod:`dsv4_numerics.report`)."""

from __future__ import annotations

import json

from dsv4_numerics.cli import EXIT_FAIL, EXIT_OK, Parser, UsageError, check_writable


def add_parser(sub) -> None:
    r = sub.add_parser("report", help="merge reports of many runs into one matrix (JSON, HTML page); diff two runs")
    r.set_defaults(handler=run)
    rs = r.add_subparsers(dest="report_command", metavar="ACTION", parser_class=Parser)
    m = rs.add_parser("merge", help="one matrix (entries x architectures) from check and pytest reports",
                      description="Merge check --json and --dsv4-report reports of any number of runners into one "
                                  "matrix: per entry and architecture the verdict, cases judged, worst ulps, headroom "
                                  "and the decoded diff of failures; divergences and conflicts called out.")
    m.add_argument("reports", nargs="+", metavar="REPORT")
    m.add_argument("--json", metavar="OUT", help="write the matrix (schema dsv4-numerics/matrix/1)")
    m.add_argument("--html", metavar="OUT", help="write the self-contained HTML page")
    m.add_argument("--title", default="dsv4-numerics matrix", help="the page's title")
    m.add_argument("--later-wins", action="store_true",
                   help="where two reports judged the same release, the later one's rows and Results for that "
                        "(entry, stage, arch, release) replace the earlier one's (default: both kept, differences "
                        "listed as conflicts)")
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


def run(args) -> int:
    action = args.report_command
    if action == "merge":
        return run_merge(args)
    if action == "diff":
        return run_diff(args)
    if action == "history":
        from dsv4_numerics.report import history

        return history.run(args)
    raise UsageError("report: choose an action: merge, diff or history")


def run_merge(args) -> int:
    from dsv4_numerics.fixtures import store
    from dsv4_numerics.report import merge as report_merge

    for flag, out in (("--json", args.json), ("--html", args.html)):
        if out:
            check_writable(out, flag)
    m = report_merge.merge_reports(args.reports, later=args.later_wins)
    print(report_merge.format_matrix(m))
    if args.json:
        store.atomic_write_bytes(args.json, (json.dumps(m, indent=1, allow_nan=False) + "\n").encode())
        print(f"matrix written to {args.json}")
    if args.html:
        from dsv4_numerics.report import html as report_html

        report_html.write_html(m, args.html, args.title)
        print(f"page written to {args.html}")
    return EXIT_OK


def run_diff(args) -> int:
    from dsv4_numerics.fixtures import store
    from dsv4_numerics.report import diff as report_diff

    if args.json:
        check_writable(args.json)
    ratio = report_diff.DEFAULT_RATIO if args.ratio is None else args.ratio
    base, new, changes = report_diff.diff_paths([args.base], [args.new], ratio, args.base_release, args.new_release)
    print(report_diff.format_diff(base, new, changes))
    if args.json:
        data = {"base": base["runs"], "new": new["runs"], "ratio": ratio, "changes": [c.to_dict() for c in changes],
                "regressions": sum(c.regression for c in changes)}
        store.atomic_write_bytes(args.json, (json.dumps(data, indent=1, allow_nan=False) + "\n").encode())
    return EXIT_FAIL if any(c.regression for c in changes) else EXIT_OK
