"""The index stages (datapath 4): exact, outputs named by the case's builder
(``reference.cases.index.INDEX_BUILDERS``)."""

from __future__ import annotations

import math

from dsv4_numerics.reference.cases import Case

from .. import bytes_diff as bd
from .core import JudgeScope, StageSpec, Verdict, missing_verdict, register

# --------------------------------------------------------------------------- index stages


def _expected_index(case: Case, policies: dict) -> dict:
    from dsv4_numerics.reference.cases.index import run_index_case

    return dict(run_index_case(case, policies))


def _judge_index(case: Case, expected: dict, got: dict, scope: JudgeScope) -> Verdict:
    reports = {}
    failed = []
    for name, e in expected.items():
        if name.startswith("_"):
            continue
        if name not in got:
            return missing_verdict(name, got)
        rep = bd.diff_index(e, got[name], name=name)
        reports[name] = rep.to_dict()
        if not rep.passed:
            failed.append((name, rep))
    if not failed:
        return Verdict(True, "exact", "", headroom=math.inf, details=reports)
    name, rep = failed[0]
    msg = "; ".join(f"{n}: {r.differing}/{r.compared} entries differ" + (f" ({r.message})" if r.message else "")
                    + (f", first {r.differences[0].line()}" if r.differences else f" -- {r.message}") for n, r in failed)
    return Verdict(False, f"{name}:{rep.rule if rep.rule != 'bit_exact' else 'exact'}", msg, headroom=0.0, details=reports)


for _st in ("topk_global", "swa_indices", "c128a_indices", "compressed_slots", "combine_prefill",
            "flashinfer_mixed", "rocm_ragged"):
    register(StageSpec(
        name=_st,
        kind="index",
        outputs=(),
        defaults={},
        expected=_expected_index,
        judge=_judge_index,
        doc="index plumbing (datapath 4): exact, outputs named by the case's builder"))
