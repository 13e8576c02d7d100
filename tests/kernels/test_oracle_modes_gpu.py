"""Every live-kernel verdict of the GPU matrix is the same under both oracle modes:
each decode / prefill entry's default cases are judged in its isolated child with the
fast oracle on the GPU (the default there) and with the ordered float64 oracle, on the same
kernel outputs, and the (verdict, rule) pairs must match case by case. The matrix's own kernel
run provides both (``conftest.kernel_results`` judges these stages with ``both_modes.both`` on a
GPU; this test and the matrix's items of a case group share one xdist group, so one worker and one
cached run). The CPU tests prove the same for the reference
entries, the mutants and the replayed kernel fixtures (``tests/attention/test_attention_fast.py``);
this one runs the real kernels. Skips with the probe's reason where a kernel or GPU is absent."""

from __future__ import annotations

import pytest

from dsv4_numerics.kernels import registry
from dsv4_numerics.kernels.probe import gpu_info
from dsv4_numerics.runner.pool import UNAVAILABLE
from dsv4_numerics.oracles.stages import FAST_ORACLE_STAGES

from .conftest import kernel_device, both_modes, case_groups, group_name


def _entries():
    from dsv4_numerics.runner.case_files import case_names

    out = []
    for e in registry.all_entries():
        if e.stage in FAST_ORACLE_STAGES:
            marks = [pytest.mark.gpu] + [getattr(pytest.mark, m) for m in e.markers if m != "gpu"]
            groups = case_groups(e, case_names(e.stage))
            for g, names in enumerate(groups):
                out.append(pytest.param(e.name, g, names, id=e.name if len(groups) == 1 else f"{e.name}#{g}",
                                        marks=marks + [pytest.mark.xdist_group(group_name(e.name, g, len(groups)))]))
    return out


@pytest.mark.parametrize("entry_name,group,names", _entries())
def test_kernel_verdicts_identical_under_both_oracle_modes(entry_name, group, names, kernel_results):
    entry = registry.get(entry_name)
    if not both_modes(entry, kernel_device()) or not gpu_info().present:
        pytest.skip(f"{entry_name} is not judged on a GPU here (device {kernel_device()}; {gpu_info().describe()})")
    res = kernel_results(entry_name, group)  # the matrix's run of this case group (its child probes first)
    if UNAVAILABLE in res:
        pytest.skip(f"{entry_name}: {res[UNAVAILABLE]['message']}")
    judged = 0
    for name in names:
        r = res[name]
        assert r["verdict"] != "error", f"{name}: {r.get('message')}"
        o = r["details"]["ordered"]
        assert (r["verdict"], r.get("rule")) == (o["verdict"], o["rule"]), (
            f"{entry_name} {name}: fast oracle gives {r['verdict']} ({r.get('rule')}), ordered gives "
            f"{o['verdict']} ({o['rule']})")
        if r["verdict"] in ("pass", "fail"):
            judged += 1
            assert r["details"]["oracle"]["mode"] == "fast" and o["oracle"]["mode"] == "ordered"
    assert judged, f"{entry_name}: no case reached a verdict under both modes"
