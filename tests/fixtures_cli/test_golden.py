"""Regen / verify / import semantics on a self-made catalog (tests/fixtures_cli/fakes.py)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from dsv4_numerics.fixtures import golden, store
from dsv4_numerics.reference.errors import InputError

from .fakes import toy_catalog

NAMES = ["toy_bytes.inf-param.amax_clamp", "toy_bytes.inf-param.scale_clamp", "toy_bytes.tiny.amax_clamp",
         "toy_bytes.tiny.scale_clamp", "toy_numeric.one"]


def _snapshot(root):
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_catalog_names_and_policies():
    specs = toy_catalog().specs()
    assert sorted(s.name for s in specs) == NAMES
    assert {s.name: s.policy_dict for s in specs}["toy_bytes.tiny.scale_clamp"] == {"scale_rule": "scale_clamp"}


def test_regen_twice_gives_identical_bytes_and_second_run_is_unchanged(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    o1 = golden.regen(a, toy_catalog())
    assert o1.wrote and o1.count("new") == 5
    snap = _snapshot(a)
    o2 = golden.regen(a, toy_catalog())
    assert not o2.wrote and o2.count("unchanged") == 5
    assert _snapshot(a) == snap
    golden.regen(b, toy_catalog())  # an independent root: the same bytes
    assert _snapshot(b) == snap


def test_provenance_does_not_decide_and_is_kept(tmp_path, monkeypatch):
    golden.regen(tmp_path, toy_catalog())
    before = (tmp_path / "manifest.json").read_bytes()
    monkeypatch.setattr(torch, "__version__", "9.9.9-another-machine")
    o = golden.regen(tmp_path, toy_catalog())
    assert o.count("unchanged") == 5 and not o.wrote
    assert (tmp_path / "manifest.json").read_bytes() == before  # provenance of the first writer kept


def test_changed_reference_is_refused_without_accept_and_nothing_is_written(tmp_path):
    golden.regen(tmp_path, toy_catalog())
    snap = _snapshot(tmp_path)
    o = golden.regen(tmp_path, toy_catalog(shift=1))
    assert o.needs_accept and not o.wrote
    (st,) = [s for s in o.statuses if s.status == "changed"]
    assert st.name == "toy_numeric.one"
    # q = linspace(-1, 1, 5) in float64, out = 2q: element 0 = -2.0 (bits 0xC000000000000000);
    # shifted: -1.0 (0xBFF0000000000000). LE bytes: the first differing byte is byte 6
    # (0x00 vs 0xF0) of element (0,) -- byte 7 (0xC0 vs 0xBF) differs too but comes later.
    assert "data/toy_numeric.one.out.safetensors first differs at byte" in st.detail
    assert "in tensor 'out' element (0,) (byte 6 of 8): file 0x00, new 0xf0" in st.detail
    assert _snapshot(tmp_path) == snap
    o = golden.regen(tmp_path, toy_catalog(shift=1), accept=True)
    assert o.wrote
    assert golden.regen(tmp_path, toy_catalog(shift=1)).count("unchanged") == 5


def test_removed_fixture_needs_accept(tmp_path):
    golden.regen(tmp_path, toy_catalog())
    cat = toy_catalog()
    cat.variants = {}  # toy_bytes now has one variant per case: 2 new names, 4 removed
    o = golden.regen(tmp_path, cat)
    assert o.needs_accept and not o.wrote and o.count("removed") == 4
    o = golden.regen(tmp_path, cat, accept=True)
    m = store.load_manifest(tmp_path)
    assert sorted(m["fixtures"]) == ["toy_bytes.inf-param", "toy_bytes.tiny", "toy_numeric.one"]
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == sorted(
        f"{n}.{r}.safetensors" for n in m["fixtures"] for r in ("in", "out"))


def test_verify_passes_then_names_fixture_file_and_first_byte_after_corruption(tmp_path):
    golden.regen(tmp_path, toy_catalog())
    assert all(c.ok for c in golden.verify(tmp_path, toy_catalog()))
    path = tmp_path / "data" / "toy_bytes.tiny.amax_clamp.out.safetensors"
    data = bytearray(path.read_bytes())
    off = len(data) - 3  # a byte inside tensor 'out' (the last tensor of the file)
    data[off] ^= 0x01
    path.write_bytes(bytes(data))
    checks = {c.name: c for c in golden.verify(tmp_path, toy_catalog())}
    bad = checks["toy_bytes.tiny.amax_clamp"]
    assert bad.verdict == "fail"
    text = "; ".join(bad.problems)
    assert "file data/toy_bytes.tiny.amax_clamp.out.safetensors does not match its manifest sha256" in text
    assert f"first differs at byte {off} in tensor 'out'" in text
    assert all(c.ok for n, c in checks.items() if n != bad.name)
    # regen repairs a damaged file whose re-derived bytes equal the manifest pin
    o = golden.regen(tmp_path, toy_catalog())
    assert [s.status for s in o.statuses if s.name == bad.name] == ["restored"]
    assert all(c.ok for c in golden.verify(tmp_path, toy_catalog()))


def test_verify_missing_file_and_orphan(tmp_path):
    golden.regen(tmp_path, toy_catalog())
    (tmp_path / "data" / "toy_numeric.one.in.safetensors").unlink()
    cat = toy_catalog()
    cat.stages = lambda: ["toy_bytes"]
    checks = {c.name: c for c in golden.verify(tmp_path, cat)}
    assert checks["toy_numeric.one"].verdict == "fail"
    assert any("toy_numeric.one.in.safetensors is missing" in p for p in checks["toy_numeric.one"].problems)
    assert any("no longer in the catalog" in p for p in checks["toy_numeric.one"].problems)


def test_unknown_names_raise_input_error(tmp_path):
    with pytest.raises(InputError, match="fixtures regen: NAME 'nope' matches no fixture name"):
        golden.regen(tmp_path, toy_catalog(), ["nope"])
    golden.regen(tmp_path, toy_catalog())
    with pytest.raises(InputError, match="fixtures verify: NAME 'nope' matches no committed fixture"):
        golden.verify(tmp_path, toy_catalog(), ["nope"])


def test_load_fixture_round_trips_case_inputs(tmp_path):
    golden.regen(tmp_path, toy_catalog())
    case, out = golden.load_fixture(tmp_path, "toy_bytes.inf-param.scale_clamp")
    assert case.name == "inf-param" and case.stage == "toy_bytes"
    assert case.params == {"sink": float("inf")} and case.inputs["bs"] == 3
    # expected = x + 1 under scale_clamp (fakes._expected): arange(6) + 1
    assert out["out"].tolist() == [1, 2, 3, 4, 5, 6]


def kernel_fixture(src, outputs_shift=0.0):
    cat = toy_catalog()
    case = cat.cases("toy_numeric")[0]
    outs = {"out": case.inputs["q"] * 2.0 + outputs_shift}
    prov = dict(store.base_provenance("cuda:0"), entry="fake.kernel", arch="sm90", family="CUDA",
                tolerance_scope="fake.kernel", source="fake.mod", gpu="NVIDIA H200", compute_capability="9.0",
                driver="570.0", package="fake", package_version="1.0")
    b = golden.build("kernel.fake.kernel.sm90.one", "kernel", case, outs, {"lse": "none"}, prov)
    return golden.apply(src, [b])


def test_import_brings_recorded_fixtures_and_refuses_silent_replacement(tmp_path):
    src, dst = tmp_path / "gpu-out", tmp_path / "repo"
    kernel_fixture(src)
    golden.regen(dst, toy_catalog())
    o = golden.import_fixtures(src, dst)
    assert o.wrote and o.count("new") == 1
    m = store.load_manifest(dst)
    e = m["fixtures"]["kernel.fake.kernel.sm90.one"]
    assert e["kind"] == "kernel" and e["provenance"]["gpu"] == "NVIDIA H200"
    assert golden.import_fixtures(src, dst).count("unchanged") == 1
    # a different recording under the same name: refused, then accepted
    src2 = tmp_path / "gpu-out-2"
    kernel_fixture(src2, outputs_shift=0.5)
    o = golden.import_fixtures(src2, dst)
    assert o.needs_accept and not o.wrote
    assert golden.import_fixtures(src2, dst, accept=True).wrote
    # a corrupt source file is refused with its name
    p = src / "data" / "kernel.fake.kernel.sm90.one.out.safetensors"
    p.write_bytes(p.read_bytes()[:-1] + b"\x00")
    with pytest.raises(store.FixtureError, match="kernel.fake.kernel.sm90.one.*does not match its sha256"):
        golden.import_fixtures(src, dst, accept=True)


def test_kernel_fixture_is_judged_through_the_judge_with_recorded_scope(tmp_path):
    kernel_fixture(tmp_path)
    seen = {}

    def judge(entry, case):
        from dsv4_numerics.oracles.report import Result

        seen["entry"] = entry
        ref = case.inputs["q"] * 2.0
        ok = torch.equal(entry.call(case)["out"], ref)
        return [Result(entry.name, entry.stage, case.name, "pass" if ok else "fail", rule="toy")]

    (chk,) = golden.verify(tmp_path, toy_catalog(), judge=judge)
    assert chk.ok and chk.entry == "recorded:fake.kernel@sm90"
    assert seen["entry"].tolerance_scope == "fake.kernel" and seen["entry"].archs == ("sm90",)
    assert seen["entry"].policies == {"lse": "none"}


# ----------------------------------------------------------------------------- views and curation
from dsv4_numerics.fixtures.catalog import VIEWS, Catalog, view_mismatch  # noqa: E402
from dsv4_numerics.reference.cases import Case  # noqa: E402


def _attn_cases(stage):
    g = torch.Generator().manual_seed(3)
    return [Case("h16", stage, {"q": torch.randn(2, 16, 4, generator=g), "sink": torch.arange(16, dtype=torch.float32),
                                "positions": torch.tensor([7, 2, 7]), "cos_sin": torch.arange(40.0).reshape(10, 4)})]


def _per_head(case, pol):
    # a per-head computation (like attention): head h of the output depends on head h only
    q, sink = case.inputs["q"], case.inputs["sink"]
    rows = case.inputs["cos_sin"][case.inputs["positions"]]
    return {"out": q * 2 + sink[None, :, None], "rows": rows, "_aux": q.sum()}


def _curated(expected=_per_head, rows=None):
    return Catalog(stages=lambda: ["attn"], cases_of=_attn_cases, expected=expected,
                   curated={"attn": rows or [("h16", "heads8", [{}]), ("h16", "trim_cos_sin", [{}])]})


def test_views_shrink_inputs_and_keep_outputs(tmp_path):
    cat = _curated()
    assert [s.name for s in cat.specs()] == ["attn.h16.heads8", "attn.h16.trim_cos_sin"]
    golden.regen(tmp_path, cat)
    case, out = golden.load_fixture(tmp_path, "attn.h16.heads8")
    assert case.inputs["q"].shape == (2, 8, 4) and case.inputs["sink"].tolist() == list(range(8))
    assert out["out"].shape == (2, 8, 4) and "_aux" not in out  # judge auxiliaries are not pinned
    case, out = golden.load_fixture(tmp_path, "attn.h16.trim_cos_sin")
    # positions [7, 2, 7] use rows 2 and 7 of the 10-row table: kept in sorted order, renumbered [1, 0, 1]
    assert case.inputs["positions"].tolist() == [1, 0, 1]
    assert case.inputs["cos_sin"].tolist() == [[8.0, 9.0, 10.0, 11.0], [28.0, 29.0, 30.0, 31.0]]
    assert out["rows"].tolist() == [[28.0, 29.0, 30.0, 31.0], [8.0, 9.0, 10.0, 11.0], [28.0, 29.0, 30.0, 31.0]]
    assert "cos_sin rows" in case.params["fixture_view"]


def test_a_view_that_changes_outputs_is_refused(tmp_path):
    def not_per_head(case, pol):  # mixes heads: head 0 sees the mean over all heads
        q = case.inputs["q"]
        return {"out": q - q.mean(dim=1, keepdim=True)}

    with pytest.raises(store.FixtureError, match="view 'heads8' does not reproduce the outputs.*'out' differs"):
        golden.regen(tmp_path, _curated(not_per_head, [("h16", "heads8", [{}])]))
    assert not (tmp_path / "manifest.json").exists()


@pytest.mark.parametrize("orig, viewed, why", [
    ({"a": torch.zeros(4, 3)}, {"a": torch.zeros(2, 3)}, None),
    ({"a": torch.zeros(4, 3)}, {"a": torch.zeros(2, 2)}, "shape"),
    ({"a": torch.tensor([0.0, 1.0])}, {"a": torch.tensor([-0.0])}, "differs"),  # bits, not values
    ({"a": torch.tensor([float("nan")])}, {"a": torch.tensor([float("nan")])}, None),
    ({"a": torch.zeros(1)}, {"b": torch.zeros(1)}, "keys"),
])
def test_view_mismatch(orig, viewed, why):
    got = view_mismatch(orig, viewed)
    assert (got is None) if why is None else (why in got)


def test_curated_case_that_disappeared(tmp_path):
    golden.regen(tmp_path, _curated())
    gone = _curated(rows=[("h16", "heads8", [{}]), ("renamed", "trim_cos_sin", [{}])])
    with pytest.raises(InputError, match="no default case 'renamed' any more; update CURATED"):
        golden.regen(tmp_path, gone)
    assert gone.missing() == ["attn.renamed"]
    checks = {c.name: c for c in golden.verify(tmp_path, gone)}
    assert checks["attn.h16.heads8"].ok
    assert "no longer in the catalog" in checks["attn.h16.trim_cos_sin"].problems[0]
    assert sorted(VIEWS) == ["", "heads2", "heads8", "trim_cos_sin"]
