"""The outputs digest every judged Result carries (``oracles.digest``): the plain sha256 of the
bytes for CPU tensors (as before the device fingerprint existed, so earlier reports' digests stay
comparable), the device fingerprint for GPU tensors: checked here against an independent
pure-Python computation of its definition (Python integers, no torch arithmetic), for exactness
at the largest words and coefficients, for sensitivity to any one changed byte, and for the same
bits on a GPU as on the CPU."""
from __future__ import annotations

import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4_numerics.oracles import digest as D
from dsv4_numerics.reference.hashing import mix32_int

CUDA = torch.cuda.is_available()


def python_fingerprint(data: bytes) -> bytes:
    """The module docstring's definition, in Python integers."""
    if len(data) % 2:
        data += b"\0"
    words = [int.from_bytes(data[j:j + 2], "little") for j in range(0, len(data), 2)]
    out = []
    for k in D.LANES:
        for b0 in range(0, len(words), D.BLOCK):
            total = 0
            for i in range(b0, min(b0 + D.BLOCK, len(words))):
                c = mix32_int(mix32_int(i ^ k)) & 0x7FFFFFFF
                total += words[i] * (c or 1)
            assert total < 2**63
            out.append(total)
    # the torch version orders its sums chunk by chunk, lanes inside a chunk
    per_chunk = D.CHUNK // D.BLOCK
    nb = (len(words) + D.BLOCK - 1) // D.BLOCK
    lanes = [out[j * nb:(j + 1) * nb] for j in range(len(D.LANES))]
    ordered = []
    for c0 in range(0, nb, per_chunk):
        for lane in lanes:
            ordered += lane[c0:c0 + per_chunk]
    return b"".join(v.to_bytes(8, "little", signed=True) for v in ordered)


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("t", [torch.arange(7, dtype=torch.uint8), torch.randn(5, 3).to(torch.bfloat16),
                               torch.tensor([True, False, True]), torch.empty(0, 4)],
                         ids=["odd-bytes", "bf16", "bool", "empty"])
def test_fingerprint_is_its_definition(t):
    assert D.device_fingerprint(t) == python_fingerprint(raw(t))


def test_fingerprint_sums_are_exact_at_the_largest_words():
    """Every word 0xFFFF over more than one block: the int64 block sums are the exact integers
    (a product or sum that wrapped would differ from the Python integers)."""
    t = torch.full((D.BLOCK + 3,), -1, dtype=torch.int16)
    assert D.device_fingerprint(t) == python_fingerprint(raw(t))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), pos=st.data(), flip=st.integers(1, 255), seed=st.integers(0, 2**31 - 1))
def test_any_one_changed_byte_changes_the_fingerprint_and_the_digest(n, pos, flip, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    j = pos.draw(st.integers(0, n - 1))
    b = a.clone()
    b[j] ^= flip
    assert D.device_fingerprint(a) != D.device_fingerprint(b)
    assert D.outputs_digest({"out": a}) != D.outputs_digest({"out": b})


def test_cpu_digest_is_the_sha256_of_the_bytes():
    out = {"out": torch.randn(4, 8).to(torch.bfloat16), "lse": torch.randn(4, dtype=torch.float64), "n": 3}
    h = hashlib.sha256()
    for name in ("lse", "n", "out"):
        h.update(name.encode())
        v = out[name]
        if isinstance(v, torch.Tensor):
            h.update(f"{v.dtype}{tuple(v.shape)}".encode() + raw(v))
        else:
            h.update(repr(v).encode())
    assert D.outputs_digest(out) == h.hexdigest()
    assert D.same_kind(h.hexdigest(), "ab") and not D.same_kind(h.hexdigest(), D.DEVICE_PREFIX + "ab")


@pytest.mark.skipif(not CUDA, reason="no CUDA device: the GPU fingerprint is compared with the CPU's there")
def test_gpu_fingerprint_has_the_cpu_bits_and_the_device_prefix():
    t = torch.randn(3, 64, 1000).to(torch.bfloat16)  # several blocks
    assert D.device_fingerprint(t.cuda()) == D.device_fingerprint(t)
    d = D.outputs_digest({"out": t.cuda(), "lse": torch.ones(3, dtype=torch.float64)})
    assert d.startswith(D.DEVICE_PREFIX)
    assert d != D.outputs_digest({"out": t, "lse": torch.ones(3, dtype=torch.float64)})
    assert d == D.outputs_digest({"out": t.cuda(), "lse": torch.ones(3, dtype=torch.float64)})
