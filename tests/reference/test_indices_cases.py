"""The registered index cases: coverage of the edge cases the suite promises, JSON params,
determinism, int32/int64 input equivalence, and CPU == CUDA bit equality (gpu marker)."""

from __future__ import annotations

import json

import pytest
import torch

from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.cases.index import INDEX_BUILDERS, run_index_case

STAGES = ("topk_global", "swa_indices", "c128a_indices", "compressed_slots", "combine_prefill",
          "flashinfer_mixed", "rocm_ragged")
ALL = [c for s in STAGES for c in default_cases(s)]


def _id(c):
    return f"{c.stage}:{c.name}"


def test_every_stage_has_readable_unique_cases():
    for s in STAGES:
        names = [c.name for c in default_cases(s)]
        assert names and len(names) == len(set(names))
        assert all(c.stage == s and c.params["builder"] in INDEX_BUILDERS for c in default_cases(s))


def test_promised_edge_cases_are_present():
    edges = {e for c in ALL for e in c.params["edge_cases"]}
    for e in ("permuted-block-table", "odd-block-size", "padding-token", "window-starts-at-0",
              "interior-minus1", "nonzero-query-base"):
        assert e in edges, e
    sizes = {c.params.get("block_size") for c in default_cases("topk_global")}
    assert {2, 53, 61, 64, 256} <= sizes
    assert any("interior-minus1" in c.name for c in ALL)


@pytest.mark.parametrize("case", ALL, ids=_id)
def test_case_runs_and_params_serialise(case):
    json.dumps(case.params)
    out = run_index_case(case)
    assert list(out) == case.params["outputs"]
    for name, t in out.items():
        want = torch.int64 if name in ("compressed_slot_mapping", "chunk_plan") else torch.int32
        assert t.dtype == want, name


def test_cases_are_deterministic():
    for s in STAGES:
        a, b = default_cases(s), default_cases(s)
        for x, y in zip(a, b):
            assert x.name == y.name and x.params == y.params
            for k, v in x.inputs.items():
                if isinstance(v, torch.Tensor):
                    assert torch.equal(v, y.inputs[k])
                else:
                    assert v == y.inputs[k]


def _widen(case, dtype):
    inputs = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.dtype in (torch.int32, torch.int64) else v)
              for k, v in case.inputs.items()}
    return type(case)(case.name, case.stage, inputs, case.params)


@pytest.mark.parametrize("case", ALL, ids=_id)
def test_int32_and_int64_inputs_give_identical_results(case):
    a, b = run_index_case(_widen(case, torch.int32)), run_index_case(_widen(case, torch.int64))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.gpu
@pytest.mark.parametrize("case", ALL, ids=_id)
def test_cuda_matches_cpu_bit_for_bit(case):
    cpu = run_index_case(case)
    gpu = run_index_case(case.to("cuda"))
    for k in cpu:
        assert gpu[k].device.type == "cuda"
        assert torch.equal(cpu[k], gpu[k].cpu()), k
