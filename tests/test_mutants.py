"""The mutation suite: every deliberately wrong implementation in ``tests/mutants/`` (one module per stage family) must be
caught by the kernel matrix's own runner and judges (``oracles.matrix.run_entry``) on the default
case set of its stage; the reference itself must pass every default case (positive control).

A mutant is *caught* when some default case of its stage gives a ``fail`` verdict (a comparator
or tolerance said no). Errors and skips do not count: a mutant that crashes proves nothing about
the judges. Cases are tried in default order and the first failing one is reported.
"""

from __future__ import annotations

import functools

import pytest

from dsv4_numerics.oracles import matrix
from dsv4_numerics.oracles import stages as st
from dsv4_numerics.reference.cases import default_cases, stages_with_cases

from .mutants import MUTANTS, fp32_compressor_entry, reference_entry


@functools.lru_cache(maxsize=None)
def _cases(stage):
    return tuple(default_cases(stage))


_EXPECTED: dict = {}  # reference outputs shared by every entry judged on the same case objects
_JUDGED: dict = {}  # (entry name, case name) -> Result, shared by the tests of one process


def _judge(entry, case):
    key = (entry.name, case.name)
    if key not in _JUDGED:
        _JUDGED[key] = matrix.run_entry(entry, cases=[case], expected_cache=_EXPECTED)[0]
    return _JUDGED[key]


def _hunt(entry):
    """(verdict of the catching case or None, rule, case name, results so far)."""
    seen = []
    # a sweep mutant tries the cases of its dimension first (the others are
    # test_sweep_mutant_is_caught_only_by_its_dimension's: it must pass them)
    order = sorted(_cases(entry.stage), key=lambda c: entry.dimension not in c.params.get("dimension", ()))
    for case in (order if entry.dimension else _cases(entry.stage)):
        r = _judge(entry, case)
        seen.append(r)
        if r.verdict == "fail":
            return r, seen
    return None, seen


def _table(rows):
    w = max(len(r[0]) for r in rows)
    lines = [f"{'mutant':<{w}}  {'stage':<16} {'caught by':<34} case"]
    lines += [f"{m:<{w}}  {s:<16} {rule:<34} {case}" for m, s, rule, case in rows]
    return "\n".join(lines)


# The mutants in this many slices, one test each (in registry order, so each table keeps its stages
# together): the whole list in one test was the GPU suite's longest (17-20 s on a loaded host).
_SLICES = 4


def test_the_mutation_suite_is_not_trivial():
    assert len(MUTANTS) >= 20


@pytest.mark.slow  # scheduled first under xdist (root conftest): among the suite's longest tests
@pytest.mark.parametrize("part", range(_SLICES), ids=[f"part{i + 1}of{_SLICES}" for i in range(_SLICES)])
def test_every_mutant_is_caught(part, matrix_results, capsys):
    size = -(-len(MUTANTS) // _SLICES)
    mutants = MUTANTS[part * size:(part + 1) * size]
    rows, survivors = [], []
    for m in mutants:
        caught, seen = _hunt(m)
        if caught is not None:
            matrix_results(caught)
            rows.append((m.name, m.stage, caught.rule, caught.case))
        else:
            why = "; ".join(f"{r.case}: {r.verdict} {r.rule} {r.message[:80]}" for r in seen if r.verdict != "pass")
            rows.append((m.name, m.stage, "SURVIVED", why or "passed every default case"))
            survivors.append(m)
    caught_n = len(mutants) - len(survivors)
    with capsys.disabled():
        print(f"\nmutation score, mutants {part * size + 1}-{part * size + len(mutants)} of {len(MUTANTS)}: "
              f"{caught_n / max(len(mutants), 1):.0%} ({caught_n}/{len(mutants)})\n" + _table(rows))
    assert not survivors, (
        f"{len(survivors)} mutant(s) survived -- the default cases or judges are too weak for: "
        + ", ".join(f"{m.name} ({m.bug})" for m in survivors) + "\n" + _table(rows))


SWEEP_MUTANTS = [m for m in MUTANTS if m.dimension]


def test_sweep_dimensions_have_their_mutants():
    # every sweep dimension a default case exercises for detection has a mutant
    assert {m.dimension for m in SWEEP_MUTANTS} == {"odd_page_size", "long_topk", "empty_main", "kv_magnitude",
                                                     "q_magnitude"}


@pytest.mark.parametrize("mutant", SWEEP_MUTANTS, ids=[m.name for m in SWEEP_MUTANTS])
def test_sweep_mutant_is_caught_only_by_its_dimension(mutant, matrix_results):
    # the dimension adds detection: the mutant passes every default case that does not exercise
    # its dimension (the defaults before the sweep among them) and fails one that does
    own, other = [], []
    for case in _cases(mutant.stage):
        (own if mutant.dimension in case.params.get("dimension", ()) else other).append(case)
    assert own, f"no default {mutant.stage} case exercises {mutant.dimension}"
    assert any("dimension" not in c.params for c in other), "the pre-sweep default cases must be among the others"
    caught_elsewhere = [f"{r.case}: {r.verdict} {r.rule}" for r in (_judge(mutant, c) for c in other)
                        if r.verdict != "pass"]
    assert not caught_elsewhere, f"{mutant.name} is not specific to {mutant.dimension}: {caught_elsewhere}"
    hits = [r for r in (_judge(mutant, c) for c in own) if r.verdict == "fail"]
    assert hits, f"{mutant.name} survives every {mutant.dimension} case"
    matrix_results(hits[0])


@pytest.mark.parametrize("stage", [s for s in stages_with_cases() if s in st.STAGES])
def test_reference_passes_every_default_case(stage, matrix_results):
    results = matrix_results(matrix.run_entry(reference_entry(stage, memo=_EXPECTED), cases=_cases(stage),
                                                    expected_cache=_EXPECTED))
    bad = [r.line() for r in results if r.verdict != "pass"]
    assert not bad, "\n".join(bad)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [s for s in ("decode", "prefill", "v32_decode", "dense_mla_decode",
                                               "dense_mla_prefill", "v41_sparse_decode", "v41_sparse_prefill")
                                   if s in st.STAGES])
def test_same_precision_emulation_passes_its_tier(stage, matrix_results):
    # the oracle's bf16_p mode is the precision model the tier-A records were derived from: it must
    # pass them (and the three-output rule) on every default case, or the records are too tight
    results = matrix_results(matrix.run_entry(reference_entry(stage, bf16_p=True, memo=_EXPECTED), cases=_cases(stage),
                                              expected_cache=_EXPECTED))
    bad = [r.line() for r in results if r.verdict != "pass"]
    assert not bad, "\n".join(bad)


def test_fp32_compressor_model_passes_its_tolerance(matrix_results):
    results = matrix_results(matrix.run_entry(fp32_compressor_entry(), cases=_cases("compressor"),
                                              expected_cache=_EXPECTED))
    bad = [r.line() for r in results if r.verdict != "pass"]
    assert not bad, "\n".join(bad)
