"""MLA-family kernels on a GPU: every available entry of kernels/flashmla/mla_family.py, flashinfer/mla_dense.py and tokenspeed/mla.py on its stage's
default cases, judged by oracles.matrix with the shipped tolerances plus oracles/tolerances_mla.jsonl,
and the V3.2 scale-decoding policy each FlashMLA build actually implements.

Skipped without a GPU (root conftest markers) and, per entry, with the entry's probe reason
(e.g. "needs sm100/sm103 (found sm90 NVIDIA H200)"). On the lead's H200 this needs the staged
vLLM kernels (``dsv4-numerics stage-vllm`` and ``DSV4_STAGED``).
"""

from __future__ import annotations

import json

import pytest
import torch

from dsv4_numerics.kernels.flashinfer import mla_dense
from dsv4_numerics.kernels.flashmla import mla_family as mf
from dsv4_numerics.kernels.tokenspeed import mla as tokenspeed_mla
from dsv4_numerics.oracles.matrix import run_entry
from dsv4_numerics.oracles.stages.mla import MLA_TOLERANCES_PATH, v32_policy_fit
from dsv4_numerics.oracles.tolerances import DEFAULT_PATH, Tolerances
from dsv4_numerics.reference.cases import default_cases

# the MLA family's entries: FlashMLA's, then FlashInfer's and TokenSpeed's (registry order)
MLA_FAMILY = mf.ENTRIES + mla_dense.ENTRIES + tokenspeed_mla.ENTRIES

pytestmark = pytest.mark.gpu


def _records(path):
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip() and not s.startswith("#")]


@pytest.fixture(scope="module")
def tolerances():
    return Tolerances.from_dicts(_records(DEFAULT_PATH) + _records(MLA_TOLERANCES_PATH), source="merged")


@pytest.mark.parametrize("entry", MLA_FAMILY, ids=lambda e: e.name)
def test_entry_passes_its_cases(entry, tolerances, matrix_results):
    ok, why = entry.available()
    if not ok:
        pytest.skip(f"{entry.name}: {why}")
    results = matrix_results(run_entry(entry, default_cases(entry.stage), device="cuda", tolerances=tolerances))
    bad = [r.line() for r in results if r.verdict in ("fail", "error")]
    assert not bad, "\n".join(bad)
    assert any(r.verdict == "pass" for r in results), [r.line() for r in results]


@pytest.mark.parametrize("entry", [e for e in mf.ENTRIES if e.stage == "v32_decode"], ids=lambda e: e.name)
def test_declared_v32_scale_policy_is_the_best_fit(entry):
    """On non-power-of-two fp32 scales the consumer policies differ (datapath 1.5): the kernel's
    output must be closest to the oracle under the policy the entry declares. Measured on an H200
    (FlashMLA SM90, vLLM 0.33.0): max |out - bf16_p oracle| = 0.0 under bf16_rne, 1.8e-4 under
    exact, 1.45e-2 under sm100_rz_e8m0."""
    ok, why = entry.available()
    if not ok:
        pytest.skip(f"{entry.name}: {why}")
    case = next(c for c in default_cases("v32_decode") if c.params["nonpow2_scales"])
    got = entry.call(case.to("cuda"))["out"]
    torch.cuda.synchronize()
    fit = v32_policy_fit(case, got, entry.policies)
    declared = entry.policies["v32_scale_decode"]
    assert min(fit, key=fit.get) == declared, fit
