"""A small self-made fixture catalog for the store/regen/verify/CLI tests (no dependency on the
reference stages, so these tests pin the plumbing, not the numerics)."""

from __future__ import annotations

import torch

from dsv4_numerics.fixtures.catalog import Catalog
from dsv4_numerics.reference.cases import Case


def _cases(stage: str) -> list[Case]:
    g = torch.Generator().manual_seed(7)
    if stage == "toy_bytes":
        return [
            Case("tiny", stage, {"x": torch.randint(0, 256, (4, 8), dtype=torch.uint8, generator=g), "bs": 2},
                 {"seed": 7, "shape": [4, 8]}),
            Case("inf-param", stage, {"x": torch.arange(6, dtype=torch.uint8), "bs": 3}, {"sink": float("inf")}),
        ]
    if stage == "toy_numeric":
        return [Case("one", stage, {"q": torch.linspace(-1, 1, 5, dtype=torch.float64)}, {"seed": 1})]
    raise KeyError(stage)


def _expected(case: Case, policies: dict) -> dict:
    if case.stage == "toy_bytes":
        add = 1 if policies.get("scale_rule") == "scale_clamp" else 0
        return {"out": (case.inputs["x"].to(torch.int32) + add).to(torch.uint8)}
    return {"out": case.inputs["q"] * 2.0, "lse": torch.tensor([float("-inf")], dtype=torch.float64)}


def toy_catalog(shift: int = 0) -> Catalog:
    """``shift`` != 0 changes the expected output of every toy_numeric fixture (a 'reference change')."""

    def expected(case, pol):
        out = _expected(case, pol)
        if shift and case.stage == "toy_numeric":
            out["out"] = out["out"] + shift
        return out

    return Catalog(stages=lambda: ["toy_bytes", "toy_numeric"], cases_of=_cases, expected=expected,
                   variants={"toy_bytes": [{"scale_rule": "amax_clamp"}, {"scale_rule": "scale_clamp"}]})
