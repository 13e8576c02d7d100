"""inspect: decode a hand-built 584-byte cache and flag impossible content (datapath 1.1-1.3)."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from dsv4_numerics.inspect import cache as ic
from dsv4_numerics.fixtures import store
from dsv4_numerics.cli import main
from dsv4_numerics.reference.errors import InputError

BS, NB = 2, 3
STRIDE = BS * 584 + 16  # 1184: a padded page (any stride >= bs*584 is legal)


def _record(buf: bytearray, slot: int, code: int = 0x38, scale: int = 127, pad: int = 0, rope_bits: int = 0x3F80):
    """Write one record by hand. Addresses (datapath 1.3): data row at page*P + e*576, scale row
    at page*P + bs*576 + e*8. Code 0x38 = E4M3FN 1.0 (exponent field 7 = bias, mantissa 0);
    scale byte 127 = 2**0; bf16 0x3F80 = 1.0."""
    page, e = divmod(slot, BS)
    d = page * STRIDE + e * 576
    buf[d:d + 448] = bytes([code]) * 448
    buf[d + 448:d + 576] = struct.pack("<H", rope_bits) * 64
    s = page * STRIDE + BS * 576 + e * 8
    buf[s:s + 8] = bytes([scale] * 7 + [pad])
    return d, s


def hand_cache() -> bytearray:
    buf = bytearray(NB * STRIDE)
    _record(buf, 0)  # clean: every value 1.0
    _, s = _record(buf, 1)
    buf[s + 3] = 0  # slot 1: tile 3 scale byte 0
    _record(buf, 2, pad=5)  # slot 2: pad byte 5 from a vLLM writer
    d, _ = _record(buf, 3)
    buf[d + 10] = 0x7F  # slot 3: NaN code at dim 10
    d, _ = _record(buf, 4)
    buf[d + 448 + 2 * 7:d + 448 + 2 * 8] = struct.pack("<H", 0x7FC0)  # slot 4: RoPE dim 455 = NaN
    # slot 5 stays all zero: never written
    buf[BS * 584] = 0xAA  # stale byte in page 0's padding: info only
    return buf


def test_hand_built_cache_table_and_flags():
    rep = ic.inspect_cache(torch.frombuffer(hand_cache(), dtype=torch.uint8), BS, STRIDE)
    assert (rep.num_blocks, rep.block_size, rep.page_stride) == (3, 2, 1184)
    assert rep.empty_slots == 1 and [r.slot for r in rep.rows] == [0, 1, 2, 3, 4]
    assert rep.tail_nonzero_bytes == 1
    r0, r1 = rep.rows[0], rep.rows[1]
    assert r0.scale_bytes == [127] * 7 and r0.pad == 0 and r0.flags == []
    assert r0.tile_max == [1.0] * 7 and r0.nope_absmax == 1.0 and (r0.rope_min, r0.rope_max) == (1.0, 1.0)
    # scale byte 0 decodes (EXACT reading) to 2**-127: tile 3's max is 1.0 * 2**-127
    assert r1.tile_max[3] == math.ldexp(1.0, -127)
    assert rep.impossible == {"scale-byte-0": [1], "pad-byte-nonzero": [2], "nan-code": [3], "nan-rope": [4]}
    assert math.isnan(rep.rows[3].tile_max[0]) and rep.rows[3].tile_max[1] == 1.0
    assert rep.flag_slots["scale-out-of-range"] == []


def test_producer_and_flavour_change_what_is_impossible():
    t = torch.frombuffer(hand_cache(), dtype=torch.uint8)
    assert "pad-byte-nonzero" not in ic.inspect_cache(t, BS, STRIDE, producer="flashmla").impossible
    # E4M3FNUZ: 0x7F is 240 (finite), 0x80 is the NaN code -> slot 3 is no longer flagged
    rep = ic.inspect_cache(t, BS, STRIDE, fp8="e4m3fnuz")
    assert "nan-code" not in rep.impossible
    assert rep.rows[3].tile_max[0] == 240.0


def test_scale_255_and_out_of_range_warning():
    buf = bytearray(BS * 584)
    _, s = _record(buf, 0, scale=120)
    buf[s] = 255  # tile 0: the UE8M0 NaN byte
    _, s = _record(buf, 1, scale=104)  # 104 < 105: below the finite-input range -> warning only
    rep = ic.inspect_cache(torch.frombuffer(buf, dtype=torch.uint8).reshape(1, -1), BS)
    assert rep.impossible == {"scale-byte-255": [0]}
    assert rep.flag_slots["scale-out-of-range"] == [1]


def test_kernel_view_and_slot_selection():
    page = torch.frombuffer(hand_cache(), dtype=torch.uint8).reshape(NB, STRIDE)
    view = torch.as_strided(page, (NB, BS, 584), (STRIDE, 584, 1))
    rep = ic.inspect_cache(view, slots="3-4")
    assert rep.page_stride == STRIDE and [r.slot for r in rep.rows] == [3, 4]
    assert rep.impossible == {"nan-code": [3], "nan-rope": [4]}


@pytest.mark.parametrize("kwargs, msg", [
    ({"block_size": 2, "page_stride": 1000}, "does not divide"),
    ({"block_size": 2, "page_stride": 1184 * 3 // 4}, "must be >= block_size\\*584"),
    ({"block_size": None, "page_stride": 1184}, "'block_size'.*required"),
    ({"block_size": 0, "page_stride": 1184}, "'block_size' must be an int >= 1"),
])
def test_bad_geometry_raises_naming_the_argument(kwargs, msg):
    with pytest.raises(InputError, match=msg):
        ic.inspect_cache(torch.frombuffer(hand_cache(), dtype=torch.uint8), **kwargs)


def test_cli_inspect_raw_and_safetensors(tmp_path, capsys):
    raw = tmp_path / "cache.bin"
    raw.write_bytes(bytes(hand_cache()))
    assert main(["inspect", str(raw), "--page-size", "2", "--stride", str(STRIDE)]) == 1
    out = capsys.readouterr().out
    assert "IMPOSSIBLE: scale-byte-0 in 1 slot(s): 1" in out
    assert "IMPOSSIBLE: pad-byte-nonzero in 1 slot(s): 2" in out
    assert "IMPOSSIBLE: nan-code in 1 slot(s): 3" in out and "IMPOSSIBLE: nan-rope in 1 slot(s): 4" in out
    clean = bytearray(BS * 584)
    _record(clean, 0)
    st = tmp_path / "clean.safetensors"
    st.write_bytes(store.encode_safetensors({"k_cache": torch.frombuffer(clean, dtype=torch.uint8).reshape(1, -1)}))
    assert main(["inspect", str(st), "--page-size", "2"]) == 0
    assert "no impossible content found" in capsys.readouterr().out


@pytest.mark.parametrize("argv, msg", [
    (["inspect", "{raw}", "--page-size", "2", "--stride", "1000"], "does not divide the dump length"),
    (["inspect", "{raw}", "--page-size", "2"], "'page_stride' (--stride) is required"),
    (["inspect", "{raw}", "--page-size", "2", "--stride", str(STRIDE), "--layout", "v4.1"], "'layout' must be one of"),
    (["inspect", "{missing}"], "does not exist"),
])
def test_cli_inspect_user_errors_are_one_line(tmp_path, capsys, argv, msg):
    raw = tmp_path / "cache.bin"
    raw.write_bytes(bytes(hand_cache()))
    argv = [a.format(raw=raw, missing=tmp_path / "nope.bin") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dsv4-numerics: error: ") and msg in err
