"""Bit-exact comparison of DeepSeek-V4.1 paged caches (528-byte MXFP8, 288-byte NVFP4; datapath
1.6, hazard H13), with the byte-order disagreement named.

``diff_v41`` compares the defined bytes of the written slots (every byte of a V4.1 record is
defined) as ``reference.caches.v41`` lays them out in ``layout``. When they differ it re-reads the
got cache in the other ``V41Layout``: if the records then equal the expected ones, the writer and
the reader disagree on the byte order only, and the report says so with both policy names
(interleaved: vLLM 0.33.0 / vendored FlashMLA; page_footer: FlashInfer 0.7.2).
"""

from __future__ import annotations

import torch

from dsv4_numerics.reference.caches import v41 as cache_v41
from dsv4_numerics.reference.errors import check_dtype, fail
from dsv4_numerics.reference.policies import V41Layout, V41Record

from .bytes_diff import BytesReport, Difference, fail_shape, Sink

__all__ = ["diff_v41", "LAYOUT_PRODUCERS"]

LAYOUT_PRODUCERS = {
    V41Layout.INTERLEAVED: "vLLM 0.33.0 / vendored FlashMLA (2026.09.30)",
    V41Layout.PAGE_FOOTER: "FlashInfer 0.7.2",
}


def diff_v41(expected: torch.Tensor, got: torch.Tensor, written_slots: torch.Tensor, block_size: int,
             record: V41Record | str, layout: V41Layout | str, *, max_items: int = 64) -> BytesReport:
    """Compare the records of ``written_slots`` (int ``[S]``, negatives ignored) of two V4.1 caches
    of the same geometry, both read in ``layout`` (the reader's byte order). Differences are
    reported per slot and part (``data`` byte range, ``scale`` group); ``explanations`` names a
    pure byte-order disagreement (H13)."""
    fn = "diff_v41"
    try:
        record, layout = V41Record(record), V41Layout(layout)
    except ValueError:
        fail(fn, "record/layout", "must be a V41Record and a V41Layout value", (record, layout))
    tag = f"v41_{record.value}_{layout.value}"
    check_dtype(fn, "expected", expected, (torch.uint8,))
    if not isinstance(got, torch.Tensor) or got.dtype != torch.uint8 or got.shape != expected.shape:
        return fail_shape(tag, f"got {getattr(got, 'dtype', type(got).__name__)}{tuple(getattr(got, 'shape', ()))}, "
                                f"expected uint8{tuple(expected.shape)}")
    s = written_slots.to(torch.int64)
    s = s[s >= 0]
    de, se = cache_v41.read_records(expected, s, block_size, record, layout)
    dg, sg = cache_v41.read_records(got, s, block_size, record, layout)
    ne_d, ne_s = de != dg, se != sg
    rep = BytesReport(layout=tag, passed=not bool(ne_d.any() or ne_s.any()),
                      compared=de.numel() + se.numel(), differing=int(ne_d.sum() + ne_s.sum()))
    if rep.passed:
        return rep
    sink = Sink(max_items)
    groups = se.shape[1]
    per_group = de.shape[1] // groups
    for i in (ne_d.any(dim=1) | ne_s.any(dim=1)).nonzero().flatten().tolist():
        rep.differing_records += 1
        for g in range(groups):
            dd = ne_d[i, g * per_group:(g + 1) * per_group].nonzero().flatten()
            if bool(ne_s[i, g]) or dd.numel():
                rep.differing_tiles += 1
            if bool(ne_s[i, g]):
                sink.add(Difference({"slot": int(s[i]), "part": "scale", "group": g},
                                    f"0x{int(se[i, g]):02X}", f"0x{int(sg[i, g]):02X}"))
            if dd.numel():
                b = (dd + g * per_group).tolist()
                sink.add(Difference({"slot": int(s[i]), "part": "data", "group": g, "bytes": b},
                                    [f"0x{x:02X}" for x in de[i, b].tolist()], [f"0x{x:02X}" for x in dg[i, b].tolist()]))
    rep.differences, rep.truncated = sink.items, sink.dropped
    other = V41Layout.PAGE_FOOTER if layout is V41Layout.INTERLEAVED else V41Layout.INTERLEAVED
    do, so = cache_v41.read_records(got, s, block_size, record, other)
    if torch.equal(do, de) and torch.equal(so, se):
        msg = (f"byte-order disagreement (hazard H13): the got cache holds the expected records in "
               f"layout={other.value} ({LAYOUT_PRODUCERS[other]}) but is read as layout={layout.value} "
               f"({LAYOUT_PRODUCERS[layout]}); same bytes per token, so no consumer rejects it -- it is misread")
        rep.explanations.append(msg)
        rep.message = msg
    return rep
