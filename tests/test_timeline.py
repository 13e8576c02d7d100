"""dsv4_numerics.runner.timeline: the wall-time breakdown of a run from the per-worker timelines."""

from dsv4_numerics.runner import timeline


def _write(folder, worker, rows):
    (folder / f"{worker}.tsv").write_text("".join(f"{a}\t{b}\t{w}\t{n}\n" for a, b, w, n in rows))


def test_breakdown_splits_startup_collection_busy_and_idle(tmp_path):
    _write(tmp_path, "gw0", [(100, 100, "sessionstart", "-"), (101, 103, "collection", "-"),
                             (103, 110, "test", "a"), (110, 111, "test", "b")])
    _write(tmp_path, "gw1", [(100.5, 100.5, "sessionstart", "-"), (101, 104, "collection", "-"),
                             (104, 120, "test", "c")])
    text = timeline.breakdown(tmp_path)
    assert "wall 20.0 s" in text
    gw0 = next(line for line in text.splitlines() if line.strip().startswith("gw0")).split()
    assert gw0[1:] == ["1.0", "2.0", "2", "8.0", "9.0", "11.0"]  # idle: 17 s from its first test to the end, 8 busy
    assert "tail: the last worker finished" in text and text.splitlines()[-3].strip().startswith("16.0 s  c")


def test_main_usage_and_empty_folder(tmp_path, capsys):
    assert timeline.main([]) == 2
    assert timeline.main([str(tmp_path)]) == 0
    assert "no *.tsv" in capsys.readouterr().out


def test_judged_time_sums_call_reference_and_judge_per_family_and_stage(tmp_path, capsys):
    import gzip

    from dsv4_numerics.oracles.matrix import run_entry
    from dsv4_numerics.oracles.report import write_json
    from dsv4_numerics.reference.cases import default_cases

    from .mutants import reference_entry

    results = run_entry(reference_entry("gather"), default_cases("gather")[:2])
    assert all(set(r.details["timing"]) == {"call_s", "reference_s", "judge_s"} for r in results)
    path = write_json(results, tmp_path / "report.json")
    text = timeline.judged_time(path)
    assert text.startswith("judged cases: 2;")
    row = next(line for line in text.splitlines() if line.split()[:2] == ["reference", "gather"]).split()
    want = [sum(r.details["timing"][k] for r in results) for k in ("call_s", "reference_s", "judge_s")]
    assert row[2] == "2" and [float(x) for x in row[3:]] == [round(w, 1) for w in want]
    gz = tmp_path / "report.json.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert timeline.judged_time(gz) == text
    _write(tmp_path, "gw0", [(100, 100, "sessionstart", "-"), (101, 103, "collection", "-"), (103, 110, "test", "a")])
    assert timeline.main([str(tmp_path), "--report", str(path)]) == 0
    assert "judged cases: 2;" in capsys.readouterr().out
    assert timeline.main([str(tmp_path), "--rep", str(path)]) == 2


def test_ends_of_run_from_the_controller_and_worker_rows(tmp_path):
    _write(tmp_path, "main", [(98, 98, "sessionstart", "-"), (121, 121, "nodedown", "gw0"),
                              (121.5, 121.5, "nodedown", "gw1"), (121.5, 124, "sessionfinish", "-"),
                              (124, 126, "unconfigure", "-"), (126.5, 126.5, "exit", "-")])
    _write(tmp_path, "gw0", [(98.5, 99.5, "imports", "-"), (100, 100, "sessionstart", "-"), (101, 103, "collection", "-"),
                             (103, 110, "test", "a"), (110, 121, "sessionfinish", "-"), (121, 122, "unconfigure", "-"), (122.5, 122.5, "exit", "-")])
    _write(tmp_path, "gw1", [(98.5, 101.5, "imports", "-"), (100.5, 100.5, "sessionstart", "-"),
                             (101, 104, "collection", "-"), (104, 120, "test", "c"), (120, 121.5, "sessionfinish", "-"), (121.5, 122, "unconfigure", "-"), (123, 123, "exit", "-")])
    text = timeline.breakdown(tmp_path)
    assert "wall 20.0 s" in text  # the end rows do not move the last test's end
    assert "start: the first worker started 2.0 s after the controller; a worker's python start-up and " \
           "imports before it (torch): mean 2.0 s, max 3.0 s" in text
    end = next(line for line in text.splitlines() if line.startswith("end, after the last test"))
    for part in ("workers reported done +1.5 s", "workers' unconfigure ended +2.0 s", "workers' shutdown began +3.0 s",
                 "sessionfinish ended (waits for every worker process to exit) +4.0 s",
                 "unconfigure ended (kernel broker's children ended) +6.0 s", "controller's shutdown began +6.5 s"):
        assert part in end, (part, end)
    # an older timeline (no controller rows): no such lines
    (tmp_path / "main.tsv").unlink()
    assert "end, after the last test" not in timeline.breakdown(tmp_path)


def test_cpu_columns_split_before_tests_in_tests_and_children(tmp_path):
    def rows(r):
        return "".join("\t".join(map(str, x)) + "\n" for x in r)

    # wall start, end, phase, node, cpu0, cpu1, kids0, kids1
    (tmp_path / "gw0.tsv").write_text(rows([(100, 100, "sessionstart", "-", 1.5, 1.5, 0, 0),
                                            (101, 103, "collection", "-", 1.5, 3.0, 0, 0),
                                            (103, 110, "test", "a", 3.0, 4.0, 0, 6.0),
                                            (110, 111, "test", "b", 4.0, 4.5, 6.0, 6.0)]))
    # an older worker's rows (no CPU columns) next to it: counted in the wall part, not in the CPU part
    _write(tmp_path, "gw1", [(100, 100, "sessionstart", "-"), (101, 104, "collection", "-"), (104, 112, "test", "c")])
    assert timeline.load(tmp_path)["gw1"][0][4:] == (None,) * 4
    text = timeline.breakdown(tmp_path, top=2)
    line = next(x for x in text.splitlines() if x.startswith("CPU seconds"))
    assert "of 1 worker(s)" in line and "mean 3.0, max 3.0" in line and "in tests mean 1.5" in line
    assert "children mean 6.0" in line and "summed 10" in line
    top = text.splitlines()[text.splitlines().index("most CPU 2 tests (own + children, wall):") + 1]
    assert top.split() == ["7.0", "s", "=", "1.0", "+", "6.0", "(7.0", "s", "wall)", "a"]


def test_the_controllers_slow_end_hooks_are_listed_in_order(tmp_path):
    _write(tmp_path, "main", [(98, 98, "sessionstart", "-"), (110, 110, "nodedown", "gw0"),
                              (110, 110.01, "hook", "pytest_sessionfinish:conftest"),
                              (110.5, 112, "hook", "pytest_sessionfinish:dsv4_numerics"),
                              (110, 110.5, "hook", "pytest_sessionfinish:dsession"), (110, 112, "sessionfinish", "-")])
    _write(tmp_path, "gw0", [(100, 100, "sessionstart", "-"), (101, 103, "collection", "-"), (103, 110, "test", "a")])
    line = next(x for x in timeline.breakdown(tmp_path).splitlines() if x.startswith("controller's end hooks"))
    assert line == ("controller's end hooks: pytest_sessionfinish:dsession +0.0..+0.5 s; "
                    "pytest_sessionfinish:dsv4_numerics +0.5..+2.0 s")


def _rows(folder, name, rows):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.tsv").write_text("".join("\t".join(map(str, r)) + "\n" for r in rows))


def test_kernel_children_rows_give_warm_up_jobs_first_use_and_idle(tmp_path):
    _write(tmp_path, "gw0", [(100, 100, "sessionstart", "-"), (101, 103, "collection", "-"), (103, 130, "test", "a")])
    kids = tmp_path / "children"
    # child 11: warm-up 2 s, one job of entry e (3 cases: the first 4 s, then 1 s each) and one of f
    _rows(kids, "11", [(100, 102, "warmup", "-", 0, 1.5, 0, 0), (110, 117, "job", "e", 2, 8, 0, 0),
                       (110.5, 114.5, "case", "e::a", 2, 5, 0, 0), (114.5, 115.5, "case", "e::b", 5, 6, 0, 0),
                       (115.5, 116.5, "case", "e::c", 6, 7, 0, 0), (120, 121, "job", "f", 8, 9, 0, 0),
                       (120, 121, "case", "f::a", 8, 9, 0, 0)])
    # child 12: warm-up 4 s; e again (its first use here: 3 s against the median later case of 1 s)
    _rows(kids, "12", [(100, 104, "warmup", "-", 0, 2.5, 0, 0), (110, 113, "job", "e", 3, 6, 0, 0),
                       (110, 113, "case", "e::d", 3, 6, 0, 0)])
    lines = timeline.children_lines(tmp_path)
    assert lines[0] == ("kernel children: 2; warm-up mean 3.0 s (max 4.0, CPU mean 2.0); 3 jobs 11.0 s, of which "
                        "5 cases 10.0 s and 1.0 s outside cases; CPU 15 s; idle 60% of 2 x 21.0 s")  # busy 6 + 11 of 42
    assert lines[1].startswith("  first use of an entry in a child: 3 (child, entry) pairs, 8.0 s, 6.0 s over")  # e: 3 + 2, f: 1 (no later case)
    assert lines[2].split() == ["5.0", "s", "e", "(in", "2", "children)"]  # (4 - 1) + (3 - 1)
    assert "kernel children: 2" in timeline.breakdown(tmp_path)
    assert timeline.children_lines(tmp_path / "gw0.tsv") == [] and timeline.children_lines(tmp_path / "none") == []


def test_a_serving_kernel_child_writes_its_rows_under_the_timeline(tmp_path):
    """The real child (``worker_child --serve``) under ``DSV4_TIMELINE``: a warm-up row, a job row
    and one row per case, in ``children/<pid>.tsv``; the summary counts them."""
    import os

    import torch

    from dsv4_numerics.runner import pool as wp
    from dsv4_numerics.runner.case_files import save_cases
    from dsv4_numerics.reference.cases import Case

    cases = [Case(f"c{i}", "fake", {"x": torch.tensor([float(i)])}, {"action": "ok"}) for i in range(3)]
    path = tmp_path / "cases.safetensors"
    save_cases(cases, path)
    env = dict(os.environ, DSV4_TIMELINE=str(tmp_path / "tl"), DSV4_WORKER_DEVICE="cpu")
    with wp.WorkerSession(env, workdir=str(tmp_path / "s")) as sess:
        res = wp.run_isolated("tests.kernels.fake_entries:FAKE", [c.name for c in cases], device="cpu",
                              cases_file=str(path), mode="raw", workdir=str(tmp_path / "w"), session=sess)
    assert {r["verdict"] for r in res.values()} == {"ran"}
    (child,) = timeline.load(tmp_path / "tl" / "children").values()
    assert [r[2] for r in child] == ["warmup", "case", "case", "case", "job"]
    assert [r[3] for r in child][1:] == ["tests.kernels.fake_entries:FAKE::c0", "tests.kernels.fake_entries:FAKE::c1",
                                         "tests.kernels.fake_entries:FAKE::c2", "tests.kernels.fake_entries:FAKE"]
    assert all(r[0] <= r[1] and r[4] <= r[5] for r in child)
    assert timeline.children_lines(tmp_path / "tl")[0].startswith("kernel children: 1; ")
