"""Decoded, explained byte diffs on hand-built MODEL1 pages, index tensors and other layouts.

Caches are built byte by byte here with the datapath 1.3 address formula (not with the
reference writer), so the expected bytes are independent of the code under test.
"""

from __future__ import annotations

import torch

from dsv4_numerics.oracles import bytes_diff as bd

BS = 2
STRIDE = 2 * 584 + 16  # a padded page stride (datapath 1.2: any stride >= bs*584)


def _page_cache(fill=0):
    return torch.full((2, STRIDE), fill, dtype=torch.uint8)


def _data(slot, i):  # datapath 1.3: page*P + e*576 + i
    return (slot // BS) * STRIDE + (slot % BS) * 576 + i


def _scale(slot, b):  # datapath 1.3: page*P + bs*576 + e*8 + b
    return (slot // BS) * STRIDE + BS * 576 + (slot % BS) * 8 + b


def _put(cache, slot, codes: dict, scales: list, pad=0):
    flat = cache.view(-1)
    for i, c in codes.items():
        flat[_data(slot, i)] = c
    for b, s in enumerate(scales):
        flat[_scale(slot, b)] = s
    flat[_scale(slot, 7)] = pad


def _row(**vals):
    x = torch.zeros(1, 512, dtype=torch.bfloat16)
    for i, v in vals.items():
        x[0, int(i[1:])] = v
    return x


def test_tiny_tile_explained_as_scale_clamp():
    # tile 0 of slot 3 holds x[0] = 165 * 2^-13 = 0.0201416015625 (a bf16 value), the rest 0.
    # Q_A: r = fl32(0.0201416/448) = 4.4959e-5, log2 = -14.44 -> e = -14 -> byte 113;
    #      x * 2^14 = 330 -> e4m3 grid step 32 in [256, 512): 330/32 = 10.31 -> 320 = 1.25*2^8 -> 0x7A
    # Q_S: r = max(4.4959e-5, 1e-4) = 1e-4, log2 = -13.29 -> e = -13 -> byte 114;
    #      x * 2^13 = 165 -> step 16 in [128, 256): 165/16 = 10.31 -> 160 = 1.25*2^7 -> 0x72
    # zero tiles: Q_A r = 1e-4/448 = 2.23e-7 -> e = -22 -> 105; Q_S r = 1e-4 -> 114.
    init = _page_cache(0)
    exp, got = init.clone(), init.clone()
    _put(exp, 3, {0: 0x7A}, [113] + [105] * 6)
    _put(got, 3, {0: 0x72}, [114] * 7)
    x = _row(d0=0.0201416015625)
    rep = bd.diff_model1(exp, got, block_size=BS, slots=torch.tensor([3]), source_rows=x,
                         policies={"scale_rule": "amax_clamp"}, initial=init)
    assert not rep.passed
    assert (rep.differing, rep.differing_records, rep.differing_tiles, rep.clobbered) == (8, 1, 7, 0)
    assert rep.compared == 583
    assert "tile amax 0.0201416: bytes match scale_rule=scale_clamp; reference used scale_rule=amax_clamp" in rep.message
    scale0 = next(d for d in rep.differences if d.where["part"] == "scale" and d.where["tile"] == 0)
    assert (scale0.expected, scale0.got) == (113, 114)
    assert scale0.where["page"] == 1 and scale0.where["entry"] == 1 and scale0.where["offset"] == _scale(3, 0)
    code0 = next(d for d in rep.differences if d.where["part"] == "code")
    assert code0.expected == ["0x7A"] and code0.got == ["0x72"]
    # decoded values: 320 * 2^-14 = 160 * 2^-13 = 0.01953125 (same value, different encoding)
    assert code0.expected_value == [0.01953125] and code0.got_value == [0.01953125]


def test_nan_element_explained_as_cuda_satfinite():
    # tile [NaN, 1.5, 0, ...]. Reference = torch behaviour: NaN-propagating amax -> scale 255 and
    # every code 0x7F. CUDA writer: amax ignores NaN (1.5): r = 1.5/448 -> e = ceil(-8.22) = -8 ->
    # byte 119; 1.5 * 2^8 = 384 = 1.5*2^8 -> E = 8+7 = 15, m = 4 -> 0x7C; NaN -> fmaxf(NaN,-448) = -448 -> 0xFE.
    x = torch.zeros(64, dtype=torch.bfloat16)
    x[0], x[1] = float("nan"), 1.5
    got = torch.zeros(64, dtype=torch.uint8)
    got[0], got[1] = 0xFE, 0x7C
    msg = bd.explain_tile(x, got, 119, {"nonfinite": "torch"})
    assert msg.endswith("bytes match nonfinite=cuda_satfinite; reference used nonfinite=torch"), msg


def test_pad_byte_and_page_tail_are_not_defined_bytes():
    init = _page_cache(0xAA)
    exp = init.clone()
    _put(exp, 0, {}, [105] * 7, pad=0)
    got = exp.clone()
    got.view(-1)[_scale(0, 7)] = 0x5C  # pad byte: FlashMLA's quantiser leaves it uninitialised
    assert bd.diff_model1(exp, got, block_size=BS, slots=torch.tensor([0]), initial=init).passed
    assert not bd.diff_model1(exp, got, block_size=BS, slots=torch.tensor([0]), include_pad=True).passed
    got.view(-1)[BS * 584 + 3] = 0  # page 0 tail: stale bytes, never written by any producer
    assert bd.diff_model1(exp, got, block_size=BS, slots=torch.tensor([0])).passed
    rep = bd.diff_model1(exp, got, block_size=BS, slots=torch.tensor([0]), initial=init)
    assert not rep.passed and rep.clobbered == 1 and rep.differing == 0
    assert rep.differences[0].where["part"] == "page_tail"


def test_write_to_the_wrong_slot_is_located_and_explained():
    # the record of token 1 belongs in slot 0; the kernel wrote it to slot 1 (e.g. -1 -> 0 style
    # address bugs land in a slot the reference never writes)
    init = _page_cache(0x11)
    exp, got = init.clone(), init.clone()
    _put(exp, 2, {5: 0x40}, [120] * 7)
    _put(exp, 0, {7: 0x38}, [121] * 7)
    _put(got, 2, {5: 0x40}, [120] * 7)
    _put(got, 1, {7: 0x38}, [121] * 7)
    rep = bd.diff_model1(exp, got, block_size=BS, slots=torch.tensor([2, 0]), initial=init)
    assert not rep.passed and rep.differing_records == 1
    assert "slot 1 (not written by the reference) holds the record expected at slot 0 (token 1)" in rep.explanations


def test_interleaved_and_packed_layouts_are_recognised():
    init = _page_cache(0)
    exp = init.clone()
    _put(exp, 0, {0: 0x40, 447: 0x41}, [120, 121, 122, 123, 124, 125, 126])
    _put(exp, 1, {3: 0x42}, [127] * 7)
    recs = {}
    for s in (0, 1):
        d = [exp.view(-1)[_data(s, i)].item() for i in range(576)]
        sc = [exp.view(-1)[_scale(s, b)].item() for b in range(8)]
        recs[s] = d + sc
    inter = init.clone()
    for s, r in recs.items():  # per-token interleaved: record e at e*584
        inter.view(-1)[s * 584: s * 584 + 584] = torch.tensor(r, dtype=torch.uint8)
    rep = bd.diff_model1(exp, inter, block_size=BS, slots=torch.tensor([0, 1]))
    assert any("interleaved" in e for e in rep.explanations), rep.summary()
    # page stride ignored: slot 2 (page 1) written at 1*bs*584 instead of 1*STRIDE
    exp2, packed = init.clone(), init.clone()
    _put(exp2, 2, {1: 0x40}, [119] * 7)
    flat = packed.view(-1)
    off = BS * 584  # page 1 base under the packed stride
    flat[off + 0 * 576 + 1] = 0x40
    flat[off + BS * 576: off + BS * 576 + 7] = 119
    rep = bd.diff_model1(exp2, packed, block_size=BS, slots=torch.tensor([2]))
    assert any("page stride ignored" in e for e in rep.explanations), rep.summary()


def test_index_diff_names_token_column_and_sentinel():
    exp = torch.tensor([[4, 9, -1, -1], [7, -1, -1, -1]], dtype=torch.int32)
    got = torch.tensor([[4, 9, 0, 0], [7, 0, 0, 0]], dtype=torch.int64)
    rep = bd.diff_index(exp, got, name="topk")
    assert not rep.passed and rep.differing == 5 and rep.differing_records == 2
    d = rep.differences[0]
    assert d.where == {"token": 0, "column": 2} and (d.expected, d.got) == (-1, 0)
    assert rep.message == "every differing entry should be the -1 sentinel; got 0 instead"
    assert bd.diff_index(exp, exp.to(torch.int64), name="topk").passed  # int32 vs int64, equal values
    assert not bd.diff_index(exp, exp[:1], name="topk").passed  # shape mismatch fails


def test_diff_values_locates_tile_and_rope_pair():
    e = torch.zeros(2, 512, dtype=torch.bfloat16)
    g = e.clone()
    g[1, 70] = 2.0**-133  # smallest bf16 subnormal: a 1-bit difference in NoPE tile 1
    g[0, 449] = -0.0       # -0.0 vs +0.0 differ in bits (RoPE pair 0)
    rep = bd.diff_values(e, g)
    assert rep.differing == 2
    w = {tuple(d.where["index"]): d for d in rep.differences}
    assert w[(1, 70)].where["tile"] == 1 and w[(1, 70)].got == "0x0001"
    assert w[(0, 449)].where == {"index": [0, 449], "dim": 449, "part": "rope", "pair": 0}
    assert w[(0, 449)].got == "0x8000"


def test_output_fp8_diff_names_token_group_head_block():
    hpg = 2
    codes = torch.zeros(1, 2, hpg * 512, dtype=torch.uint8)
    ex = torch.zeros(1, 2, hpg * 4, dtype=torch.int32)
    g_ex = ex.clone()
    g_ex[0, 1, 5] = 3  # group 1, block 5 = head 1*2 + 1 = 3, dims 128..255 of that head
    rep = bd.diff_output_fp8(codes, codes.clone(), ex, g_ex, heads_per_group=hpg)
    assert not rep.passed and rep.differing == 1
    d = rep.differences[0]
    assert d.where["head"] == 3 and d.where["block"] == 1 and d.where["dims"] == "128..255"
    assert (d.expected, d.got) == (127, 130)  # UE8M0 bytes: exponent + 127


def test_v32_row_scale_difference():
    rows = torch.zeros(1, 656, dtype=torch.uint8)
    got = rows.clone()
    got[0, 512 + 4 * 2 + 3] = 0x3F  # fp32 scale of tile 2, top byte: 0x3F000000 = 0.5
    rep = bd.diff_v32_rows(rows, got)
    assert rep.differing == 1 and rep.differences[0].where["tile"] == 2
    assert rep.differences[0].got == 0.5


def test_many_differences_list_the_first_in_order_and_count_the_rest():
    """A kernel that differs everywhere: the first ``max_items`` differences in row-major order,
    every other one counted in ``truncated``, the records (all but the last index; tokens for an
    index tensor) counted exactly -- the same report an element-by-element walk gives."""
    g = torch.Generator().manual_seed(3)
    e = torch.randn(6, 4, 512, generator=g).to(torch.bfloat16)
    got = e.clone()
    got[1:4] = got[1:4] * 2 + 1  # rows 4..15 of the 24 differ (wherever the value changes)
    neq = got.view(torch.int16) != e.view(torch.int16)
    rep = bd.diff_values(e, got, max_items=7)
    n = int(neq.sum())
    assert rep.differing == n and len(rep.differences) == 7 and rep.truncated == n - 7
    assert rep.differing_records == int(neq.reshape(-1, 512).any(dim=1).sum()) == 12
    assert [d.where["index"] for d in rep.differences] == neq.nonzero()[:7].tolist()
    assert all(d.where["part"] == "nope" for d in rep.differences)
    codes = torch.randint(0, 255, (5, 512), generator=g, dtype=torch.uint8)
    bad = codes.clone()
    bad[2, 100:300] ^= 1
    rep = bd.diff_plain_rows(codes, bad, fp8_scale=0.5, max_items=3)
    assert rep.differing == 200 and rep.differing_records == 1 and rep.truncated == 197
    assert [d.where["index"] for d in rep.differences] == [[2, 100], [2, 101], [2, 102]]
    idx = torch.arange(40).reshape(8, 5)
    wrong = idx.clone()
    wrong[[1, 1, 6], [0, 4, 2]] = -1
    rep = bd.diff_index(idx, wrong, max_items=2)
    assert rep.differing == 3 and rep.differing_records == 2 and rep.truncated == 1
    assert [d.where for d in rep.differences] == [{"token": 1, "column": 0}, {"token": 1, "column": 4}]
    lengths = torch.tensor([3, 0, 5])
    rep = bd.diff_index(lengths, torch.tensor([3, 1, 4]), max_items=64)
    assert rep.differing_records == 2 and [d.where for d in rep.differences] == [{"token": 1}, {"token": 2}]
