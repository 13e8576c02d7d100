"""SGLang's kv RMSNorm + RoPE + unit-scale E4M3 store (``reference.pipeline.norm_rope_store``): NoPE
bytes against an independent float64 formulation, the RoPE dims against the separate rope
reference, the negative-slot rule (``SlotSkip.NEGATIVE_WRAPS``), the saturating store, input errors."""

from __future__ import annotations

import pytest
import torch

from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.formats.fp8 import decode_e4m3fn
from dsv4_numerics.reference.pipeline.norm_rope_store import kv_norm_rope_store, norm_rope_rows
from dsv4_numerics.reference.pipeline.query_quant import is_exact_norm_row

CASES = {c.name: c for c in default_cases("kv_norm_rope_store")}


def _store(inp: dict, **kw) -> torch.Tensor:
    return kv_norm_rope_store(inp["kv"], inp["weight"], inp["eps"], inp["cos_sin"], inp["positions"],
                              inp["slots"], inp["cache"], **kw)


def _e4m3_nearest(v: torch.Tensor) -> torch.Tensor:
    """Independent E4M3FN RNE with saturation: the nearest of the 253 finite values of the full code
    table (ties to the even code), |v| > 448 -> +-448. float64 ``v`` -> uint8 codes."""
    codes = torch.arange(256)
    vals = decode_e4m3fn(codes.to(torch.uint8)).to(torch.float64)
    keep = torch.isfinite(vals)
    codes, vals = codes[keep], vals[keep]
    d = (v.reshape(-1, 1).clamp(-448, 448) - vals.reshape(1, -1)).abs()
    best = d.min(dim=1, keepdim=True).values
    cand = (d == best) & ((codes.reshape(1, -1) & 1) == 0) | (d == best) & ((d == best).sum(1, keepdim=True) == 1)
    # among equally near codes prefer the even mantissa; +-0 have one sign: pick the one of v's sign
    pick = torch.where(cand, codes.reshape(1, -1), torch.full_like(d, 10**6, dtype=torch.int64))
    neg = torch.signbit(v.reshape(-1, 1))
    pick = torch.where(cand & ((codes.reshape(1, -1) >= 128) == neg), pick, pick + 1000)
    return pick.min(dim=1).values.reshape(v.shape).remainder(1000).to(torch.uint8)


@pytest.mark.parametrize("name", sorted(CASES))
def test_nope_bytes_are_the_weighted_row_rounded_twice(name):
    """Exact-norm rows: rrms = 1, so NoPE dims store E4M3(bf16(x * w)) -- computed here in float64
    (x * w is exact) with an independent nearest-value E4M3 encoder."""
    inp = CASES[name].inputs
    assert bool(is_exact_norm_row(inp["kv"]).all())
    out = _store(inp)
    s = inp["slots"].to(torch.int64)
    rows = torch.where(s < 0, s + inp["cache"].shape[0], s)
    y = inp["kv"].to(torch.float64) * inp["weight"].to(torch.float64)
    y = y.to(inp["kv"].dtype).to(torch.float64)  # the kernel's rounding to kv's dtype (exact for fp32)
    assert torch.equal(out[rows, :448], _e4m3_nearest(y[:, :448]))
    sat = y[:, :448].abs() > 464
    assert bool(sat.any()) and bool(((out[rows, :448] & 0x7F)[sat] == 0x7E).all())  # the saturating store


def test_rope_dims_are_the_rope_reference_of_the_fp32_normed_row():
    inp = CASES["t8-bf16-rows64"].inputs
    y = norm_rope_rows(inp["kv"], inp["weight"], inp["eps"], inp["cos_sin"], inp["positions"])
    out = _store(inp)
    got = decode_e4m3fn(out[inp["slots"], 448:]).to(torch.float64)
    want = decode_e4m3fn(_e4m3_nearest(y[:, 448:].to(torch.bfloat16).to(torch.float64))).to(torch.float64)
    assert torch.equal(got, want)


def test_negative_slots_write_pytorch_rows_or_are_skipped():
    inp = CASES["t6-negative-slots-rows32"].inputs
    rows = inp["cache"].shape[0]
    wrapped, skipped = _store(inp), _store(inp, slot_skip="all_negative")
    for s in (-1, -rows, -3):
        assert not torch.equal(wrapped[rows + s], inp["cache"][rows + s])
        assert torch.equal(skipped[rows + s], inp["cache"][rows + s])
        assert torch.equal(wrapped[rows + s], _store({**inp, "slots": torch.where(inp["slots"] == s, rows + s,
                                                                                   inp["slots"])})[rows + s]), s
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[torch.where(inp["slots"] < 0, inp["slots"] + rows, inp["slots"])] = False
    assert torch.equal(wrapped[untouched], inp["cache"][untouched])


def test_bad_input_names_the_argument_and_rule():
    inp = dict(CASES["t6-negative-slots-rows32"].inputs)
    rows = inp["cache"].shape[0]
    with pytest.raises(InputError, match=r"slot_mapping.*>= -"):
        _store({**inp, "slots": torch.where(inp["slots"] == -1, -rows - 1, inp["slots"])})
    with pytest.raises(InputError, match=r"slot_mapping.*twice"):  # -1 and rows - 1 are one row
        _store({**inp, "slots": torch.where(inp["slots"] == inp["slots"][inp["slots"] >= 0][0], rows - 1,
                                            inp["slots"])})
    with pytest.raises(InputError, match=r"cache.*\[rows, 512\]"):
        _store({**inp, "cache": inp["cache"][:, :256]})
    with pytest.raises(InputError, match=r"slots.*one slot per kv row"):
        _store({**inp, "slots": inp["slots"][:-1]})
