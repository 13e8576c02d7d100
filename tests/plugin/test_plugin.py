"""The pytest plugin as a foreign project sees it: small test suites written to a temp dir and run
in a subprocess (``python -m pytest -p no:cacheprovider`` with cwd there, so this repository's
conftest is not loaded; the plugin comes from the installed ``pytest11`` entry point).

(a) merely installed, it changes nothing: a suite with its own ``gpu`` marker and
    ``--strict-markers`` gives the same outcomes with and without ``-p no:dsv4_numerics``, and
    collecting a torch-free suite does not import torch;
(b) ``dsv4_sm90`` skips with the reason and the hardware found (where no SM90 GPU is present);
(c) ``parametrize_cases`` gives one test per canonical case, ids = case names;
(d) ``--dsv4-report`` writes the Results handed to ``dsv4_results``;
(e) ``--dsv4-require`` fails the session when the required entry only skipped (its probe's reason
    in the summary), also under xdist, and passes when it was judged.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from dsv4_numerics.plugin.hooks import arch_skip_reason


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "DSV4_", "HYPOTHESIS_")) and k != "CUDA_VISIBLE_DEVICES_PINNED"}
    env.update(extra)
    return env


def write_suite(tmp_path, files: dict[str, str]):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # pins rootdir: no conftest above is read
    for name, src in files.items():
        (tmp_path / name).write_text(textwrap.dedent(src))
    return tmp_path


def run_pytest(cwd, *args, env=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *args],
                          cwd=cwd, capture_output=True, text=True, env=env or clean_env(), timeout=timeout)


def _outcomes(stdout: str) -> list[str]:
    return sorted(l.split(" ")[0] + " " + l.split(" ")[1] for l in stdout.splitlines()
                  if l.startswith(("PASSED", "FAILED", "SKIPPED", "ERROR")))


def test_unrelated_suite_is_unchanged_and_torch_free(tmp_path):
    write_suite(tmp_path, {
        "conftest.py": '''
            import sys
            import pytest

            def pytest_configure(config):
                config.addinivalue_line("markers", "gpu: this project's own GPU marker")

            def pytest_collection_modifyitems(config, items):
                for item in items:
                    if item.get_closest_marker("gpu"):
                        item.add_marker(pytest.mark.skip(reason="own gpu rule"))

            def pytest_collection_finish(session):
                with open("torch_after_collection.txt", "w") as f:
                    f.write(str("torch" in sys.modules))
        ''',
        "test_foreign.py": '''
            import os
            import pytest

            @pytest.mark.gpu
            def test_gpu_only():
                pass

            def test_plain():
                assert "CUDA_VISIBLE_DEVICES" not in os.environ or os.environ.get("DSV4_PINNED_GPU") is None

            @pytest.mark.parametrize("x", [1, 2])
            def test_param(x):
                assert x
        ''',
    })
    with_plugin = run_pytest(tmp_path, "--strict-markers", "-rA")
    assert with_plugin.returncode == 0, with_plugin.stdout + with_plugin.stderr
    assert (tmp_path / "torch_after_collection.txt").read_text() == "False"
    without = run_pytest(tmp_path, "--strict-markers", "-rA", "-p", "no:dsv4_numerics")
    assert without.returncode == 0, without.stdout + without.stderr
    assert _outcomes(with_plugin.stdout) == _outcomes(without.stdout) and len(_outcomes(without.stdout)) == 4
    assert re.search(r"SKIPPED \[1\] test_foreign.py:\d+: own gpu rule", with_plugin.stdout)
    assert "dsv4-numerics" not in with_plugin.stdout  # no section, no table, no extra output
    # the plugin is really loaded in the first run (its options exist)
    assert "--dsv4-report" in run_pytest(tmp_path, "--help").stdout


def test_arch_marker_skip_and_parametrize_cases_ids(tmp_path):
    from dsv4_numerics.api.testing import cases

    write_suite(tmp_path, {"test_arch.py": '''
        import pytest
        from dsv4_numerics.plugin.hooks import parametrize_cases

        @pytest.mark.dsv4_sm90
        def test_needs_h200():
            pass

        @parametrize_cases("swa_indices")
        def test_each_case(case):
            assert case.stage == "swa_indices"

        @parametrize_cases("swa_indices", size="small", argname="c")
        def test_small(c):
            assert c.stage == "swa_indices"
    '''})
    r = run_pytest(tmp_path, "--strict-markers", "--collect-only")
    ids = [l for l in r.stdout.splitlines() if "::" in l]
    names = [c.name for c in cases("swa_indices")]
    assert [i.split("[", 1)[1].rstrip("]") for i in ids if "test_each_case" in i] == names
    assert [i.split("[", 1)[1].rstrip("]") for i in ids if "test_small" in i] == names[:2]
    r = run_pytest(tmp_path, "--strict-markers", "-k", "h200")
    reason = arch_skip_reason("sm90")
    if reason is None:  # an SM90 GPU is present: the test runs
        assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout
    else:
        assert r.returncode == 0 and "1 skipped" in r.stdout, r.stdout
        assert re.search(r"SKIPPED \[1\] test_arch.py:\d+: " + re.escape(reason), r.stdout), r.stdout
        assert "needs an SM90 GPU (compute capability 9.x: H100/H200) (" in reason


RESULTS_SUITE = {
    "fake_entries.py": '''
        from dsv4_numerics.kernels.registry import KernelEntry

        ENTRIES = [KernelEntry(name="fake.unavail", stage="swa_indices", family="reference", source="fake",
                               archs=("sm90",), dtypes=("int32",), policies={}, tolerance_scope="fake.unavail",
                               probe=lambda: "needs the fake accelerator (none here)", call=lambda case: {})]
    ''',
    "test_results.py": '''
        import pytest
        from dsv4_numerics.oracles.report import Result

        def test_judged(dsv4_results):
            rs = dsv4_results([Result(entry="fake.judged", stage="swa_indices", case=c, verdict="pass", rule="exact")
                               for c in ("a", "b")])
            assert len(rs) == 2

        def test_unavailable_entry():
            pytest.skip("fake.unavail: needs the fake accelerator (none here)")
    ''',
}


def test_report_and_require_judged_entry_passes(tmp_path):
    write_suite(tmp_path, RESULTS_SUITE)
    r = run_pytest(tmp_path, "--dsv4-report", "r.json", "--dsv4-require", "fake.jud*")
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["schema"] == "dsv4-numerics/report/1"
    assert [(x["entry"], x["case"], x["verdict"]) for x in d["results"]] == [("fake.judged", "a", "pass"),
                                                                             ("fake.judged", "b", "pass")]
    assert d["meta"]["judged"] == 2 and d["meta"]["requirements"][0]["ok"] is True
    assert "dsv4-numerics matrix" in r.stdout and "all 1 required entries judged" in r.stdout


@pytest.mark.slow  # scheduled first under xdist (root conftest): one of the suite's longest tests
@pytest.mark.parametrize("xdist", [False, True], ids=["serial", "xdist"])
def test_require_fails_when_the_required_entry_only_skipped(tmp_path, xdist):
    write_suite(tmp_path, RESULTS_SUITE)
    args = ["--dsv4-report", "r.json"] + (["-n", "2"] if xdist else [])
    env = clean_env(DSV4_ENTRIES_FROM=str(tmp_path / "fake_entries.py"), DSV4_REQUIRE="fake.unavail")
    r = run_pytest(tmp_path, *args, env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 passed, 1 skipped" in r.stdout  # every test was green: only the requirement fails
    line = next(l for l in r.stdout.splitlines() if "required entry fake.unavail was not judged" in l)
    assert "unavailable: needs the fake accelerator (none here)" in line
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["meta"]["exitstatus"] == 1 and d["meta"]["requirements"][0]["ok"] is False
    # a glob that matches nothing fails as well
    r = run_pytest(tmp_path, "--dsv4-require", "no.such.*", "-k", "judged")
    assert r.returncode == 1 and "required 'no.such.*' matches no kernel entry" in r.stdout, r.stdout


def test_the_xdist_controller_writes_its_report_in_a_thread_and_raises_its_error_at_unconfigure(monkeypatch, tmp_path):
    """Under xdist the controller's report is written while xdist's own sessionfinish tells the
    workers to exit; pytest_unconfigure joins the writer, and a failed write is raised there (a
    plain run writes at sessionfinish, as before)."""
    import threading
    from types import SimpleNamespace

    from dsv4_numerics.plugin import hooks as pp

    gate, calls = threading.Event(), []

    def write(config, st, path, status):
        gate.wait(10)
        calls.append((path, status))
        if path.endswith("bad.json"):
            raise OSError(f"cannot write {path}")

    monkeypatch.setattr(pp, "write_report", write)
    monkeypatch.delenv(pp.ENV_REQUIRE, raising=False)

    def config(path, xdist):
        opts = {"--dsv4-report": path, "--dsv4-require": None, "--dsv4-require-available": False}
        return SimpleNamespace(stash=pytest.Stash(), getoption=lambda k, default=None: opts.get(k, default),
                               pluginmanager=SimpleNamespace(hasplugin=lambda name: xdist and name == "dsession"))

    for path, xdist in ((str(tmp_path / "ok.json"), True), (str(tmp_path / "bad.json"), True)):
        cfg = config(path, xdist)
        pp.pytest_sessionfinish(SimpleNamespace(config=cfg, exitstatus=0), 0)
        assert calls == [] or calls[-1][0] != path  # still writing: sessionfinish returned first
        gate.set()
        if path.endswith("bad.json"):
            with pytest.raises(OSError, match="cannot write"):
                pp.pytest_unconfigure(cfg)
        else:
            pp.pytest_unconfigure(cfg)
        assert calls[-1] == (path, 0)
        gate.clear()
    gate.set()  # a plain run writes before sessionfinish returns
    pp.pytest_sessionfinish(SimpleNamespace(config=config(str(tmp_path / "plain.json"), False), exitstatus=1), 1)
    assert calls[-1] == (str(tmp_path / "plain.json"), 1)
