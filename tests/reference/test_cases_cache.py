"""The default cases of the cache stages: deterministic, small, valid, and covering the edge
cases they promise (tiny tiles, ties, signed zeros, subnormal codes, production geometry)."""

from __future__ import annotations

import json

import pytest
import torch

from dsv4_numerics.reference.caches.model1 import gather, insert, page_bytes
from dsv4_numerics.reference.caches.plain import insert_bf16_rows, insert_fp8_rows
from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.constants import RECORD_BYTES, TINY_TILE_AMAX
from dsv4_numerics.reference.policies import ScaleRule

STAGES = ("swa_write", "compressed_write", "plain_write", "gather")


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a, b.view(torch.uint8) if b.dtype != torch.bool else b)
    return a == b


@pytest.mark.parametrize("stage", STAGES)
def test_cases_deterministic_small_named(stage):
    first, second = default_cases(stage), default_cases(stage)
    assert len(first) >= 4
    names = [c.name for c in first]
    assert len(set(names)) == len(names)
    for a, b in zip(first, second):
        assert a.name == b.name and a.stage == stage and a.params == b.params
        assert a.inputs.keys() == b.inputs.keys()
        for key in a.inputs:
            assert _same(a.inputs[key], b.inputs[key]), (a.name, key)
        json.dumps(a.params)
        if "k" in a.inputs:
            assert a.inputs["k"].shape[0] <= 256 and a.inputs["k"].dtype == torch.bfloat16


@pytest.mark.parametrize("stage", ["swa_write", "compressed_write"])
def test_write_cases_valid_and_insertable(stage):
    for case in default_cases(stage):
        inp = case.inputs
        bs, nb, stride = inp["block_size"], inp["num_blocks"], inp["page_stride"]
        s = inp["slot_mapping"]
        written = s[s >= 0]
        assert written.unique().numel() == written.numel() and int(written.max()) < nb * bs
        assert inp["cache"].shape == (nb, stride) and stride >= bs * RECORD_BYTES
        assert inp["k"].shape == (s.shape[0], 512)
        before = inp["cache"].clone()
        for rule in ScaleRule:
            out = insert(inp["cache"], inp["k"], s, bs, rule)
            assert out.shape == before.shape
        assert torch.equal(inp["cache"], before)


def _tile_amax(k: torch.Tensor) -> torch.Tensor:
    return k[:, :448].float().abs().reshape(-1, 7, 64).amax(-1)


def test_write_cases_cover_promised_edges():
    cases = default_cases("swa_write") + default_cases("compressed_write")
    geoms = {(c.inputs["block_size"], c.inputs["page_stride"]) for c in cases}
    assert (64, 37440) in geoms and (2, 1728) in geoms  # production geometry (datapath 1.2)
    assert any(bs * RECORD_BYTES == st for bs, st in geoms)  # unpadded stride
    assert {53, 61} <= {bs for bs, _ in geoms}  # odd block sizes
    allk = torch.cat([c.inputs["k"] for c in cases])
    amax = _tile_amax(allk)
    assert (amax == 0).any() and ((amax > 0) & (amax <= TINY_TILE_AMAX)).any()  # zero and tiny tiles
    ties = amax / 1.75
    m = torch.log2(ties).round()
    assert (ties == torch.exp2(m)).sum() >= 20  # exact ties 1.75 * 2**m
    nope = allk[:, :448]
    assert (torch.signbit(nope.float()) & (nope == 0)).any()  # -0.0 elements
    # subnormal E4M3 codes occur in the encoded bytes
    c = cases[2]
    out = insert(c.inputs["cache"], c.inputs["k"], c.inputs["slot_mapping"], c.inputs["block_size"], ScaleRule.AMAX_CLAMP)
    pb = page_bytes(out, c.inputs["block_size"])
    data = pb[:, : c.inputs["block_size"] * 576].reshape(-1, 576)[:, :448]
    assert (((data & 0x7F) >= 1) & ((data & 0x7F) <= 7)).any()
    # the tiny-ties case really separates the two rules (H1): some written rows differ in bytes
    c = cases[1]
    args = (c.inputs["cache"], c.inputs["k"], c.inputs["slot_mapping"], c.inputs["block_size"])
    assert not torch.equal(insert(*args, ScaleRule.AMAX_CLAMP), insert(*args, ScaleRule.SCALE_CLAMP))


def test_gather_cases_read_only_written_positions():
    for case in default_cases("gather"):
        inp = case.inputs
        bs = inp["block_size"]
        seq = inp["seq_lens"].tolist()
        gl = seq if inp["gather_lens"] is None else inp["gather_lens"].tolist()
        written = set(inp["written_slots"].tolist())
        for b, (L, g) in enumerate(zip(seq, gl)):
            for p in range(L - g, L):
                assert int(inp["block_table"][b, p // bs]) * bs + p % bs in written
        out, valid = gather(inp["cache"], inp["block_table"], inp["seq_lens"], bs, inp["gather_lens"])
        assert valid.sum().item() == sum(gl)
        assert torch.isfinite(out[valid].float()).all()


def test_plain_cases_insertable():
    cases = default_cases("plain_write")
    assert {c.inputs["layout"] for c in cases} == {"bf16", "fp8"}
    assert any(c.params["saturating_rows"] and c.inputs["k"].float().abs().max() > 448 for c in cases)
    for c in cases:
        inp = c.inputs
        if inp["layout"] == "bf16":
            insert_bf16_rows(inp["cache"], inp["k"], inp["slot_mapping"])
        else:
            insert_fp8_rows(inp["cache"], inp["k"], inp["slot_mapping"], kv_scale=inp["kv_scale"])
