"""Kernel-recorded fixtures end to end on CPU: record a (fake) kernel through the real registry
path, import it, and judge it with the real matrix runner and StageSpec (the same comparators as
the live matrix). The fake kernel is the reference itself (a positive control) or a mutant."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

from dsv4_numerics.fixtures import catalog as catalog_mod
from dsv4_numerics.fixtures import golden, store
from dsv4_numerics.cli import main
from dsv4_numerics.kernels import probe, registry
from dsv4_numerics.oracles import stages

STAGE = "topk_global"


@dataclass(frozen=True)
class FakeEntry:
    name: str
    stage: str = STAGE
    family: str = "Triton"
    source: str = "dsv4_numerics.oracles.stages:get"
    archs: tuple = ("sm90",)
    dtypes: tuple = ("int32",)
    policies: dict = field(default_factory=dict)
    tolerance_scope: str = "fake.topk"
    mutate: Callable[[dict], dict] | None = None
    notes: str = ""

    def __hash__(self):
        return hash(self.name)

    def probe(self):
        return None

    def available(self):
        return True, ""

    def call(self, case) -> dict[str, Any]:
        spec = stages.get(self.stage)
        out = {k: v.clone() for k, v in spec.expected(case, spec.policies(self.policies)).items() if not k.startswith("_")}
        return self.mutate(out) if self.mutate else out


def _flip_first_index(out):
    out["global_topk_indices"].view(-1)[0] += 1
    return out


@pytest.fixture
def fake_gpu(monkeypatch):
    entries = {e.name: e for e in (FakeEntry("fake.topk_good"), FakeEntry("fake.topk_bad", mutate=_flip_first_index))}

    def get(name):
        if name not in entries:
            raise registry.UnknownKernelError(f"unknown kernel entry '{name}'")
        return entries[name]

    monkeypatch.setattr(registry, "get", get)
    monkeypatch.setattr(registry, "names", lambda: list(entries))  # what --record-kernel's pattern matches
    monkeypatch.setattr(probe, "gpu_info", lambda: probe.GpuInfo(True, "cuda", "NVIDIA H200", (9, 0), "sm90"))
    return entries


def test_record_import_and_judge_on_cpu(tmp_path, fake_gpu, capsys):
    # recording uses the real default cases of the stage; nothing else is needed here
    gpu_out, repo = tmp_path / "gpu-out", tmp_path / "repo"
    for name in ("fake.topk_good", "fake.topk_bad"):
        rc = main(["fixtures", "regen", "--record-kernel", name, "--out-dir", str(gpu_out), "--device", "cpu", "-q"])
        assert rc == 0
    m = store.load_manifest(gpu_out)
    from dsv4_numerics.reference.cases import default_cases

    case0 = default_cases(STAGE)[0].name
    good, bad = f"kernel.fake.topk_good.sm90.{case0}", f"kernel.fake.topk_bad.sm90.{case0}"
    assert sorted(m["fixtures"]) == sorted([good, bad])  # KERNEL_CASES_PER_ENTRY = 1: the first case
    prov = m["fixtures"][good]["provenance"]
    assert prov["entry"] == "fake.topk_good" and prov["arch"] == "sm90" and prov["tolerance_scope"] == "fake.topk"
    assert m["fixtures"][good]["kind"] == "kernel" and m["fixtures"][good]["stage"] == STAGE
    # bring them into a repo root that also holds nothing else, then check on "CPU CI"
    assert main(["fixtures", "import", str(gpu_out), "--root", str(repo)]) == 0
    capsys.readouterr()
    report = tmp_path / "r.json"
    rc = main(["check", "--root", str(repo), "--no-kernels", "-q", "--json", str(report)])
    out = capsys.readouterr().out
    assert rc == 1 and "check: FAILED" in out
    d = json.loads(report.read_text())
    rows = {r["entry"]: r for r in d["rows"]}
    assert rows["recorded:fake.topk_good@sm90"]["verdict"] == "pass"
    assert rows["recorded:fake.topk_bad@sm90"]["verdict"] == "fail"
    assert rows["recorded:fake.topk_bad@sm90"]["kind"] == "recorded-fixtures"
    (badfx,) = [f for f in d["fixtures"] if f["verdict"] != "pass"]
    assert badfx["name"] == bad and badfx["entry"] == "recorded:fake.topk_bad@sm90"
    results = [r for r in d["results"] if r["entry"] == "recorded:fake.topk_bad@sm90"]
    assert results and results[0]["verdict"] == "fail" and results[0]["case"] == case0


def test_recording_twice_is_unchanged_and_a_different_recording_needs_accept(tmp_path, fake_gpu, monkeypatch, capsys):
    out = tmp_path / "o"
    assert main(["fixtures", "regen", "--record-kernel", "fake.topk_good", "--out-dir", str(out), "--device", "cpu", "-q"]) == 0
    snap = {p.name: p.read_bytes() for p in (out / "data").iterdir()}
    assert main(["fixtures", "regen", "--record-kernel", "fake.topk_good", "--out-dir", str(out), "--device", "cpu", "-q"]) == 0
    assert {p.name: p.read_bytes() for p in (out / "data").iterdir()} == snap
    # the same entry name now returns different outputs: refused without --accept
    fake_gpu["fake.topk_good"] = FakeEntry("fake.topk_good", mutate=_flip_first_index)
    capsys.readouterr()
    assert main(["fixtures", "regen", "--record-kernel", "fake.topk_good", "--out-dir", str(out), "--device", "cpu", "-q"]) == 1
    cap = capsys.readouterr()
    assert "CHANGED" in cap.out and "global_topk_indices" in cap.out and "REFUSED" in cap.err


def test_record_unavailable_entry_is_one_line(tmp_path, monkeypatch, capsys):
    @dataclass(frozen=True)
    class Unavail(FakeEntry):
        def available(self):
            return False, "needs sm90 GPU (no GPU visible)"

    monkeypatch.setattr(registry, "get", lambda n: Unavail("fake.unavail"))
    monkeypatch.setattr(registry, "names", lambda: ["fake.unavail"])
    assert main(["fixtures", "regen", "--record-kernel", "fake.unavail", "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == "dsv4-numerics: error: kernel entry 'fake.unavail' cannot run here: needs sm90 GPU (no GPU visible)\n"
