"""Cross-engine checks at kernel level: a 584-byte MODEL1 cache written by one engine's writer
kernel, read by another engine's reader kernel (SGLang's store read by vLLM's gather or FlashMLA's
decode, and the other way round).

Two questions, each answered with counts and the policies that explain them:

* :func:`compare_writers` -- the same bf16 rows written by two ``swa_write`` entries. The bytes
  they differ in (defined bytes of the written records only: 576 data + 7 scale bytes per slot,
  the pad byte excluded, datapath H5) are counted and split by record part; every differing byte
  must be predicted by the reference run under the two entries' declared policies (the reference's
  A-bytes differ from its B-bytes in exactly those positions). ``explained`` is that equality;
  ``policy_differences`` names the policy keys on which the two declarations disagree.
* :func:`read_foreign` -- a reader's own case (stage ``gather`` or ``decode``) with
  the records its indices reach rewritten by ``writer`` from the bf16 rows those records decode
  to (an exact decode: E4M3 x 2^k and bf16 RoPE lanes are bf16 values), every other byte of the
  case's cache unchanged. The reader is then judged by its own stage on the foreign bytes
  (``oracles.matrix.run_entry``: the reference reads the same bytes under the reader's policies),
  and the records the writer changed relative to the case's reference-written ones are counted.

Entries are duck-typed like ``run_entry``'s (``name``, ``stage``, ``policies``, ``probe``,
``call``); this module imports no kernel. The GPU matrix runs it over every available
(writer, reader) pair of different engines (``tests/kernels/test_cross_engine.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.caches import model1 as cm
from dsv4_numerics.reference.constants import NOPE_DIM, SCALE_ROW_BYTES
from dsv4_numerics.reference.errors import InputError, UnsupportedCase, fail

from . import stages as st
from .matrix import expected_outputs, run_entry
from .report import Result

# where a read case keeps the 584-byte cache a writer may rewrite: stage -> (cache key, block size
# key). The prefill stage reads a dequantised bf16 workspace, not a paged cache: no reader there.
READ_CACHES = {
    "gather": ("cache", "block_size"),
    "decode": ("swa_cache", "swa_block_size"),
}


def engine(entry: Any) -> str:
    """The engine an entry belongs to, from its name: ``sglang.*`` -> ``sglang``; vLLM's and the
    FlashMLA library vLLM vendors (``vllm_*``, ``flashmla.*``, ``rocm_triton.*``) -> ``vllm``;
    anything else -> the name's first component."""
    head = str(getattr(entry, "name", "?")).split(".", 1)[0]
    if head == "sglang":
        return "sglang"
    if head.startswith("vllm") or head in ("flashmla", "rocm_triton"):
        return "vllm"
    return head


def _check_entry(fn: str, arg: str, entry: Any, stages: tuple[str, ...]) -> None:
    for attr in ("name", "stage", "call", "probe"):
        if not hasattr(entry, attr):
            fail(fn, arg, f"must be a kernel entry (no attribute {attr!r})", type(entry).__name__)
    if entry.stage not in stages:
        fail(fn, arg, f"must be an entry of stage {' or '.join(stages)}", f"{entry.name} (stage {entry.stage})")


def _record_diffs(diff: torch.Tensor, slots: torch.Tensor, block_size: int) -> tuple[dict[str, int], int]:
    """``(by part, records)`` of a bool page-byte mask ``diff`` over the defined bytes of
    ``slots``: the marked bytes per record part -- ``nope_fp8`` (448 E4M3 codes), ``rope_bf16`` (64
    bf16 lanes = 128 bytes), ``scale`` (7 UE8M0 bytes; the pad byte is not defined) -- and how many
    of ``slots`` have any marked byte. The records are addressed by ``cache_model1.read_records``."""
    data, scales = cm.read_records(diff.to(torch.uint8), slots, block_size)
    data, scale = data.bool(), scales[:, : SCALE_ROW_BYTES - 1].bool()
    parts = {"nope_fp8": int(data[:, :NOPE_DIM].sum()), "rope_bf16": int(data[:, NOPE_DIM:].sum()),
             "scale": int(scale.sum())}
    return parts, int((data.any(1) | scale.any(1)).sum())


@dataclass
class WriterComparison:
    """Two writers on one ``swa_write`` case (see :func:`compare_writers`)."""

    case: str
    writer_a: str
    writer_b: str
    records: int = 0
    differing_records: int = 0
    differing_bytes: int = 0
    by_part: dict[str, int] = field(default_factory=dict)
    predicted_bytes: int = 0
    explained: bool = False
    unexplained_bytes: int = 0
    policy_differences: dict[str, tuple[str, str]] = field(default_factory=dict)
    skipped: str = ""

    def line(self) -> str:
        if self.skipped:
            return f"{self.writer_a} vs {self.writer_b} [{self.case}]: skipped ({self.skipped})"
        pol = ", ".join(f"{k}: {a} vs {b}" for k, a, b in
                        ((k, *v) for k, v in sorted(self.policy_differences.items()))) or "none"
        parts = ", ".join(f"{k} {v}" for k, v in self.by_part.items() if v) or "none"
        verdict = "explained" if self.explained else f"NOT explained ({self.unexplained_bytes} bytes)"
        return (f"{self.writer_a} vs {self.writer_b} [{self.case}]: {self.differing_bytes} bytes in "
                f"{self.differing_records}/{self.records} records differ ({parts}); reference predicts "
                f"{self.predicted_bytes}: {verdict}; declared policy differences: {pol}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _val(v: Any) -> str:
    return str(getattr(v, "value", v))


def _unavailable(entry: Any) -> str:
    """The entry's probe reason ("" when it can run here), prefixed with its name."""
    try:
        reason = entry.probe()
    except Exception as e:  # noqa: BLE001 - a broken probe is a reason, never a crash
        reason = f"probe raised {type(e).__name__}: {e}"
    return f"{entry.name}: {reason}" if reason else ""


def _cache_out(fn: str, entry: Any, case: Case, device: str | None) -> torch.Tensor:
    dcase = case.to(device) if device is not None else case
    got = entry.call(dcase)
    if not isinstance(got, dict) or "cache" not in got:
        fail(fn, entry.name, "must return a dict with a 'cache' output", type(got).__name__)
    return got["cache"].detach().cpu().contiguous().view(torch.uint8).reshape(case.inputs["cache"].shape)


def compare_writers(writer_a: Any, writer_b: Any, case: Case, device: str | None = None) -> WriterComparison:
    """Run two ``swa_write`` entries on ``case`` and count, explain and locate the bytes they
    write differently (module docstring). A writer that rejects the case (``UnsupportedCase``)
    or cannot run here (its probe) gives ``skipped``; one whose own bytes miss its reference is
    reported through
    ``unexplained_bytes`` (the comparison is then not explained)."""
    fn = "compare_writers"
    _check_entry(fn, "writer_a", writer_a, ("swa_write",))
    _check_entry(fn, "writer_b", writer_b, ("swa_write",))
    if not isinstance(case, Case) or case.stage != "swa_write":
        fail(fn, "case", "must be a swa_write Case", getattr(case, "stage", type(case).__name__))
    out = WriterComparison(case.name, writer_a.name, writer_b.name)
    pa, pb = dict(writer_a.policies or {}), dict(writer_b.policies or {})
    spec = st.get("swa_write")
    # the stage's full policy sets (defaults filled in): a key one entry leaves to the default
    # differs from the other's declaration only if the values do
    fa, fb = spec.policies(pa), spec.policies(pb)
    out.policy_differences = {k: (_val(fa.get(k, "-")), _val(fb.get(k, "-")))
                              for k in sorted(set(fa) | set(fb)) if _val(fa.get(k, "-")) != _val(fb.get(k, "-"))}
    why = _unavailable(writer_a) or _unavailable(writer_b)
    if why:
        out.skipped = why
        return out
    try:
        got_a = _cache_out(fn, writer_a, case, device)
        got_b = _cache_out(fn, writer_b, case, device)
    except UnsupportedCase as e:
        out.skipped = str(e)
        return out
    ref_a = expected_outputs(spec, "swa_write", case, fa)["cache"].view(torch.uint8)
    ref_b = expected_outputs(spec, "swa_write", case, fb)["cache"].view(torch.uint8)
    inp = case.inputs
    bs = int(inp["block_size"])
    slots = st.written_slots(inp["slot_mapping"], inp["k"].shape[0], pa)
    slots = torch.unique(slots[slots >= 0])
    mask = cm.defined_byte_mask(ref_a, slots, bs)
    observed = (got_a != got_b) & mask
    predicted = (ref_a.reshape(got_a.shape) != ref_b.reshape(got_a.shape)) & mask
    out.records = int(slots.numel())
    out.differing_bytes = int(observed.sum())
    out.predicted_bytes = int(predicted.sum())
    out.unexplained_bytes = int((observed != predicted).sum())
    out.explained = out.unexplained_bytes == 0
    out.by_part, out.differing_records = _record_diffs(observed, slots, bs)
    return out


@dataclass
class ForeignRead:
    """A reader judged on a cache its case's records were rewritten into by a foreign writer."""

    writer: str
    reader: str
    case: str
    rewritten_records: int = 0
    changed_records: int = 0
    result: Result | None = None
    skipped: str = ""

    @property
    def verdict(self) -> str:
        return "skip" if self.skipped else (self.result.verdict if self.result else "error")

    def line(self) -> str:
        if self.skipped:
            return f"{self.writer} -> {self.reader} [{self.case}]: skipped ({self.skipped})"
        return (f"{self.writer} -> {self.reader} [{self.case}]: {self.rewritten_records} records rewritten, "
                f"{self.changed_records} differ from the case's reference-written bytes; reader "
                f"{self.result.line() if self.result else 'no result'}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["result"] = self.result.to_dict() if self.result else None
        return d


def reached_slots(case: Case) -> torch.Tensor:
    """int64 sorted unique global slots of the cache a read case's kernel reads (its
    ``READ_CACHES`` cache): the gather's ``written_slots``, the decode's valid (``>= 0``)
    ``swa_indices`` entries."""
    if case.stage == "gather":
        s = case.inputs["written_slots"].to(torch.int64).reshape(-1)
    elif case.stage == "decode":
        idx = case.inputs.get("swa_indices")
        if idx is None:
            return torch.zeros(0, dtype=torch.int64)
        s = idx.to(torch.int64).reshape(-1)
    else:
        fail("reached_slots", "case", f"must be a case of stage {', '.join(READ_CACHES)}", case.stage)
    return torch.unique(s[s >= 0].cpu())


def rewritten_case(writer: Any, case: Case, device: str | None = None) -> tuple[Case, int, int]:
    """``(case', rewritten, changed)``: ``case`` with the records its reader reaches rewritten by
    ``writer`` (module docstring), the number of records rewritten, and how many of them now
    differ in a defined byte from the case's own (reference-written) bytes. Raises
    ``UnsupportedCase`` when the writer cannot run here (its probe), rejects the geometry, or
    the case reaches no record."""
    fn = "rewritten_case"
    _check_entry(fn, "writer", writer, ("swa_write",))
    if not isinstance(case, Case) or case.stage not in READ_CACHES:
        fail(fn, "case", f"must be a Case of stage {', '.join(READ_CACHES)}", getattr(case, "stage", type(case).__name__))
    why = _unavailable(writer)
    if why:
        raise UnsupportedCase(why)
    key, bs_key = READ_CACHES[case.stage]
    if key not in case.inputs or case.inputs[key] is None:
        raise UnsupportedCase(f"case {case.name} has no {key!r}")
    cache = case.inputs[key].cpu().contiguous().view(torch.uint8)
    bs = int(case.inputs[bs_key])
    nb, stride = int(cache.shape[0]), int(cache.reshape(cache.shape[0], -1).shape[1])
    cache = cache.reshape(nb, stride)
    slots = reached_slots(case)
    slots = slots[slots < nb * bs]  # an index past the cache is an invalid entry (index rules), not a record
    if slots.numel() == 0:
        raise UnsupportedCase(f"case {case.name} reaches no record of its {key!r}")
    rows = cm.dequantize_slots(cache, slots, bs)  # exact: every decoded record is a bf16 row
    wcase = Case(f"{case.name}@{writer.name}", "swa_write",
                 {"k": rows, "slot_mapping": slots.clone(), "block_size": bs, "num_blocks": nb,
                  "page_stride": stride, "cache": cache.clone()},
                 {"rewritten_from": case.name, "block_size": bs, "page_stride": stride})
    supports = getattr(writer, "supports", None)
    why = supports(wcase) if callable(supports) else None
    if why:
        raise UnsupportedCase(str(why))
    new = _cache_out(fn, writer, wcase, device)
    _, changed = _record_diffs((new != cache) & cm.defined_byte_mask(cache, slots, bs), slots, bs)
    inputs = dict(case.inputs)
    inputs[key] = new.reshape(case.inputs[key].shape) if case.inputs[key].dtype == torch.uint8 else new
    params = dict(case.params, cache_written_by=writer.name)
    return Case(f"{case.name}@{writer.name}", case.stage, inputs, params), int(slots.numel()), changed


def read_foreign(writer: Any, reader: Any, case: Case, device: str | None = None, tolerances=None) -> ForeignRead:
    """Judge ``reader`` on ``case`` rewritten by ``writer`` (:func:`rewritten_case`)."""
    fn = "read_foreign"
    _check_entry(fn, "reader", reader, tuple(READ_CACHES))
    if getattr(case, "stage", None) != reader.stage:
        fail(fn, "case", f"must be a case of the reader's stage {reader.stage}", getattr(case, "stage", None))
    out = ForeignRead(writer.name, reader.name, case.name)
    try:
        new_case, out.rewritten_records, out.changed_records = rewritten_case(writer, case, device)
    except UnsupportedCase as e:
        out.skipped = str(e)
        return out
    except InputError as e:
        out.skipped = f"writer input rejected: {e}"
        return out
    out.result = run_entry(reader, [new_case], device=device, tolerances=tolerances)[0]
    if out.result.verdict == "skip":
        out.skipped = out.result.message
    return out


__all__ = ["READ_CACHES", "ForeignRead", "WriterComparison", "compare_writers", "engine", "reached_slots",
           "read_foreign", "rewritten_case"]
