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
