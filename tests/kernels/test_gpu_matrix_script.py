""".ci/gpu-matrix on a CPU machine with every GPU step skipped: the script parses, finds the
project, lists the kernels, and leaves OUT within the limits of the GPU runner (at most 8 files,
no folders)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "gpu-matrix"


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_gpu_matrix_script_dry_run(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    out = tmp_path / "out"
    env = dict(os.environ, SKIP="tests check bench fixtures", BUDGET_S="120", STAGED="no-such-staged-dir")
    r = subprocess.run(["bash", str(SCRIPT), "", str(out)], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["log.txt", "summary.txt"]
    log = (out / "log.txt").read_text()
    assert "staged folder" in log and "does not exist" in log
    assert "entries available here" in log  # `dsv4-numerics kernels` ran
