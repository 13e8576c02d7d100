"""Public API of the cross-engine checks (``oracles.cross_engine``), for kernels of your own and
the registry's, re-exported as ``dsv4_numerics.compare_writers`` / ``read_foreign``::

    import dsv4_numerics as dn

    # your 584-byte writer against vLLM's CUDA writer, byte for byte, on the swa_write cases
    for row in dn.compare_writers(my_writer, "vllm_cuda.swa_quant_insert", device="cuda"):
        print(row.line())          # bytes that differ, by record part, and whether the reference
                                   # under the two declared policy sets predicts every one
    # FlashMLA's decode judged on caches your writer wrote
    for row in dn.read_foreign(my_writer, "flashmla.sparse_decode.sm90", device="cuda"):
        assert row.verdict in ("pass", "skip"), row.line()

A writer or reader is a plain callable ``fn(inputs) -> dict`` (as for ``dsv4_numerics.judge``),
a :class:`~dsv4_numerics.kernels.registry.KernelEntry`, or a registry name. ``policies_*`` declare
what a callable follows (``reference.policies`` values; for an entry they override its declared
ones). Writers are ``swa_write`` kernels; readers are ``gather`` or ``decode`` kernels
(``oracles.cross_engine.READ_CACHES``; a prefill reads a bf16 workspace, not a paged cache).
``device`` (default): ``cuda`` when a GPU is visible and either side is a GPU entry of the
registry, else the CPU. Bad arguments raise ``InputError`` naming the argument.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from dsv4_numerics.oracles import cross_engine as ce
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.errors import InputError

from dsv4_numerics.api.callable_entry import JudgedEntry
from dsv4_numerics.api.testing import Kernel, resolve_cases, build_entry

WRITER_STAGE = "swa_write"


def _resolve(fn: Kernel) -> Kernel:
    """A registry name -> its entry (``UnknownKernelError``, an ``InputError``, names the known ones)."""
    if isinstance(fn, str):
        from dsv4_numerics.kernels import registry

        return registry.get(fn)
    return fn


def _kernel(fn_name: str, arg: str, fn: Kernel, stage: str, policies: Any, cases: list[Case],
            name: str | None) -> JudgedEntry:
    """``fn`` (a callable or an entry; a registry name is :func:`_resolve`-d by the caller first) as the
    judged entry of ``stage``."""
    return build_entry(f"{fn_name} ({arg})", fn, stage, policies, cases, name)


def resolve_device(fn_name: str, device: Any, *kernels: Kernel) -> str | None:
    """``device`` checked; None: ``cuda`` when a GPU is visible and one of ``kernels`` is an entry
    of the registry (or entry-like) that runs on a GPU (its ``archs`` not CPU-only), else None
    (the CPU: plain callables get CPU tensors, as with ``dsv4_numerics.judge``)."""
    if device is None:
        from dsv4_numerics.kernels.probe import runs_on_cpu

        gpu = any(getattr(k, "archs", None) and not runs_on_cpu(k.archs) for k in kernels)
        return "cuda" if gpu and torch.cuda.is_available() else None
    try:
        return str(torch.device(device))
    except (RuntimeError, TypeError) as e:
        raise InputError(f"{fn_name}: argument 'device' is not a torch device: {e}") from None


def compare_writers(writer_a: Kernel, writer_b: Kernel, *, policies_a: dict | None = None,
                    policies_b: dict | None = None, cases: Iterable[Case] | None = None,
                    device: Any = None, name_a: str | None = None,
                    name_b: str | None = None) -> list[ce.WriterComparison]:
    """Both writers on each ``swa_write`` case (default: the canonical ones): one
    :class:`~dsv4_numerics.oracles.cross_engine.WriterComparison` per case (differing defined
    bytes by record part, the reference's prediction from the two declared policy sets,
    ``explained``, the policy keys the two declarations disagree on; ``skipped`` with the reason
    where a writer refuses the case)."""
    fn = "compare_writers"
    case_list = resolve_cases(fn, WRITER_STAGE, cases)
    writer_a, writer_b = _resolve(writer_a), _resolve(writer_b)
    a = _kernel(fn, "writer_a", writer_a, WRITER_STAGE, policies_a, case_list, name_a)
    b = _kernel(fn, "writer_b", writer_b, WRITER_STAGE, policies_b, case_list, name_b)
    dev = resolve_device(fn, device, writer_a, writer_b)
    return [ce.compare_writers(a, b, c, device=dev) for c in case_list]


def read_foreign(writer: Kernel, reader: Kernel, *, reader_stage: str | None = None,
                 writer_policies: dict | None = None, reader_policies: dict | None = None,
                 cases: Iterable[Case] | None = None, device: Any = None, writer_name: str | None = None,
                 reader_name: str | None = None) -> list[ce.ForeignRead]:
    """The reader judged on each of its cases (default: its stage's canonical ones) with the
    records it reaches rewritten by ``writer``: one
    :class:`~dsv4_numerics.oracles.cross_engine.ForeignRead` per case (its ``verdict`` and
    ``result`` from the matrix's runner, records rewritten and changed). ``reader_stage``:
    ``gather`` or ``decode`` for a plain-callable reader."""
    fn = "read_foreign"
    reader = _resolve(reader)
    stage = reader_stage if reader_stage is not None else getattr(reader, "stage", None)
    if stage is None:
        raise InputError(f"{fn}: argument 'reader_stage' is required for a plain-callable reader "
                         f"(one of {list(ce.READ_CACHES)})")
    if stage not in ce.READ_CACHES:
        raise InputError(f"{fn}: argument 'reader' must read a cache of stage {' / '.join(ce.READ_CACHES)}, "
                         f"got stage {stage!r}")
    case_list = resolve_cases(fn, stage, cases)
    r = _kernel(fn, "reader", reader, stage, reader_policies, case_list, reader_name)
    writer = _resolve(writer)
    w = _kernel(fn, "writer", writer, WRITER_STAGE, writer_policies, [], writer_name)
    dev = resolve_device(fn, device, writer, reader)
    return [ce.read_foreign(w, r, c, device=dev) for c in case_list]


__all__ = ["compare_writers", "read_foreign"]
