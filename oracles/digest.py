"""The digest of a kernel's outputs that each judged Result carries (``details["outputs_sha256"]``):
two runs with the same digest wrote the same bytes, which is how ``report history`` dates byte
changes between releases.

``outputs_digest(outputs)`` is the sha256 (hex) of each output's name, dtype and shape and, per
tensor, of

* its bytes, for a tensor on the CPU (the digest is then the plain sha256 of the bytes);
* its device fingerprint, for a tensor on a GPU, and the hex digest is prefixed ``fp1:``. Copying a
  batch-128 decode's outputs to the host and hashing them there took about 23 ms per judged case
  on one H200, 16 cores (a quarter of a production-shape fuzz example); the fingerprint reads the
  outputs where they are and brings back a few hundred bytes.

The fingerprint (units: the tensor's bytes, little-endian, read as 16-bit words ``w_i``, a zero
byte appended to an odd count): for each of ``LANES`` keys ``k``, the exact integer sums
``S_b = sum_{i in block b} w_i * c_k(i)`` over blocks of ``BLOCK`` consecutive words, with
coefficients ``c_k(i) = mix32(mix32(i ^ k)) & 0x7FFFFFFF`` (``reference.hashing``). Every product
is below ``2**16 * 2**31 = 2**47`` and a block sum below ``2**63``, so the int64 sums are exact:
the same integers in any summation order, on any device. A change of any one word changes its
block's sums (no coefficient is zero: a zero from the mixer is replaced by 1); several changed
words go unnoticed only where their weighted differences cancel in both lanes at once, which
pseudo-random coefficients make vanishingly rare for changes that are not built to collide. It is a change detector, not a cryptographic hash.

Digests of the two kinds never compare equal (the prefix), so ``report history`` compares a case's
digests only where both are of the same kind (``same_kind``)."""
from __future__ import annotations

import hashlib

import torch

from dsv4_numerics.reference.hashing import mix32

__all__ = ["BLOCK", "CHUNK", "DEVICE_PREFIX", "LANES", "device_fingerprint", "outputs_digest", "same_kind"]

DEVICE_PREFIX = "fp1:"  # the prefix of a digest whose tensors were fingerprinted on a GPU
LANES = (0x243F6A88, 0x85A308D3)  # the coefficient streams' keys (pi's first hex digits)
BLOCK = 1 << 16  # words per block sum: 2**16 words * 2**47 < 2**63
CHUNK = 1 << 22  # words per pass (bounds the int64 temporaries: 32 MiB each)
_MAX_WORDS = 1 << 32  # the mixer's input range: word positions below 2**32


def device_fingerprint(t: torch.Tensor) -> bytes:
    """The fingerprint of ``t``'s bytes (module docstring), computed where ``t`` is: ``LANES``
    int64 block sums per ``BLOCK`` words, as little-endian bytes."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if b.numel() % 2:
        b = torch.cat([b, b.new_zeros(1)])
    w = b.view(torch.int16)
    n = w.numel()
    if n >= _MAX_WORDS:
        raise ValueError(f"device_fingerprint: t has {n} 16-bit words, more than the fingerprint's 2**32")
    sums = []
    for s in range(0, n, CHUNK):
        x = w[s:s + CHUNK].to(torch.int64) & 0xFFFF
        i = torch.arange(s, s + x.numel(), device=x.device, dtype=torch.int64)
        pad = (-x.numel()) % BLOCK
        for k in LANES:
            c = mix32(mix32(i ^ k)) & 0x7FFFFFFF
            p = x * torch.where(c == 0, 1, c)
            if pad:
                p = torch.nn.functional.pad(p, (0, pad))
            sums.append(p.view(-1, BLOCK).sum(dim=1))
    if not sums:
        return b""
    return torch.cat(sums).cpu().numpy().astype("<i8").tobytes()


def outputs_digest(outputs: dict) -> str:
    """The digest of a kernel's outputs ``{name: tensor or value}`` (module docstring): by name,
    each output's name, dtype, shape and bytes (CPU) or device fingerprint (GPU, ``fp1:``)."""
    h = hashlib.sha256()
    on_device = False
    for name in sorted(outputs):
        t = outputs[name]
        h.update(name.encode())
        if isinstance(t, torch.Tensor):
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            if t.device.type != "cpu" and t.numel():
                on_device = True
                h.update(device_fingerprint(t))
            else:
                t = t.detach().cpu().contiguous()
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(t).encode())
    return (DEVICE_PREFIX if on_device else "") + h.hexdigest()


def same_kind(a: str, b: str) -> bool:
    """Whether two digests were made the same way (both of bytes, or both of device fingerprints),
    so that comparing them says whether the bytes changed."""
    return a.startswith(DEVICE_PREFIX) == b.startswith(DEVICE_PREFIX)
