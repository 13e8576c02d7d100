"""The example external project (examples/dsv4-example-kernels) runs its own tests with only the
installed dsv4-numerics: a subprocess with cwd = the example folder, so this repository's root
conftest is not loaded. Without the example installed, it is put on PYTHONPATH (its entry points
then do not exist: only that test skips, with its reason)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dsv4-example-kernels"


def test_example_project_tests_pass_and_name_the_policy():
    env = dict(os.environ)
    installed = importlib.util.find_spec("dsv4_example_kernels") is not None
    if not installed:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLE), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", "-rxs", "-n", "0"],
                          cwd=EXAMPLE, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # pytest's closing line (stderr may carry warnings after it)
    summary = [ln for ln in proc.stdout.splitlines() if re.search(r"\d+ (passed|failed|xfailed)", ln)]
    assert summary, out[-4000:]
    counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|failed|xfailed|skipped|error)", summary[-1]))
    assert counts.get("xfailed") == 1 and "failed" not in counts, out[-2000:]
    assert counts.get("passed") == (5 if installed else 4), out[-2000:]
    assert "scale_rule=scale_clamp" in out
    if not installed:
        assert counts.get("skipped") == 1 and "not installed" in out
