"""SGLang's V4 store and dequantise-gathers under hypothesis: drawn geometries (page sizes, page
strides, padded and permuted slot lists, request windows) and drawn magnitudes (caches far below
and far above the simulated ones, ``strategies.ROW_LOG2_RANGE``), each case judged by the
matrix's own runner (``run_entry``: bit-exact bytes / values under the entry's declared
policies, the pad byte undefined as in the matrix).

* GPU: the real kernels (``sglang.store_jit`` and its V4.1 orders: JIT-compiled per page size, so
  their pages are drawn from ``STORE_PAGES`` / ``V41_PAGES``; ``sglang.dequantize_k_cache_paged_dsv4``
  and ``sglang.gather_dequant_requant_fp8`` at any page size; ``sglang.rope_jit`` forward and
  inverse on drawn tables and positions; ``sglang.kv_norm_rope_store`` on drawn pools, negative
  slots and kv dtypes). Skipped with the probe's reason where
  they are not staged or no GPU is present; ``HYPOTHESIS_PROFILE=gpu-nightly`` draws more.
* CPU: the same strategies through the same adapters with the production function replaced by a
  re-derivation from the source (the stores and RoPE: ``tests/kernels/fake_sglang_jit.py``; the
  gathers and the norm + RoPE + store: ``test_sglang.py``'s transcriptions), so the drawn geometries are proven to reach the kernels
  the way the adapters hand them over, and a transcription with the scale read one binade off
  must fail on a drawn case.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tests.kernels.fake_sglang_jit as FAKE
from dsv4_numerics.kernels import registry
from dsv4_numerics.kernels.sglang import triton as S
from dsv4_numerics.kernels.sglang import jit as sglang_jit
from dsv4_numerics.oracles.matrix import run_entry
from dsv4_numerics.strategies.cache import gather_cases, kv_norm_rope_store_cases, rope_cases, swa_write_cases
from dsv4_numerics.strategies.v41 import v41_write_cases

from .test_sglang import sglang_norm_rope_store, sglang_requant_gather, sglang_v4_dequant
from .conftest import entry_or_skip

STORE_PAGES = (16, 64)  # power-of-two pages only (the store's compile-time page size), two compiles
V41_PAGES = (2, 64)
V41_STORES = ("sglang.store_jit.v41_footer", "sglang.store_jit.v41_interleaved")
ROPES = {"sglang.rope_jit": False, "sglang.rope_jit.inverse": True}  # entry -> its direction
GATHERS = ("sglang.dequantize_k_cache_paged_dsv4", "sglang.gather_dequant_requant_fp8")
TRANSCRIPTIONS = {GATHERS[0]: sglang_v4_dequant, GATHERS[1]: sglang_requant_gather}


def _judged(entry, case, device: str) -> None:
    (r,) = run_entry(entry, [case], device=device)
    assert r.verdict == "pass", r.line()


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@given(case=swa_write_cases(block_sizes=STORE_PAGES))
def test_store_jit_on_drawn_pages_slots_and_magnitudes(case):
    _judged(entry_or_skip("sglang.store_jit"), case, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", V41_STORES)
@given(case=v41_write_cases(block_sizes=V41_PAGES))
def test_v41_stores_on_drawn_records_pages_and_magnitudes(name, case):
    _judged(entry_or_skip(name), case, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", GATHERS)
@given(case=gather_cases())
def test_gathers_on_drawn_tables_windows_and_magnitudes(name, case):
    _judged(entry_or_skip(name), case, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(ROPES))
@given(data=st.data())
def test_rope_on_drawn_tables_positions_and_magnitudes(name, data):
    entry = entry_or_skip(name)
    _judged(entry, data.draw(rope_cases(inverse=ROPES[name])), "cuda")


@pytest.mark.gpu
@given(case=kv_norm_rope_store_cases())
def test_kv_norm_rope_store_on_drawn_pools_and_slots(case):
    _judged(entry_or_skip("sglang.kv_norm_rope_store"), case, "cuda")


# --------------------------------------------------------------------------- CPU


def _runnable(name: str):
    return dataclasses.replace(registry.get(name), probe=lambda: None)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(case=swa_write_cases(block_sizes=STORE_PAGES))
def test_store_adapter_on_drawn_cases_against_the_sources_arithmetic(case):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sglang_jit, "jit_module", lambda name: FAKE)
        _judged(_runnable("sglang.store_jit"), case, "cpu")


@settings(suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.parametrize("name", V41_STORES)
@given(case=v41_write_cases(block_sizes=V41_PAGES))
def test_v41_store_adapters_on_drawn_cases_against_the_sources_arithmetic(name, case):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sglang_jit, "jit_module", lambda name: FAKE)
        _judged(_runnable(name), case, "cpu")


@settings(suppress_health_check=[HealthCheck.too_slow])
@pytest.mark.parametrize("name", sorted(ROPES))
@given(data=st.data())
def test_rope_adapters_on_drawn_cases_against_the_sources_arithmetic(name, data):
    case = data.draw(rope_cases(inverse=ROPES[name]))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sglang_jit, "jit_module", lambda name: FAKE)
        _judged(_runnable(name), case, "cpu")


@given(case=kv_norm_rope_store_cases())
def test_kv_norm_rope_store_adapter_on_drawn_cases_against_its_transcription(case):
    # the torch transcription multiplies and adds separately (torch does not contract): the entry
    # is judged under rope_arith=separate here, under its declared fma on the GPU
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(S, "triton_fn", lambda module, attr: sglang_norm_rope_store)
        entry = _runnable("sglang.kv_norm_rope_store")
        _judged(dataclasses.replace(entry, policies=dict(entry.policies, rope_arith="separate")), case, "cpu")


@pytest.mark.parametrize("name", GATHERS)
@given(case=gather_cases())
def test_gather_adapters_on_drawn_cases_against_their_transcriptions(name, case):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(S, "triton_fn", lambda module, attr: TRANSCRIPTIONS[name])
        _judged(_runnable(name), case, "cpu")


def _scale_one_binade_off(quant_k_cache, page_table_1_flattened, page_size, out=None, layout="v4"):
    """A planted bug: the V4 gather with every NoPE value doubled (exp2(s - 126))."""
    got = sglang_v4_dequant(quant_k_cache, page_table_1_flattened, page_size, out, layout)
    got[..., :448] = (got[..., :448].to(torch.float32) * 2).to(torch.bfloat16)
    return got


@settings(max_examples=4)  # every drawn case must catch it; a failing verdict's report costs ~1 s
@given(case=gather_cases())
def test_a_wrong_gather_fails_on_drawn_cases(case):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(S, "triton_fn", lambda module, attr: _scale_one_binade_off)
        (r,) = run_entry(_runnable(GATHERS[0]), [case], device="cpu")
    # a doubled NoPE value differs unless it is 0 (or saturates); every drawn case has a written row
    assert r.verdict == "fail", r.line()
