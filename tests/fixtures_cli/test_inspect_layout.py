"""inspect --layout detect: tell V4 584-byte pages from V4.1 528/288-byte caches and their byte
order (hazard H13), and a writer/reader byte-order disagreement as a failing, explained diff."""

from __future__ import annotations

import pytest
import torch

from dsv4_numerics.cli import main
from dsv4_numerics.inspect.layout import detect_layout
from dsv4_numerics.oracles.bytes_diff_v41 import diff_v41
from dsv4_numerics.reference.caches import model1 as cache_model1
from dsv4_numerics.reference.caches import v41 as cache_v41
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.reference.policies import V41Layout, V41Record

BS, NB = 16, 3


def _rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 512, generator=g) * torch.logspace(-3, 2, n).unsqueeze(1)).to(torch.bfloat16)


def _slots(n: int) -> torch.Tensor:
    return torch.randperm(NB * BS, generator=torch.Generator().manual_seed(1))[:n]


def _v41(record: V41Record, layout: V41Layout, n: int = 20) -> torch.Tensor:
    return cache_v41.insert(cache_v41.empty_cache(NB, BS, record), _rows(n, 2), _slots(n), BS, record, layout)


@pytest.mark.parametrize("record", list(V41Record))
@pytest.mark.parametrize("layout", list(V41Layout))
def test_each_v41_layout_is_told_apart_with_a_reason(record, layout):
    v = detect_layout(_v41(record, layout), BS)
    want = f"v41_{record.value}_{layout.value}"
    assert v.best == want, v.reason
    scores = {s.name: s for s in v.scores}
    assert scores[want].plausible == scores[want].written == 20
    other = [s for s in v.scores if s.name != want]
    assert all(s.fraction < 0.2 for s in other), [(s.name, s.plausible, s.written) for s in other]
    assert want in v.reason and "plausible scale bytes" in v.reason


def _stale(nb: int, bs: int, record: V41Record, seed: int, tail: int = 0) -> torch.Tensor:
    """A pool reused by a server: every byte stale (random), as the reference's own write cases hold."""
    stride = bs * cache_v41.record_bytes(record) + tail
    return torch.randint(0, 256, (nb, stride), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


@pytest.mark.parametrize("layout", list(V41Layout))
def test_the_reference_nvfp4_write_case_is_told_in_both_orders(layout):
    # v41_write's own NVFP4 case: 50 of 128 slots written over a stale pool, 64 entries per page
    from dsv4_numerics.reference.cases import default_cases

    c = next(c for c in default_cases("v41_write") if c.name == "nvfp4-bs64-ties-realistic")
    i = c.inputs
    cache = cache_v41.insert(i["cache"].clone(), i["k"], i["slot_mapping"], i["block_size"], i["record"], layout)
    v = detect_layout(cache, i["block_size"])
    assert v.best == f"v41_nvfp4_288_{layout.value}", v.reason
    assert "50 slots have plausible scale bytes" in v.reason and "look unwritten" in v.reason


@pytest.mark.parametrize("record", list(V41Record))
@pytest.mark.parametrize("layout", list(V41Layout))
@pytest.mark.parametrize("bs, nb, n, tail", [(3, 8, 20, 0), (7, 4, 12, 40), (17, 2, 30, 0), (33, 3, 40, 8), (64, 16, 12, 0)])
def test_odd_page_sizes_and_mostly_stale_pools(record, layout, bs, nb, n, tail):
    # (64, 16, 12): 12 written slots of 1024, the rest stale bytes
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(bs))[:n]
    cache = cache_v41.insert(_stale(nb, bs, record, bs + n, tail), _rows(n, 7), slots, bs, record, layout)
    v = detect_layout(cache, bs)
    assert v.best == f"v41_{record.value}_{layout.value}", v.reason
    zero = cache_v41.insert(cache_v41.empty_cache(nb, bs, record, bs * cache_v41.record_bytes(record) + tail),
                            _rows(n, 7), slots, bs, record, layout)
    assert detect_layout(zero, bs).best == f"v41_{record.value}_{layout.value}"


@pytest.mark.parametrize("layout", list(V41Layout))
def test_too_few_written_slots_say_what_is_missing(layout):
    # two written slots in a stale pool: not enough to tell the orders apart, and the verdict says so
    record, bs = V41Record.NVFP4, 16
    cache = cache_v41.insert(_stale(4, bs, record, 9), _rows(2, 8), torch.tensor([5, 40]), bs, record, layout)
    v = detect_layout(cache, bs)
    assert v.best is None
    assert f"v41_nvfp4_288_{layout.value}" in v.reason and "a verdict needs at least 4" in v.reason
    assert "more written entries per page would tell" in v.reason


def test_a_stale_pool_with_nothing_written_names_what_to_check():
    v = detect_layout(_stale(4, 16, V41Record.MXFP8, 3), 16)
    assert v.best is None and "no written slot found" in v.reason and "page size (16)" in v.reason


def test_constant_rows_read_in_the_wrong_order_are_not_a_verdict():
    # one constant NVFP4 row: its 256 equal code bytes read as 8 page-footer scale windows that
    # pass; the one true slot cannot outweigh them, so no verdict -- never the wrong one
    record, bs = V41Record.NVFP4, 63
    k = torch.full((1, 512), 3.0, dtype=torch.bfloat16)
    cache = cache_v41.insert(_stale(4, bs, record, 1), k, torch.tensor([70]), bs, record, V41Layout.INTERLEAVED)
    assert detect_layout(cache, bs).best in (None, "v41_nvfp4_288_interleaved")


def test_v4_model1_pages_are_not_taken_for_v41():
    cache = cache_model1.insert(cache_model1.empty_cache(NB, BS), _rows(20, 3), _slots(20), BS, "amax_clamp")
    v = detect_layout(cache, BS)
    assert v.best == "model1_584", v.reason


def test_one_entry_per_page_leaves_the_byte_order_undetermined():
    cache = cache_v41.insert(cache_v41.empty_cache(8, 1, V41Record.MXFP8), _rows(5, 4), torch.arange(5), 1,
                             V41Record.MXFP8, V41Layout.PAGE_FOOTER)
    v = detect_layout(cache, 1)
    assert v.best is None and "coincide" in v.reason


def test_an_empty_cache_has_no_verdict_and_bad_input_is_named():
    assert detect_layout(cache_v41.empty_cache(2, 4, V41Record.NVFP4), 4).best is None
    with pytest.raises(InputError, match="'block_size'"):
        detect_layout(torch.zeros(2, 100, dtype=torch.uint8))


@pytest.mark.parametrize("record", list(V41Record))
def test_reader_writer_byte_order_disagreement_is_a_failing_named_diff(record):
    n = 12
    k, slots = _rows(n, 5), _slots(n)
    expected = cache_v41.insert(cache_v41.empty_cache(NB, BS, record), k, slots, BS, record, V41Layout.INTERLEAVED)
    got = cache_v41.insert(cache_v41.empty_cache(NB, BS, record), k, slots, BS, record, V41Layout.PAGE_FOOTER)
    rep = diff_v41(expected, got, slots, BS, record, V41Layout.INTERLEAVED)
    assert not rep.passed and rep.differing_records == n
    assert "layout=page_footer (FlashInfer 0.7.2)" in rep.message
    assert "read as layout=interleaved (vLLM 0.33.0" in rep.message
    assert diff_v41(expected, expected.clone(), slots, BS, record, V41Layout.INTERLEAVED).passed
    # a different defect (one scale byte) is reported but not blamed on the byte order
    bad = expected.clone()
    _, sa = cache_v41.slot_addresses(slots[:1], BS, bad.stride(0), record, V41Layout.INTERLEAVED)
    bad.view(-1)[int(sa[0])] ^= 1
    rep = diff_v41(expected, bad, slots, BS, record, V41Layout.INTERLEAVED)
    assert not rep.passed and rep.differing == 1 and not rep.explanations
    assert rep.differences[0].where == {"slot": int(slots[0]), "part": "scale", "group": 0}


def test_cli_detect(tmp_path, capsys):
    raw = tmp_path / "v41.bin"
    raw.write_bytes(_v41(V41Record.NVFP4, V41Layout.PAGE_FOOTER).numpy().tobytes())
    stride = BS * 288
    assert main(["inspect", str(raw), "--layout", "detect", "--page-size", str(BS), "--stride", str(stride)]) == 0
    out = capsys.readouterr().out
    assert "layout: v41_nvfp4_288_page_footer" in out and "v41_nvfp4_288_interleaved" in out
    empty = tmp_path / "empty.bin"
    empty.write_bytes(bytes(NB * stride))
    assert main(["inspect", str(empty), "--layout", "detect", "--page-size", str(BS), "--stride", str(stride)]) == 1


def test_explain_names_the_flashinfer_page_footer_contract():
    # a writer with FlashInfer 0.7.2's whole contract (page footer, Q_S, fl32(amax / 6)) judged
    # under the stage's vLLM defaults: explain finds the policy set that names it
    from dsv4_numerics.api.testing import explain

    def flashinfer_writer(inp):
        return {"cache": cache_v41.insert(inp["cache"], inp["k"], inp["slot_mapping"], inp["block_size"],
                                          inp["record"], "page_footer", mxfp8_rule="scale_clamp", nvfp4_rule="div_rn")}

    ex = explain(flashinfer_writer, "v41_write")
    assert ex.matches and all(m["v41_layout"] == "page_footer" and m["scale_rule"] == "scale_clamp" for m in ex.matches)
    assert "v41_layout=page_footer" in str(ex)
