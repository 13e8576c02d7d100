"""Default MLA-family cases (reference/cases/mla.py): deterministic, inside the production kernels'
contracts, NaN-poisoned exactly where no valid index points."""

from __future__ import annotations

import pytest
import torch

from dsv4_numerics.reference.caches.v32 import dequantize_v32_cache, v32_nan_row, v32_page_view
from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.attention.mla_dense import dense_token_indices


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns (NaN payloads included) of any tensor."""
    return t.contiguous().view(_INT_OF_SIZE[t.element_size()])


def _same(a, b):
    assert a.name == b.name and a.params == b.params and list(a.inputs) == list(b.inputs)
    for k, v in a.inputs.items():
        w = b.inputs[k]
        if isinstance(v, torch.Tensor):
            assert v.dtype == w.dtype and torch.equal(_bits(v), _bits(w)), k
        else:
            assert v == w


STAGES = ("v32_decode", "dense_mla_decode", "dense_mla_prefill")


@pytest.fixture(scope="module")
def cases():
    return {st: default_cases(st) for st in STAGES}


def test_cases_are_deterministic(cases):
    for stage in STAGES:
        a, b = cases[stage], default_cases(stage)
        assert len(a) >= 2 and len({c.name for c in a}) == len(a)
        for x, y in zip(a, b):
            _same(x, y)


def test_v32_cases_fit_flashmla_and_poison_unreferenced_rows(cases):
    poison = v32_nan_row()
    for c in cases["v32_decode"]:
        inp = c.inputs
        b, s_q, h, d = inp["q"].shape
        assert d == 576 and h in (64, 128) and inp["q"].dtype == torch.bfloat16
        assert inp["indices"].dtype == torch.int32 and inp["indices"].shape[-1] % 64 == 0
        assert inp["block_size"] == 64 and inp["d_v"] == 512
        assert inp["scale"] != 576 ** -0.5  # a non-default scale
        view = v32_page_view(inp["kv_cache"], 64)
        assert view.stride() == (65 * 656, 656, 1)  # FlashMLA test padding: (bs + 1) * 656 per page
        idx = inp["indices"].reshape(-1).to(torch.int64)
        assert bool(((idx == -1) | ((idx >= 0) & (idx < view.shape[0] * 64))).all())  # -1 or in range
        used = torch.zeros(view.shape[0] * 64, dtype=torch.bool)
        used[idx[idx >= 0]] = True
        rows = view.reshape(-1, 656)
        assert bool((rows[~used] == poison).all())  # every unreferenced slot poisoned
        assert not bool((rows[used] == poison).all(dim=1).any())  # no referenced slot poisoned
        deq = dequantize_v32_cache(inp["kv_cache"], 64)
        assert bool(torch.isfinite(deq[used]).all())
        # the page padding rows (row 64 of every page) are poisoned too
        pad = inp["kv_cache"][:, 64 * 656:65 * 656]
        assert bool((pad == poison).all())
    names = [c.name for c in cases["v32_decode"]]
    assert any("lonely" in n for n in names) and any("nonpow2" in n for n in names)
    assert any(c.inputs["sink"] is not None and torch.isinf(c.inputs["sink"]).any()
               for c in cases["v32_decode"])


def test_nonpow2_case_really_has_non_power_of_two_scales(cases):
    c = next(c for c in cases["v32_decode"] if c.params["nonpow2_scales"])
    view = v32_page_view(c.inputs["kv_cache"], 64).reshape(-1, 656)
    s = view[:, 512:528].contiguous().view(torch.float32)
    fin = s[torch.isfinite(s)]
    mant = fin.view(torch.int32) & 0x7FFFFF
    assert bool((mant != 0).float().mean() > 0.9)  # almost all have a nonzero mantissa


def test_dense_cases_poison_and_visibility(cases):
    for c in cases["dense_mla_decode"]:
        inp = c.inputs
        q, kv = inp["q"], inp["kv_cache"]
        b, s, h, d = q.shape
        bs = inp["block_size"]
        assert d == 576 and kv.dtype == q.dtype and bs in (32, 64) and s <= 4
        assert bool((inp["seq_lens"] >= s).all())
        vals = kv.to(torch.float64).reshape(-1, 576)
        idx, ln = dense_token_indices(inp["block_table"], inp["seq_lens"], s, bs)
        visible = torch.zeros(vals.shape[0], dtype=torch.bool)
        for r, L in enumerate(inp["seq_lens"].tolist()):
            for p in range(L):
                visible[int(inp["block_table"][r, p // bs]) * bs + p % bs] = True
        assert bool(torch.isfinite(vals[visible]).all())
        # every visible position is reachable by the last query token of its request
        last = idx.view(b, s, -1)[:, -1]
        assert int(visible.sum()) == int((last >= 0).sum())
        # positions past seq_len inside a request's pages are NaN (FlashMLA's test poison)
        for r, L in enumerate(inp["seq_lens"].tolist()):
            n_pages = -(-L // bs)
            last_page = int(inp["block_table"][r, n_pages - 1])
            tail = vals[last_page * bs + (L - (n_pages - 1) * bs): (last_page + 1) * bs]
            assert bool(torch.isnan(tail).all())
        if q.dtype == torch.bfloat16:
            assert inp["q_scale"] == 1.0 and inp["kv_scale"] == 1.0


def test_prefill_cases_shapes(cases):
    for c in cases["dense_mla_prefill"]:
        inp = c.inputs
        assert inp["q"].shape[-1] == 192 and inp["k"].shape[-1] == 192 and inp["v"].shape[-1] == 128
        assert torch.equal(inp["cu_seqlens_q"], inp["cu_seqlens_kv"])
        assert int(inp["cu_seqlens_q"][-1]) == inp["q"].shape[0]
