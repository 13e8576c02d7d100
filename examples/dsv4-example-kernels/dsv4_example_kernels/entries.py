"""The ``KernelEntry`` objects this package contributes to dsv4-numerics through the entry-point
group ``dsv4_numerics.kernels`` (``pyproject.toml``): ``dsv4-numerics kernels`` lists them with
this package's name and ``dsv4-numerics check`` judges them with the rest of the matrix.

An entry's ``call`` receives a ``Case`` (canonical inputs in ``case.inputs``, already on the
device) and must not modify it: the writer gets a copy of the cache.
"""

from __future__ import annotations

from dsv4_numerics import KernelEntry

from .decode import sparse_decode
from .swa_writer import swa_write


def _runs_anywhere() -> str | None:
    return None  # plain PyTorch: runs on every device


def _swa_call(case) -> dict:
    return swa_write({**case.inputs, "cache": case.inputs["cache"].clone()})


def _decode_call(case) -> dict:
    return sparse_decode(case.inputs)


ENTRIES = [
    KernelEntry(
        name="example.swa_write.q_s", stage="swa_write", family="reference",
        source="dsv4_example_kernels.swa_writer:write_swa_cache", archs=("cpu", "any-cuda"), dtypes=("bfloat16",),
        policies={"scale_rule": "scale_clamp"},  # the deliberate difference, declared
        tolerance_scope="example.swa_write.q_s", probe=_runs_anywhere, call=_swa_call,
        notes="plain-PyTorch 584-byte SWA writer with the Q_S scale rule (like the CuTe-DSL compressor)"),
    KernelEntry(
        name="example.decode.fp32", stage="decode", family="reference",
        source="dsv4_example_kernels.decode:sparse_decode", archs=("cpu", "any-cuda"), dtypes=("bfloat16",),
        policies={}, tolerance_scope="example.decode.fp32", probe=_runs_anywhere, call=_decode_call,
        notes="plain-PyTorch sparse decode, fp32 math, bf16 output"),
]
