"""The V4.1 kernel adapters' plumbing on CPU (``kernels/flashmla/v41.py``): FlashMLA V4.1 decode
against the stand-in interface (``fake_flashmla``, which reads 528/288-byte records interleaved
and accepts 288 B only as the extra cache), the path / byte-order refusals, the probe turning the
library's refusal into an ``unavailable`` reason, and the prefill workspace offsets (a stand-in
for vLLM's V4.1 gather)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

import tests.kernels.fake_flashmla as FAKE
from dsv4_numerics.kernels import registry
from dsv4_numerics.kernels.flashmla import sparse as flashmla
from dsv4_numerics.kernels.flashmla import v41 as V
from dsv4_numerics.oracles import matrix
from dsv4_numerics.oracles import stages as st
from dsv4_numerics.reference.caches import v41 as cache_v41
from dsv4_numerics.reference.cases import default_cases
from dsv4_numerics.reference.errors import UnsupportedCase
from dsv4_numerics.reference.policies import V41Layout, V41Record


@pytest.fixture(autouse=True)
def fake_interface(monkeypatch):
    FAKE.CALLS.clear()
    monkeypatch.setattr(flashmla, "flashmla_interface", lambda: FAKE)


@functools.lru_cache(maxsize=None)
def _cases(stage):
    return {c.name: c for c in default_cases(stage)}


def _entry(name):
    return next(e for e in V.ENTRIES if e.name == name)


def _judge(entry, case):
    # the entry judged exactly as the matrix does, its probe bypassed (no GPU here)
    fake = SimpleNamespace(**{f: getattr(entry, f) for f in ("name", "stage", "family", "source", "archs", "dtypes",
                                                               "policies", "tolerance_scope", "call")},
                           probe=lambda: None)
    return matrix.run_entry(fake, cases=[case])[0]


@pytest.mark.dsv4_unreported
@pytest.mark.parametrize("entry,case", [
    ("flashmla.v41_sparse_decode.sm90", "mxfp8-swa-bs64-nanpoison-lonely"),
    ("flashmla.v41_sparse_decode.sm90", "mxfp8-mxfp8-bs64-tail-stale-past-len"),
    ("flashmla.v41_fp4_sparse_decode.sm90", "mixed-mxfp8-nvfp4-bs64-bs2"),
])
def test_decode_adapter_passes_through_the_fake_interface(entry, case):
    r = _judge(_entry(entry), _cases("v41_sparse_decode")[case])
    assert r.verdict == "pass", r.message
    call = FAKE.CALLS[-1]
    assert call["h_q"] == 64 and call["topk"] % 64 == 0  # 8 heads padded to 64, top-k to the decode block


def test_decode_adapter_refuses_the_other_path_and_page_footer_caches():
    cases = _cases("v41_sparse_decode")
    with pytest.raises(UnsupportedCase, match="flashmla.v41_fp4_sparse_decode runs it"):
        V.v41_decode_call(cases["mixed-mxfp8-nvfp4-bs64-bs2"], fp4=False)
    with pytest.raises(UnsupportedCase, match="flashmla.v41_sparse_decode runs it"):
        V.v41_decode_call(cases["mxfp8-swa-bs64-nanpoison-lonely"], fp4=True)
    with pytest.raises(UnsupportedCase, match="written v41_layout=page_footer.*H13"):
        V.v41_decode_call(cases["mixed-mxfp8-nvfp4-page-footer"], fp4=True)


def test_probe_quotes_flashmla_refusal(monkeypatch):
    def refuse(fp4):
        raise RuntimeError("Unsupported kv cache format for sm90 (bytes per token 528)\nstack trace ...")

    monkeypatch.setattr(V, "tiny_decode", refuse)
    V.path_reason.cache_clear()
    try:
        reason = V.path_reason(True)
    finally:
        V.path_reason.cache_clear()
    assert reason.startswith("FlashMLA V4.1 MXFP8 528 B main + NVFP4 288 B extra (V41_FP4) not supported here")
    assert "RuntimeError: Unsupported kv cache format for sm90 (bytes per token 528)" in reason
    assert "stack trace" not in reason


def test_entries_are_declared_per_path_and_skip_on_cpu():
    names = {e.name for e in V.ENTRIES}
    assert {"flashmla.v41_sparse_decode.sm90", "flashmla.v41_fp4_sparse_decode.sm90",
            "vllm_flashmla.v41_sparse_prefill.sm90", "vllm_triton.v41_query_quant"} <= names
    for e in V.ENTRIES:
        assert not registry.validate_entry(e), e.name
        assert e.name in {x.name for x in registry.ENTRIES}
        if not torch.cuda.is_available():
            reason = e.probe()
            assert reason and "GPU" in reason, (e.name, reason)


def _fake_gather(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset, **kw):
    """vLLM's V4.1 gather semantics for one request (identity tables here): slot s -> out[0, offset + s]."""
    record = {528: V41Record.MXFP8, 288: V41Record.NVFP4}[k_cache.shape[-1]]
    nb = k_cache.shape[0]
    flat = torch.as_strided(k_cache, (nb, block_size * k_cache.shape[-1]), (k_cache.stride(0), 1),
                            k_cache.storage_offset())
    rows = cache_v41.dequantize_all(flat, block_size, record, V41Layout.INTERLEAVED)
    table = block_table[0].long()
    slots = (table[:, None] * block_size + torch.arange(block_size)).reshape(-1)[: int(seq_lens[0])]
    out[0, offset: offset + slots.numel()] = rows[slots]


@pytest.mark.dsv4_unreported
@pytest.mark.parametrize("case", ["mixed-mxfp8-nvfp4-workspace", "mxfp8-swa-oob-mix"])
def test_prefill_adapter_builds_vllms_workspace(monkeypatch, case):
    import importlib

    real = importlib.import_module
    fake_cu = SimpleNamespace(dequantize_and_gather_k_cache_triton=_fake_gather)
    monkeypatch.setattr(importlib, "import_module", lambda m, *a: fake_cu if m == V.CACHE_UTILS else real(m, *a))
    r = _judge(_entry("vllm_flashmla.v41_sparse_prefill.sm90"), _cases("v41_sparse_prefill")[case])
    assert r.verdict == "pass", r.message
    assert FAKE.CALLS[-1]["fn"] == "prefill"


def test_v41_stages_use_the_fast_oracle_on_a_device():
    assert {"v41_sparse_decode", "v41_sparse_prefill"} <= set(st.FAST_ORACLE_STAGES)
