"""``stage-vllm DEST --site-wheels DIR`` (and the carry procedure's NAME-wheels/ folders): any
wheels a staged kernel family needs go into ``DEST/site`` in the single pip call the CuTe-DSL
wheels use, deduplicated by file name, recorded in the folder's manifest."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dsv4_numerics.staging import vllm as staging


def _wheel(folder: Path, name: str, body: str = "X = 1\n") -> Path:
    """A minimal pure-Python wheel ``name-0.1`` holding module ``name``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-0.1-py3-none-any.whl"
    info = f"{name}-0.1.dist-info"
    files = {f"{name}/__init__.py": body,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(path, "w") as zf:
        for n, text in files.items():
            zf.writestr(n, text)
        zf.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n")
    return path


def test_site_wheels_from_two_folders_one_pip_call(tmp_path):
    dest = tmp_path / "staged"
    dest.mkdir()
    _wheel(tmp_path / "a", "zz_site_a")
    shared = _wheel(tmp_path / "a", "zz_site_shared")
    _wheel(tmp_path / "b", "zz_site_b")
    (tmp_path / "b").joinpath(shared.name).write_bytes(shared.read_bytes())  # same wheel in both folders
    manifest = staging.add_site_wheels(dest, None, [str(tmp_path / "a"), str(tmp_path / "b")], log=lambda m: None)
    assert sorted(manifest["site"]) == [f"zz_site_{m}-0.1-py3-none-any.whl" for m in ("a", "b", "shared")]
    for mod in ("zz_site_a", "zz_site_b", "zz_site_shared"):
        assert (dest / "site" / mod / "__init__.py").is_file()
    assert json.loads((dest / staging.MANIFEST).read_text())["site"] == manifest["site"]


def test_one_wheel_per_distribution_first_folder_wins(tmp_path):
    old = _wheel(tmp_path / "a", "zz_pkg")
    newer = tmp_path / "b" / "zz_pkg-0.2-py3-none-any.whl"
    newer.parent.mkdir()
    newer.write_bytes(old.read_bytes())
    said = []
    got = staging.merged_wheels([[old], [newer]], log=said.append)
    assert got == [old] and "left out" in said[0]


def test_site_wheels_refuse_bad_input(tmp_path):
    dest = tmp_path / "staged"
    dest.mkdir()
    (tmp_path / "empty").mkdir()
    with pytest.raises(staging.StagingError, match="no \\*.whl"):
        staging.add_site_wheels(dest, None, [str(tmp_path / "empty")])
    with pytest.raises(staging.StagingError, match="not a directory"):
        staging.add_site_wheels(dest, None, [str(tmp_path / "absent")])
    with pytest.raises(staging.StagingError, match="does not exist"):
        staging.add_site_wheels(tmp_path / "nope", None, [str(tmp_path / "empty")])
    _wheel(tmp_path / "x", "zz_dup", "X = 1\n")
    _wheel(tmp_path / "y", "zz_dup", "X = 2\n")
    with pytest.raises(staging.StagingError, match="two different wheels named zz_dup"):
        staging.add_site_wheels(dest, None, [str(tmp_path / "x"), str(tmp_path / "y")])
    with pytest.raises(staging.StagingError, match="holds no MANIFEST"):  # the CuTe set needs its part
        staging.add_site_wheels(dest, str(tmp_path / "x"))


def test_cli_site_wheels_without_wheel_only(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dsv4_numerics.cli", "stage-vllm", str(tmp_path), "--wheel", "v.whl",
                        "--site-wheels", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "--site-wheels installs into an already staged DEST" in r.stderr


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None, reason="needs bash and tar")
def test_gpu_matrix_installs_every_carried_wheels_folder(tmp_path):
    """A carried bundle holding sglang-wheels/ ends up in the first staged folder's site/."""
    import os
    import tarfile

    carry = tmp_path / "carry"
    carry.mkdir()
    _wheel(tmp_path / "src" / "sglang-wheels", "zz_carried")
    with tarfile.open(carry / "w.tar.part00", "w") as tf:
        tf.add(tmp_path / "src" / "sglang-wheels", arcname="sglang-wheels")
    staged = tmp_path / "staged"
    staged.mkdir()
    script = Path(__file__).resolve().parents[2] / ".ci" / "gpu-matrix"
    env = dict(os.environ, SKIP="tests check bench fixtures kernels env", BUDGET_S="120", DSV4_STAGED=str(staged),
               CARRY_DIR=str(carry), CARRY_FROM=str(tmp_path))  # not the developer's own carried parts
    r = subprocess.run(["bash", str(script), "", str(tmp_path / "out")], env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (staged / "site" / "zz_carried" / "__init__.py").is_file()
    assert "--site-wheels" in (tmp_path / "out" / "log.txt").read_text()
