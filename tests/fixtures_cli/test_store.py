"""Store: deterministic safetensors bytes, strict parsing, skeletons, atomic writes, manifest."""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_numerics.fixtures import store
from dsv4_numerics.reference.errors import InputError


def test_known_bytes_of_a_tiny_file():
    # Worked out by hand from the safetensors format: 8-byte LE header length, the JSON header
    # (sorted keys, no spaces) padded with spaces to a multiple of 8, then the data.
    # u8 tensor [1, 2] and int32 [258] (LE bytes 02 01 00 00); keys sorted: "a" then "b".
    data = store.encode_safetensors(
        {"b": torch.tensor([258], dtype=torch.int32), "a": torch.tensor([1, 2], dtype=torch.uint8)},
        {"role": "x"},
    )
    header = ('{"__metadata__":{"role":"x"},'
              '"a":{"data_offsets":[0,2],"dtype":"U8","shape":[2]},'
              '"b":{"data_offsets":[2,6],"dtype":"I32","shape":[1]}}')
    pad = " " * (-len(header) % 8)
    want = struct.pack("<Q", len(header) + len(pad)) + (header + pad).encode() + bytes([1, 2, 2, 1, 0, 0])
    assert data == want


def test_library_reads_our_files_and_key_order_does_not_matter():
    from safetensors.torch import load

    ts = {
        "z": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "bf": torch.tensor([1.5, -0.0, float("inf")], dtype=torch.bfloat16),
        "f8": torch.tensor([0.5, -448.0], dtype=torch.float32).to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 4, dtype=torch.int64),
        "i": torch.tensor([-1, 7], dtype=torch.int32),
    }
    a = store.encode_safetensors(ts, {"m": "1"})
    b = store.encode_safetensors(dict(reversed(list(ts.items()))), {"m": "1"})
    assert a == b
    lib = load(a)
    for k, t in ts.items():
        assert lib[k].dtype == t.dtype and lib[k].shape == t.shape
        assert torch.equal(lib[k].view(torch.uint8) if t.numel() else lib[k], t.view(torch.uint8) if t.numel() else t)


def test_e8m0_round_trips_through_u8_with_metadata():
    t = torch.tensor([0, 127, 255], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    data = store.encode_safetensors({"s": t})
    back, meta = store.decode_safetensors(data)
    assert back["s"].dtype == torch.float8_e8m0fnu and meta == {}
    assert back["s"].view(torch.uint8).tolist() == [0, 127, 255]


@given(st.lists(st.integers(0, 255), max_size=40), st.sampled_from([torch.uint8, torch.int32, torch.float64, torch.bfloat16]))
def test_round_trip_is_bit_exact(raw, dtype):
    n = len(raw) - len(raw) % dtype.itemsize
    t = torch.tensor(raw[:n], dtype=torch.uint8).view(dtype)
    back, _ = store.decode_safetensors(store.encode_safetensors({"t": t}))
    assert back["t"].dtype == dtype
    assert back["t"].view(torch.uint8).tolist() == raw[:n]


@pytest.mark.parametrize("mutate, msg", [
    (lambda d: d[:5], "not a safetensors file"),
    (lambda d: struct.pack("<Q", 10**9) + d[8:], "header length"),
    (lambda d: d[:8] + b"[" + d[9:], "header"),
    (lambda d: d + b"\x00", "data section"),
    (lambda d: d[:-1], "inconsistent"),
])
def test_corrupt_files_raise_fixture_error_naming_the_source(mutate, msg):
    data = store.encode_safetensors({"a": torch.arange(4, dtype=torch.int32)})
    with pytest.raises(store.FixtureError, match=msg) as ei:
        store.decode_safetensors(mutate(data), source="data/x.in.safetensors")
    assert "data/x.in.safetensors" in str(ei.value)


def test_describe_offset_names_the_tensor_element():
    data = store.encode_safetensors({"a": torch.zeros(2, 3, dtype=torch.int32)})
    (_, start, end, _), = store.tensor_spans(data)
    # element (1, 1) is flat element 4 -> bytes 16..19 of the tensor; byte 17 is its byte 1.
    assert store.describe_offset(data, start + 17) == "in tensor 'a' element (1, 1) (byte 1 of 4)"
    assert store.describe_offset(data, 3) == "in the header length field"
    assert store.describe_offset(data, 9) == "in the JSON header"


@pytest.mark.parametrize("a, b, want", [
    (b"abc", b"abc", None), (b"abc", b"abd", 2), (b"abc", b"ab", 2), (b"", b"x", 0), (b"x" * 1000 + b"y", b"x" * 1001, 1000),
])
def test_first_difference(a, b, want):
    assert store.first_difference(a, b) == want


def test_skeleton_round_trip_including_strided_views_and_special_values():
    page = torch.arange(2 * 10, dtype=torch.uint8).reshape(2, 10)
    view = torch.as_strided(page, (2, 2, 3), (10, 3, 1))  # pages of 2 records of 3 bytes, stride 10
    value = {"cache": view, "bs": 2, "scale": 0.5, "sink": [float("inf"), float("-inf")], "pair": (1, None),
             "dt": torch.bfloat16, "name": "x"}
    skel, tensors = store.flatten_value(value)
    json.dumps(skel, allow_nan=False)  # strict JSON
    back = store.unflatten_value(json.loads(json.dumps(skel)), tensors)
    assert back["cache"].stride() == (10, 3, 1) and torch.equal(back["cache"], view)
    assert back["sink"] == [math.inf, -math.inf] and back["pair"] == (1, None) and back["dt"] is torch.bfloat16
    assert back["bs"] == 2 and back["scale"] == 0.5 and back["name"] == "x"
    # span stored: offsets 0 .. 10+3*1+2 = 15 -> 16 elements
    assert tensors["cache"].shape == (16,)


def test_skeleton_rejects_unknown_types_naming_the_path():
    with pytest.raises(InputError, match=r"'value'.*object at a\.1"):
        store.flatten_value({"a": [1, object()]})
    with pytest.raises(InputError, match="__tensor__"):
        store.flatten_value({"__tensor__": 1})


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path):
    p = tmp_path / "d" / "f.bin"
    store.atomic_write_bytes(p, b"one")
    store.atomic_write_bytes(p, b"two")
    assert p.read_bytes() == b"two"
    assert [x.name for x in p.parent.iterdir()] == ["f.bin"]


def test_manifest_validation_names_the_fixture(tmp_path):
    m = store.empty_manifest()
    m["fixtures"]["x"] = {"kind": "reference"}
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(store.FixtureError, match="fixture 'x' lacks"):
        store.load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(store.FixtureError, match="not valid JSON"):
        store.load_manifest(tmp_path)
    assert store.load_manifest(tmp_path / "absent") == store.empty_manifest()
