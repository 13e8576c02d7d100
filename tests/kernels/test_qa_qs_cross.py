"""Q_A (SWA writer) against Q_S (compressor) on tiny-amax tiles, end to end (spec datapath 2.4, H1).

The same bf16 rows go through two producers that write the same 584-byte MODEL1 record:

* the SWA writer under ``scale_rule = amax_clamp`` (Q_A: ``e = ceil(log2(max(amax, 1e-4) / 448))``);
* the compressor's cache write under ``scale_rule = scale_clamp`` (Q_S: ``e = ceil(log2(max(amax /
  448, 1e-4)))``).

For a 64-wide tile with ``amax <= 0.02734375`` (= 448 * 2^-14) the two rules give different scale
bytes (Q_S floors at byte 114; Q_A goes down to 105) and therefore different FP8 codes;
``oracles.bytes_diff.diff_model1`` must name ``scale_rule=scale_clamp`` as the explanation of the
cross difference. The rows are built so that the compressor's own boundary rows have chosen tile
amaxes: the RMSNorm weight of each NoPE tile is scaled (the normed row has RMS 1, so the tile
amax follows its weight).

* CPU: both producers are the reference (``cache_model1.insert`` under each rule), which checks
  the construction and that ``bytes_diff`` names the policy -- so the GPU test cannot pass vacuously.
* GPU (sm90 and newer, the real kernels): ``cutedsl.compressor`` writes the compressed records
  from the compressor state; its boundary rows (reference, bf16) go through
  ``vllm_triton.quantize_and_insert_k_cache`` (the Triton SWA writer, Q_A); each is judged under
  its own declared rule and the cross comparison is explained. The observed scale bytes per tile
  are printed and, with ``DSV4_CROSS_OUT=DIR``, written to ``DIR/qa_qs_cross.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from dsv4_numerics.oracles.bytes_diff import diff_model1
from dsv4_numerics.reference.caches.model1 import insert
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.pipeline.compressor import compressor_boundary
from dsv4_numerics.reference.constants import HEAD_DIM, NOPE_DIM, RECORD_BYTES, TILE, TINY_TILE_AMAX

from .test_fuzz_writers import CompressorSpec
from .conftest import entry_or_skip

# Per NoPE tile: the RMSNorm weight factor (normed |x| is up to ~4, so tile amax ~ 4 * factor):
# a normal tile, then tiles well inside the tiny range, at the 1e-4 floor, and an all-zero tile.
TILE_WEIGHTS = (0.5, 0.005, 0.002, 2.0e-4, 2.0e-5, 1.0e-7, 0.0)
SPEC = CompressorSpec(4, (37, 20), (9, 4), 4, 64, 5)  # vLLM C4 geometry (state pages 4, C4 pages 64)


def _inputs():
    inputs, dense = SPEC.build()
    w = torch.ones(HEAD_DIM, dtype=torch.float32)
    for t, f in enumerate(TILE_WEIGHTS):
        w[t * TILE:(t + 1) * TILE] = f
    inputs["rms_norm_weight"] = w.to(torch.bfloat16)
    return inputs, dense


def _boundary_rows(inputs, dense, arithmetic: str):
    """Reference bf16 boundary rows (RoPE applied) and compressed slots, in write order."""
    pos, slots, cs = inputs["positions"], inputs["slot_mapping"], inputs["compressed_slot_mapping"]
    req = inputs["token_to_req_indices"].long()
    fires = (slots >= 0) & ((pos + 1) % SPEC.ratio == 0) & (cs >= 0)
    rows, written = [], []
    for r in range(len(SPEC.seq_lens)):
        sel = fires & (req == r)
        if bool(sel.any()):
            b = compressor_boundary(dense[r], pos[sel], SPEC.ratio, inputs["rms_norm_weight"],
                                    inputs["rms_norm_eps"], inputs["cos_sin_cache"], arithmetic)
            rows.append(b.row_bf16)
            written.append(cs[sel])
    return torch.cat(rows), torch.cat(written)


def _scale_bytes(cache: torch.Tensor, slots: torch.Tensor, bs: int) -> list[list[int]]:
    """The 7 UE8M0 scale bytes of each written slot (MODEL1: a page's scale rows follow its data rows)."""
    flat = cache.reshape(cache.shape[0], -1).cpu()
    out = []
    for s in slots.tolist():
        page, e = divmod(int(s), bs)
        off = bs * (RECORD_BYTES - 8) + e * 8
        out.append([int(v) for v in flat[page, off:off + 7]])
    return out


def _tile_amax(rows: torch.Tensor) -> list[list[float]]:
    nope = rows[:, :NOPE_DIM].float().abs().reshape(rows.shape[0], -1, TILE)
    return nope.amax(-1).tolist()


def _cross(qa_cache, qs_cache, rows, slots):
    return diff_model1(qa_cache.cpu(), qs_cache.cpu(), block_size=SPEC.kv_block_size, slots=slots.cpu(),
                       source_rows=rows.cpu(), policies={"scale_rule": "amax_clamp"})


def _assert_tiny_tiles_named(rep, amax):
    tiny = [(i, t) for i, row in enumerate(amax) for t, a in enumerate(row) if 0 < a <= TINY_TILE_AMAX]
    assert tiny, "the construction must produce tiny-amax tiles"
    assert not rep.passed, "Q_A and Q_S must differ on tiny tiles"
    text = " ".join(rep.explanations) + " " + rep.summary(64)
    assert "scale_rule=scale_clamp" in text, text[:2000]


def test_cross_reference_only_names_scale_rule():
    inputs, dense = _inputs()
    rows, slots = _boundary_rows(inputs, dense, "separate")
    amax = _tile_amax(rows)
    assert amax[0][0] > TINY_TILE_AMAX  # the normal tile stays normal
    init = inputs["cache"]
    qa = insert(init, rows, slots, SPEC.kv_block_size, "amax_clamp")
    qs = insert(init, rows, slots, SPEC.kv_block_size, "scale_clamp")
    _assert_tiny_tiles_named(_cross(qa, qs, rows, slots), amax)
    a, s = _scale_bytes(qa, slots, SPEC.kv_block_size), _scale_bytes(qs, slots, SPEC.kv_block_size)
    assert all(x[0] == y[0] for x, y in zip(a, s))  # the normal tile: one rule, one byte
    assert all(min(y[1:]) >= 114 for y in s) and min(min(x[1:]) for x in a) < 114


@pytest.mark.sm90
@pytest.mark.gpu
def test_cross_real_compressor_and_swa_writer():
    comp = entry_or_skip("cutedsl.compressor")
    swa = entry_or_skip("vllm_triton.quantize_and_insert_k_cache")
    inputs, dense = _inputs()
    rows, slots = _boundary_rows(inputs, dense, "separate")
    amax = _tile_amax(rows)
    init = inputs["cache"].clone()
    # the real compressor (Q_S) from the compressor state
    qs_got = comp.call(Case("cross", "compressor", inputs, {}).to("cuda"))["cache"].cpu()
    # the real SWA writer (Q_A) on the compressor's boundary rows, into the same initial cache
    swa_in = {"k": rows, "cache": init.clone(), "slot_mapping": slots, "block_size": SPEC.kv_block_size}
    qa_got = swa.call(Case("cross", "swa_write", swa_in, {}).to("cuda"))["cache"].cpu()
    # each judged under its own declared rule (the compressor's rows: exact codes only from the bf16
    # boundary, so its scale bytes are what is pinned here)
    qa_ref = insert(init, rows, slots, SPEC.kv_block_size, "amax_clamp")
    qs_ref = insert(init, rows, slots, SPEC.kv_block_size, "scale_clamp")
    own_qa = diff_model1(qa_ref, qa_got, block_size=SPEC.kv_block_size, slots=slots, initial=init)
    got_a, got_s = _scale_bytes(qa_got, slots, SPEC.kv_block_size), _scale_bytes(qs_got, slots, SPEC.kv_block_size)
    ref_s = _scale_bytes(qs_ref, slots, SPEC.kv_block_size)
    cross = _cross(qa_got, qs_got, rows, slots)
    record = {"tile_amax": amax, "swa_writer_q_a_scale_bytes": got_a, "compressor_q_s_scale_bytes": got_s,
              "reference_q_s_scale_bytes": ref_s, "swa_writer_vs_q_a_reference": own_qa.summary(8),
              "cross_explanations": cross.explanations[:16], "cross_summary": cross.summary(16)}
    print(json.dumps(record, indent=None))
    out = os.environ.get("DSV4_CROSS_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "qa_qs_cross.json").write_text(json.dumps(record, indent=1))
    assert own_qa.passed, own_qa.summary()
    assert got_s == ref_s, f"compressor scale bytes {got_s} != Q_S reference {ref_s}"
    _assert_tiny_tiles_named(cross, amax)
