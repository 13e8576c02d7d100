"""Kernels for the isolation tests of the public API (``isolate=True``), importable by the child
process that runs them: each returns the reference's own outputs of an index stage (so it passes
when it returns) except on the cases :data:`ACTIONS` names, where it segfaults (reads address 0,
as an illegal host access does), hangs, or raises."""

from __future__ import annotations

import ctypes
import time
from types import SimpleNamespace

from dsv4_numerics.oracles import stages as st
from dsv4_numerics.reference.cases import Case

STAGE = "swa_indices"  # an index stage: its cases build and judge in milliseconds
SPEC = st.STAGES[STAGE]
# case name -> what the kernel does on it (the stage's default cases 1-3)
ACTIONS = {
    "prefill-paged-bs61-token-offset": "segv",
    "window16-bs2-starts-at-0": "hang",
    "decode-bs256-long-context": "raise",
}


def reference_outputs(inputs) -> dict:
    """The reference's outputs of the case ``inputs`` (a ``CaseInputs``) describes."""
    e = SPEC.expected(Case(inputs.name, inputs.stage, dict(inputs), inputs.params), dict(SPEC.defaults))
    return {k: v for k, v in e.items() if not k.startswith("_")}


def faulty(inputs):
    action = ACTIONS.get(inputs.name)
    if action == "segv":
        ctypes.string_at(0)
    if action == "hang":
        time.sleep(3600)
    if action == "raise":
        raise ValueError("faulty kernel rejects this case")
    return reference_outputs(inputs)


class Kernels:
    @staticmethod
    def good(inputs):
        return reference_outputs(inputs)


# an entry-like object bound to a module-level name: the child finds it by 'module:FAULTY_ENTRY'
FAULTY_ENTRY = SimpleNamespace(name="faulty.entry", stage=STAGE, family="user", policies={},
                               tolerance_scope="faulty.entry", probe=lambda: None,
                               call=lambda case: faulty(_inputs(case)))


def _inputs(case):
    from dsv4_numerics.api.callable_entry import CaseInputs

    return CaseInputs(case, dict(case.inputs))


FAULT_ON = "prefill-paged-bs61-token-offset"  # the case device_fault gathers out of bounds on


def device_fault(inputs):
    """On a CUDA device: an out-of-bounds gather on :data:`FAULT_ON` (a device-side assert: the
    context is unusable afterwards, as after an illegal address); the reference's outputs else."""
    import torch

    if inputs.name == FAULT_ON:
        x = torch.zeros(4, device="cuda")
        x[torch.tensor([1 << 30], device="cuda")] += 1  # asynchronous: surfaces at the next synchronize
    cpu = Case(inputs.name, inputs.stage, dict(inputs), inputs.params).to("cpu")
    return reference_outputs(CaseInputsLike(cpu))


class CaseInputsLike(dict):
    """A case's inputs with its name, stage and params, as ``reference_outputs`` reads them."""

    def __init__(self, case):
        super().__init__(case.inputs)
        self.name, self.stage, self.params = case.name, case.stage, case.params
