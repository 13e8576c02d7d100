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


@pytest.mark.slow  # scheduled first under xdist (root conftest): one of the suite's longest tests
@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_gpu_matrix_script_dry_run(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    out = tmp_path / "out"
    env = dict(os.environ, SKIP="tests check bench fixtures", BUDGET_S="120", DSV4_STAGED="no-such-staged-dir",
               CARRY_DIR=str(tmp_path / "carry"), CARRY_FROM=str(tmp_path), RELEASES_TREE=str(tmp_path / "no-tree"))
    r = subprocess.run(["bash", str(SCRIPT), "", str(out)], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["log.txt", "summary.txt"]
    log = (out / "log.txt").read_text()
    assert "staged folder" in log and "does not exist" in log
    assert "entries available here" in log  # `dsv4-numerics kernels` ran
    import torch

    if torch.cuda.is_available():  # the repro step runs where a GPU is visible
        assert "repro --findings --gpu" in log
    else:  # and is skipped, saying so, on a CPU box
        assert "no GPU visible, the GPU reproducers are skipped" in log


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None, reason="needs bash and tar")
def test_gpu_matrix_carry_procedure_joins_parts(tmp_path):
    """Two device calls: the first stashes part 1 in CARRY_DIR (CARRY_ONLY=1), the second brings
    part 2; the script joins and untars them before anything else runs."""
    import tarfile

    carry = tmp_path / "carry"
    src = tmp_path / "src" / "bundle"
    src.mkdir(parents=True)
    payload = os.urandom(300_000)
    (src / "blob.bin").write_bytes(payload)
    tar = tmp_path / "b.tar"
    with tarfile.open(tar, "w") as tf:
        tf.add(src, arcname="bundle")
    data = tar.read_bytes()
    half = len(data) // 2
    env = dict(os.environ, SKIP="tests check bench fixtures kernels env", BUDGET_S="120",
               DSV4_STAGED="no-such-staged-dir", CARRY_DIR=str(carry), CARRY_FROM=str(tmp_path))  # only the carry procedure
    (carry).mkdir()
    (carry / "b.tar.part00").write_bytes(data[:half])  # what the first call left behind
    out = tmp_path / "out"
    subprocess.run(["bash", str(SCRIPT), "", str(out)], env=env, capture_output=True, text=True, timeout=180)
    assert "b.tar is incomplete (1 parts" in (out / "log.txt").read_text()
    (carry / "b.tar.part01").write_bytes(data[half:])
    r = subprocess.run(["bash", str(SCRIPT), "", str(out)], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (carry / "unpacked" / "bundle" / "blob.bin").read_bytes() == payload
    assert "joined 2 parts of b.tar" in (out / "log.txt").read_text()


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None, reason="needs bash and tar")
def test_gpu_matrix_carry_overlay_lands_in_the_staged_folder(tmp_path):
    """A bundle holding staged-overlay/ (how the 61 MB `cuda` part travels) is copied into the
    first staged folder; an overlay never creates a staged folder that does not exist."""
    import tarfile

    carry = tmp_path / "carry"
    carry.mkdir()
    src = tmp_path / "src" / "staged-overlay" / "vllm"
    src.mkdir(parents=True)
    (src / "lib.so.xz").write_bytes(b"payload")
    with tarfile.open(carry / "ov.tar.part00", "w") as tf:
        tf.add(tmp_path / "src" / "staged-overlay", arcname="staged-overlay")
    staged = tmp_path / "staged"
    (staged / "vllm").mkdir(parents=True)
    env = dict(os.environ, SKIP="tests check bench fixtures kernels env", BUDGET_S="120", DSV4_STAGED=str(staged),
               CARRY_DIR=str(carry), CARRY_FROM=str(tmp_path))  # only the carry procedure
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(SCRIPT), "", str(out)], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (staged / "vllm" / "lib.so.xz").read_bytes() == b"payload"
    assert "staged-overlay copied into" in (out / "log.txt").read_text()
    missing = tmp_path / "absent"
    env["DSV4_STAGED"] = str(missing)
    subprocess.run(["bash", str(SCRIPT), "", str(out)], env=env, capture_output=True, text=True, timeout=180)
    assert not missing.exists()


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None or shutil.which("split") is None,
                    reason="needs bash, tar and split")
def test_triton_cache_saved_in_parts_and_restored_from_two_calls(tmp_path):
    """.ci/triton-cache: the warm Triton and SGLang JIT caches saved as parts under the runner's
    per-file limit, carried in two folders (two device calls), restored byte for byte into another
    machine's caches; a machine with only one of them saves and restores that one."""
    script = SCRIPT.parent / "triton-cache"
    warm, jit = tmp_path / "warm" / "cache", tmp_path / "warm" / "sglang-jit"
    (warm / "ab12").mkdir(parents=True)
    (jit / "store_v41" / "k9").mkdir(parents=True)
    blob = os.urandom(2_500_000)  # incompressible: three parts of 1 MiB
    (warm / "ab12" / "kernel.cubin").write_bytes(blob)
    (warm / "ab12" / "kernel.autotune.json").write_text('{"configs": [1, 2]}')
    so = os.urandom(300_000)
    (jit / "store_v41" / "k9" / "store_v41.so").write_bytes(so)
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(script), "save", str(out)], capture_output=True, text=True,
                       env=dict(os.environ, TRITON_CACHE_DIR=str(warm), SGLANG_JIT_CACHE_DIR=str(jit), PART_MB="1"))
    assert r.returncode == 0, r.stderr
    parts = sorted(out.iterdir())
    assert [p.name for p in parts] == ["sglang-jit.tgz.partaa", "triton-cache.tgz.partaa", "triton-cache.tgz.partab",
                                       "triton-cache.tgz.partac"]
    assert all(p.stat().st_size <= 2**20 for p in parts)
    call1, call2 = tmp_path / "call1", tmp_path / "call2"
    call1.mkdir(), call2.mkdir()
    shutil.copy(parts[1], call1), shutil.copy(parts[2], call2), shutil.copy(parts[3], call2)
    shutil.copy(parts[0], call2)
    fresh, fresh_jit = tmp_path / "fresh" / "cache", tmp_path / "fresh" / "jit"
    env = dict(os.environ, TRITON_CACHE_DIR=str(fresh), SGLANG_JIT_CACHE_DIR=str(fresh_jit))
    r = subprocess.run(["bash", str(script), "restore", str(call2), str(call1)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert (fresh / "ab12" / "kernel.cubin").read_bytes() == blob
    assert (fresh / "ab12" / "kernel.autotune.json").read_text() == '{"configs": [1, 2]}'
    assert (fresh_jit / "store_v41" / "k9" / "store_v41.so").read_bytes() == so
    # only a Triton cache on the warm machine: only its parts, and they restore alone
    out2 = tmp_path / "out2"
    r = subprocess.run(["bash", str(script), "save", str(out2)], capture_output=True, text=True,
                       env=dict(os.environ, TRITON_CACHE_DIR=str(warm), SGLANG_JIT_CACHE_DIR=str(tmp_path / "none")))
    assert r.returncode == 0 and "no sglang-jit cache" in r.stdout, r.stderr
    assert [p.name for p in out2.iterdir()] == ["triton-cache.tgz.partaa"]
    none = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "n1"), SGLANG_JIT_CACHE_DIR=str(tmp_path / "n2"))
    empty = subprocess.run(["bash", str(script), "save", str(tmp_path / "out3")], capture_output=True, text=True, env=none)
    assert empty.returncode == 2 and "no cache at" in empty.stderr
    bad = subprocess.run(["bash", str(script), "restore", str(tmp_path / "empty")], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "no triton-cache.tgz.part*" in bad.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("env,named", [
    ({"NEIGHBOURS": "disk", "CPUS_PER_GPU": "16"}, "NEIGHBOURS must be compute, memory or mix, got 'disk'"),
    ({"NEIGHBOURS": "memory"}, "NEIGHBOURS needs CPUS_PER_GPU"),
    ({"CPUS_PER_GPU": "0"}, "CPUS_PER_GPU must be a positive integer, got '0'"),
])
def test_gpu_scaling_names_a_bad_setting_before_looking_for_gpus(tmp_path, env, named):
    """.ci/gpu-scaling checks its settings first: on any machine a bad one exits 2 naming the setting
    and the rule, and leaves no output folder behind."""
    script = SCRIPT.parent / "gpu-scaling"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(script), str(tmp_path / "staged"), str(out)], env=dict(os.environ, **env),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and named in r.stderr, (r.returncode, r.stderr)
    assert not out.exists()


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_gpu_matrix_judges_every_release_of_a_packed_tree(tmp_path):
    """Step 6: a tree packed from staged release folders (manifests only here) is unpacked, the
    releases RELEASES names are judged in one check and their history written into OUT."""
    import json

    from dsv4_numerics.staging import carry

    folders = []
    for name, key, version in (("vllm-0.29.0", "vllm_version", "0.29.0"), ("vllm-0.33.0", "vllm_version", "0.33.0"),
                               ("vllm-0.31.0", "vllm_version", "0.31.0")):
        d = tmp_path / "staged" / name
        d.mkdir(parents=True)
        (d / "MANIFEST.json").write_text(json.dumps({key: version, "parts": [], "files": {}}))
        folders.append(d)
    carry.pack(tmp_path / "tree", folders, log=lambda s: None)
    out = tmp_path / "out"
    env = dict(os.environ, SKIP="tests check bench fixtures repro kernels env", BUDGET_S="300",
               DSV4_STAGED="no-such-staged-dir", CARRY_DIR=str(tmp_path / "carry"), CARRY_FROM=str(tmp_path),
               RELEASES_TREE=str(tmp_path / "tree"), RELEASES="vllm-0.29.0 vllm-0.33.0")
    r = subprocess.run(["bash", str(SCRIPT), "", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["log.txt", "releases-history.md", "releases.json", "summary.txt"]
    rows = json.loads((out / "releases.json").read_text())["rows"]
    assert {x["release"] for x in rows if x["entry"].split(".")[0] != "sglang"} == {"vllm 0.29.0", "vllm 0.33.0"}
    # RELEASES left 0.31.0 out; no SGLang release staged: its entries are judged in check's own process
    assert {x["release"] for x in rows if x["entry"].startswith("sglang.")} == {""}
    assert "| 0.29.0 | 0.33.0 |" in (out / "releases-history.md").read_text()
