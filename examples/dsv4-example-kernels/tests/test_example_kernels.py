"""The example project's own tests: only the installed dsv4-numerics (its public API and its pytest
plugin, auto-loaded through ``pytest11``) -- no conftest copied from dsv4-numerics."""

from __future__ import annotations

import pytest

import dsv4_numerics as dn
from dsv4_numerics.plugin.hooks import parametrize_cases

from dsv4_example_kernels.decode import sparse_decode
from dsv4_example_kernels.swa_writer import swa_write


@parametrize_cases("decode", size="small")
def test_decode_matches_reference(case, dsv4_results):
    dsv4_results(dn.assert_matches_reference(sparse_decode, "decode", cases=[case]))


def test_swa_writer_matches_with_its_declared_policy(dsv4_results):
    dsv4_results(dn.assert_matches_reference(swa_write, "swa_write", policies={"scale_rule": "scale_clamp"}))


def test_explain_names_the_swa_writer_policy():
    ex = dn.explain(swa_write, "swa_write", cases=dn.cases("swa_write", size="small"))
    assert ex.declare == {"scale_rule": "scale_clamp"}, str(ex)
    assert "scale_rule=scale_clamp" in str(ex)


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="the writer uses Q_S; under the SWA default (Q_A) the diff is explained by scale_rule=scale_clamp")
def test_swa_writer_under_the_stage_default_policy():
    dn.assert_matches_reference(swa_write, "swa_write", cases=dn.cases("swa_write", size="small"))


def test_entries_are_registered_through_the_entry_point():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="dsv4_numerics.kernels") if ep.value.startswith("dsv4_example_kernels")]
    if not eps:
        pytest.skip("dsv4-example-kernels is not installed (pip install -e examples/dsv4-example-kernels): "
                    "no entry point to check")
    entries = eps[0].load()
    assert sorted(e.name for e in entries) == ["example.decode.fp32", "example.swa_write.q_s"]
    for e in entries:
        dn.assert_matches_reference(e, e.stage, cases=dn.cases(e.stage, size="small"))
