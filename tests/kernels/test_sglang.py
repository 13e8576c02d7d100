"""SGLang 0.5.23's DSv4 Triton kernels (``kernels/sglang/triton.py``).

* GPU: every ``sglang.*`` entry on its stage's default cases is judged by ``test_matrix.py`` (skips
  with the probe's reason: not staged -> the ``stage-sglang`` command; no GPU; no Triton); here the
  hypothesis hooks for the index builders (the gpu-nightly profile draws more); the sparse
  decode joins ``test_fuzz_attention_gpu.py``.
* CPU: the adapters' conversions, driven through the real entry ``call`` with the production
  function replaced by a torch transcription of SGLang's kernel from its source (the V4 gather:
  byte addressing, ``exp2(s - 127)`` scales) or by a recorder (dtypes, LSE layout), judged by the
  stage's own judge.
* Cross-engine, reference level: the same rows through SGLang's and vLLM's / FlashMLA's
  conventions (page layout and padding, scale decode, V4.1 byte order, the combine's ``-1``),
  every difference counted and explained by a named policy.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsv4_numerics.kernels import registry
from dsv4_numerics.kernels.sglang import triton as S
from dsv4_numerics.oracles import stages
from dsv4_numerics.oracles.matrix import run_entry
from dsv4_numerics.reference.caches import model1 as cm
from dsv4_numerics.reference.caches import v41
from dsv4_numerics.reference.cases import Case, default_cases
from dsv4_numerics.reference.cases.index import combine_c4_inputs, sglang_combine_inputs
from dsv4_numerics.reference.constants import production_page_stride
from dsv4_numerics.reference.indices.prefill import combine_topk_swa_indices
from dsv4_numerics.reference.indices.sglang import combine_topk_swa_indices_sglang
from dsv4_numerics.reference.policies import CombineInvalidTopk, ScaleRule, Ue8m0Consumer, V41Layout, V41Record
from dsv4_numerics.strategies.index import batches

from .test_fuzz_indices import IndexSpec, check

SGLANG = [e.name for e in S.ENTRIES]  # the Triton rows (kernels/sglang/triton.py); the JIT rows: test_sglang_jit_adapters.py


def test_family_registered_with_the_staging_command_as_reason(monkeypatch):
    assert set(SGLANG) == {"sglang.dequantize_k_cache_paged_dsv4", "sglang.gather_dequant_requant_fp8",
                           "sglang.combine_topk_swa_indices",
                           "sglang.build_swa_token_ids", "sglang.write_v4_paged_decode_indices",
                           "sglang.triton_sparse_decode", "sglang.kv_norm_rope_store", "sglang.paged_prefill",
                           "sglang.paged_decode"}
    monkeypatch.delenv("DSV4_STAGED", raising=False)
    # a process that activated a staged folder earlier keeps it on sys.path (the GPU matrix does):
    # only the command's absence is tested here, so hide that copy from the package lookup
    monkeypatch.setattr(S.importlib.util, "find_spec", lambda name, *a: None)
    S.staged_sglang_reason.cache_clear()
    try:
        assert "stage-sglang --wheel sglang-0.5.23" in S.staged_sglang_reason(S.DEQUANT)
    finally:
        S.staged_sglang_reason.cache_clear()


# --------------------------------------------------------------------------- GPU: the family's matrix


# Each (entry, default case) is judged on the GPU by tests/kernels/test_matrix.py, one test per pair
# (an entry-wide test here ran the Triton decode's autotuning a second time: 185 s on an H200).


@st.composite
def sglang_combine_specs(draw) -> IndexSpec:
    """A common-form combine batch in SGLang's arguments (``sglang_combine_inputs``), top-k rows
    with ``-1`` holes anywhere, 0-2 trailing rows owned by no request."""
    b = draw(batches(max_seq=600, max_query=8))
    ratio = draw(st.sampled_from([4, 128]))
    topk = draw(st.sampled_from([0, 8, 64]))
    t = b.num_tokens
    vals = st.integers(-1, max(1, max(b.seq_lens) // ratio))
    rows = [draw(st.lists(vals, min_size=max(topk, 1), max_size=max(topk, 1))) for _ in range(t)]
    gl = [min(s, q + 127) for s, q in zip(b.seq_lens, b.query_lens)]
    n = max(s // ratio for s in b.seq_lens)
    common = dict(topk_indices=torch.tensor(rows, dtype=torch.int32), query_start_loc=b.query_start_loc,
                  seq_lens=torch.tensor(b.seq_lens, dtype=torch.int32), gather_lens=torch.tensor(gl, dtype=torch.int32),
                  window_size=128, compress_ratio=ratio, topk=topk, M=n + max(gl), N=n)
    return IndexSpec.of("combine_topk_swa_indices_sglang",
                        **sglang_combine_inputs(common, extra_rows=draw(st.integers(0, 2))))


@st.composite
def ring_specs(draw) -> IndexSpec:
    """Decode tokens of up to 4 sequences on a ring of ``win + spec`` slots, padding tokens mixed in."""
    win = draw(st.sampled_from([1, 8, 128]))
    ring = win + draw(st.integers(0, 3))
    nseq = draw(st.integers(1, 4))
    t = draw(st.integers(1, 6))
    bid = [draw(st.integers(-1, nseq - 1)) for _ in range(t)]
    pos = [draw(st.integers(0, 3 * ring)) for _ in range(t)]
    n = [min(p + 1, win) for p in pos]
    ptr = [0]
    for k in n:
        ptr.append(ptr[-1] + k + draw(st.integers(0, 3)))
    size = ptr[-1] + 2
    slots = draw(st.permutations(list(range(8))))[:nseq]
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return IndexSpec.of("v4_paged_decode_indices", state_slot_per_seq=i32(slots), batch_id_per_token=i32(bid),
                        positions=torch.tensor(pos, dtype=torch.int64), swa_indptr=i32(ptr), csa_indptr=i32(ptr),
                        hca_indptr=i32(ptr), swa_indices=torch.full((size,), -2, dtype=torch.int32),
                        csa_indices=torch.full((size,), -2, dtype=torch.int32),
                        hca_indices=torch.full((size,), -2, dtype=torch.int32), T=t, win=win, ring_stride=ring)


@st.composite
def swa_token_id_specs(draw) -> IndexSpec:
    """``build_swa_token_ids`` inputs: 1-4 requests of drawn lengths with extend lengths from a
    decode (1) to the whole sequence, permuted pool rows of a ``req_to_token`` table holding full
    token ids, a ``full_to_swa`` map, window 1, 8 or 128."""
    r = draw(st.integers(1, 4))
    seq = [draw(st.integers(0, 300)) for _ in range(r)]
    ext = [draw(st.one_of(st.just(min(1, s)), st.integers(0, s))) for s in seq]
    rows = r + draw(st.integers(0, 2))
    width = max(seq + [1]) + draw(st.integers(0, 5))
    pool = draw(st.permutations(list(range(rows))))[:r]
    n_full = rows * width + draw(st.integers(0, 50))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    r2t = torch.randperm(n_full, generator=g)[: rows * width].reshape(rows, width).to(torch.int32)
    f2s = torch.randint(0, 2**20, (n_full,), generator=g, dtype=torch.int64)
    i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return IndexSpec.of("build_swa_token_ids", seq_lens=i32(seq), extend_seq_lens=i32(ext), req_pool_indices=i32(pool),
                        req_to_token=r2t, full_to_swa=f2s, swa_window=draw(st.sampled_from([1, 8, 128])))


@pytest.mark.gpu
@given(spec=swa_token_id_specs())
def test_fuzz_swa_token_ids(spec):
    check("sglang.build_swa_token_ids", "swa_indices", spec)


@given(spec=swa_token_id_specs())
def test_swa_token_id_specs_are_inside_the_builders_contract(spec):
    # the GPU property above rejects draws the reference refuses: none should be refused
    out = stages.get("swa_indices").expected(spec.case("swa_indices", "cpu"), {})
    assert int(out["swa_offsets"][-1]) == out["swa_token_ids"].numel()


@pytest.mark.gpu
@given(spec=sglang_combine_specs())
def test_fuzz_combine(spec):
    check("sglang.combine_topk_swa_indices", "combine_prefill", spec)


@pytest.mark.gpu
@given(spec=ring_specs())
def test_fuzz_paged_decode_indices(spec):
    check("sglang.write_v4_paged_decode_indices", "swa_indices", spec)


# --------------------------------------------------------------------------- CPU: the adapters


def sglang_v4_dequant(quant_k_cache, page_table_1_flattened, page_size, out=None, layout="v4"):
    """``dequantize_k_cache_paged_dsv4`` (``KVLayout.V4``) transcribed from
    ``S:kernels/ops/attention/dsv4/dequant_k_cache.py:240-310``: token ``loc`` at page
    ``loc // page_size``, entry ``loc % page_size``; data at ``page * BYTES_PER_PAGE + e * 576``,
    scales at ``page * BYTES_PER_PAGE + page_size * 576 + e * 8``; NoPE ``fp8 * exp2(s - 127)``
    (fp32, ``ex2.approx.ftz``: byte 0 -> 0, 255 -> +Inf) rounded to bf16; RoPE bf16 copied."""
    assert layout == "v4" and quant_k_cache.is_contiguous() and quant_k_cache.dim() == 2
    nope, rope = _v4_gathered_values(quant_k_cache, page_table_1_flattened, page_size)
    return torch.cat([nope.to(torch.bfloat16), rope], dim=1)[:, None, :]


def _v4_gathered_values(quant_k_cache, page_table_1_flattened, page_size):
    """The V4 page addressing and scale decode both SGLang gathers share: ``(nope fp32 [N, 448] =
    fp8 * exp2(s - 127) with byte 0 -> 0 (ftz), rope bf16 [N, 64])``."""
    buf = quant_k_cache.reshape(-1)
    per_page = quant_k_cache.shape[-1]
    loc = page_table_1_flattened.to(torch.int64)
    base = (loc // page_size) * per_page
    e = loc % page_size
    data = buf[(base + e * 576)[:, None] + torch.arange(576)]
    scale_b = buf[(base + page_size * 576 + e * 8)[:, None] + torch.arange(7)].to(torch.int32)
    scale = torch.where(scale_b == 0, torch.zeros(()), torch.exp2((scale_b - 127).to(torch.float32)))
    nope = data[:, :448].contiguous().view(torch.float8_e4m3fn).to(torch.float32).reshape(-1, 7, 64)
    return (nope * scale[:, :, None]).reshape(-1, 448), data[:, 448:].contiguous().view(torch.bfloat16)


def sglang_requant_gather(quant_k_cache, page_table_1_flattened, page_size, extra_rows=0, out=None):
    """``gather_dequant_requant_fp8_paged_dsv4`` transcribed from ``dequant_k_cache.py:431-479``: the
    V4 gather's fp32 values (NoPE ``fp8 * exp2(s - 127)``, RoPE bf16) stored to an E4M3 tensor by the
    Triton store cast, RNE with saturation (clamp to +-448, then torch's RNE cast)."""
    assert extra_rows == 0 and out is None and quant_k_cache.is_contiguous()
    nope, rope = _v4_gathered_values(quant_k_cache, page_table_1_flattened, page_size)
    vals = torch.cat([nope, rope.to(torch.float32)], dim=1)
    return vals.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)[:, None, :]


def test_requant_gather_adapter_against_sglang_transcription(monkeypatch):
    """The FP8 workspace read back as values: every default gather case passes under the declared
    ``gather_out = e4m3_requant`` and fails under the bf16 gather's output (the policy decides)."""
    entry = _with_production(monkeypatch, "sglang.gather_dequant_requant_fp8", sglang_requant_gather)
    results = run_entry(entry, device="cpu")
    assert results and all(r.verdict == "pass" for r in results), [(r.case, r.verdict, r.message) for r in results]
    bf16 = dataclasses.replace(entry, policies=dict(entry.policies, gather_out="bf16"))
    assert all(r.verdict == "fail" and "gather_out=e4m3_requant" in r.message for r in run_entry(bf16, device="cpu"))


def _with_production(monkeypatch, name: str, fn):
    """The registry entry ``name`` runnable here: probe bypassed, ``sglang.triton_fn`` answering ``fn``."""
    monkeypatch.setattr(S, "triton_fn", lambda module, attr: fn)
    return dataclasses.replace(registry.get(name), probe=lambda: None)


def test_gather_adapter_against_sglang_transcription(monkeypatch):
    """Slots from the block table, the page buffer as SGLang sees it, the scatter back into the
    canonical ``[R, offset + max g, 512]``: every default gather case passes under the declared
    ``ue8m0 = triton``."""
    entry = _with_production(monkeypatch, "sglang.dequantize_k_cache_paged_dsv4", sglang_v4_dequant)
    results = run_entry(entry, device="cpu")
    assert results and all(r.verdict == "pass" for r in results), [(r.case, r.verdict, r.message) for r in results]


def _with_special_scales(case: Case) -> Case:
    """``case`` with scale bytes 0 and 255 in two tiles of request 0's first gathered row."""
    inp = dict(case.inputs)
    bs = inp["block_size"]
    cache = inp["cache"].clone()
    nb, p = cache.shape[0], cache.stride(0)
    flat = torch.as_strided(cache, (nb * p,), (1,), cache.storage_offset())
    seq, g = int(inp["seq_lens"][0]), int((inp["gather_lens"] if inp["gather_lens"] is not None else inp["seq_lens"])[0])
    pos = seq - g
    page, e = int(inp["block_table"][0, pos // bs]), pos % bs
    flat[page * p + bs * 576 + e * 8 + 2] = 0
    flat[page * p + bs * 576 + e * 8 + 5] = 255
    inp["cache"] = cache
    return Case(case.name + "-scale-0-255", case.stage, inp, dict(case.params))


def test_gather_policy_is_what_passes_scale_bytes_0_and_255(monkeypatch):
    """With scale bytes 0 and 255 in a gathered row the transcription passes under the declared
    ``ue8m0 = triton`` and fails under the exact E8M0 reading: the policy decides, the judge can fail."""
    entry = _with_production(monkeypatch, "sglang.dequantize_k_cache_paged_dsv4", sglang_v4_dequant)
    cases = [_with_special_scales(c) for c in default_cases("gather")]
    assert all(r.verdict == "pass" for r in run_entry(entry, cases, device="cpu"))
    exact = dataclasses.replace(entry, policies=dict(entry.policies, ue8m0=Ue8m0Consumer.EXACT.value))
    assert all(r.verdict == "fail" for r in run_entry(exact, cases, device="cpu"))


def sglang_norm_rope_store(kv, weight, eps, freqs_cis, positions, loc, cache):
    """torch transcription of ``_kv_norm_rope_fp8_store`` from its source: fp32 norm, RoPE from
    ``view_as_real(freqs_cis)`` pairs with separate multiplies (torch does not contract), rounding
    to kv's dtype, a saturating E4M3 cast, ``cache[loc] = row`` (PyTorch's negative index)."""
    x = kv.to(torch.float32)
    w = weight.to(torch.float32)
    inv = torch.rsqrt((x * x).sum(1, keepdim=True) / 512 + eps)
    y = x * inv * w
    f = torch.view_as_real(freqs_cis)[positions.long()]  # [T, 32, 2]
    e, o = y[:, 448::2], y[:, 449::2]
    c, s = f[..., 0], f[..., 1]
    y[:, 448::2], y[:, 449::2] = e * c - o * s, e * s + o * c
    y = y.to(kv.dtype).to(torch.float32).clamp(-448.0, 448.0)
    cache[loc.long()] = y.to(torch.float8_e4m3fn)


def test_norm_rope_store_adapter_against_sglang_transcription(monkeypatch):
    """complex64 ``freqs_cis`` from the cos/sin table, the pool copied and viewed as E4M3, negative
    slots left to the kernel: every default case passes under ``rope_arith = separate`` (what the
    torch transcription computes; the Triton kernel's contraction, ``fma``, is the GPU row's), and
    the negative-slot case fails when the entry declares that negative slots are skipped."""
    entry = _with_production(monkeypatch, "sglang.kv_norm_rope_store", sglang_norm_rope_store)
    sep = dataclasses.replace(entry, policies=dict(entry.policies, rope_arith="separate"))
    results = run_entry(sep, device="cpu")
    assert len(results) == 3 and all(r.verdict == "pass" for r in results), [(r.case, r.message) for r in results]
    skip = dataclasses.replace(sep, policies=dict(sep.policies, slot_skip="all_negative"))
    verdicts = {r.case: r.verdict for r in run_entry(skip, device="cpu")}
    assert verdicts == {"t8-bf16-rows64": "pass", "t6-negative-slots-rows32": "fail", "t4-fp32-kv-rows16": "pass"}
    case = default_cases("kv_norm_rope_store")[0]
    a = S.norm_rope_store_args(case.inputs)
    assert a["freqs_cis"].dtype == torch.complex64 and a["cache"].dtype == torch.float8_e4m3fn
    assert torch.equal(torch.view_as_real(a["freqs_cis"])[..., 1], case.inputs["cos_sin"][:, 32:])
    assert a["cache"].data_ptr() != case.inputs["cache"].data_ptr()  # written in place: a copy


def _sglang_paged_prefill(q, unified_kv, kv_indices_prefix, kv_indptr_prefix, kv, kv_indices_extend,
                          kv_indptr_extend, attn_sink, softmax_scale):
    """torch transcription of ``_sparse_attn_v4_paged_prefill_kernel``'s contract from its source: per
    token the prefix list ``indices[indptr[t]:indptr[t+1]]`` then the extend list, negative entries
    skipped, one softmax with the sink as a V = 0 column (float64 here, no bf16 P), 0 where the
    denominator is 0."""
    t_n, h, _ = q.shape
    out = torch.zeros_like(q)
    for t in range(t_n):
        rows = []
        for pool, ind, ptr in ((unified_kv, kv_indices_prefix, kv_indptr_prefix), (kv, kv_indices_extend, kv_indptr_extend)):
            sl = ind[int(ptr[t]):int(ptr[t + 1])].long()
            rows.append(pool[sl[sl >= 0]])
        k = torch.cat(rows).double()
        s = q[t].double() @ k.T * softmax_scale  # [H, n]
        m = torch.maximum(s.max(dim=1).values if k.shape[0] else torch.full((h,), float("-inf"), dtype=torch.float64),
                          attn_sink.double())
        p = torch.exp(s - m[:, None])
        den = p.sum(1) + torch.exp(attn_sink.double() - m)
        out[t] = torch.where(den[:, None] > 0, (p @ k) / den[:, None], 0.0).to(q.dtype)
    return out


def test_paged_prefill_adapter_against_sglang_transcription(monkeypatch):
    """The workspace as the unified pool, each token's first ``topk_length`` columns as its flat
    prefix list, an empty extend region, the sink (or ``-inf``): the default prefill cases pass or
    are skipped for an index ``>= S`` (the kernel would read it), never judged otherwise."""
    entry = _with_production(monkeypatch, "sglang.paged_prefill", _sglang_paged_prefill)
    names = ("h64-c4a-top128-chunked", "h64-c128a-oob-mix", "sweep-tiny-kv-no-lengths")  # lengths, oob, none
    results = run_entry(entry, [c for c in default_cases("prefill") if c.name in names], device="cpu")
    assert {r.case: r.verdict for r in results} == {names[0]: "pass", names[1]: "skip", names[2]: "pass"}, \
        [(r.case, r.verdict, r.message) for r in results]
    assert ">= S" in next(r.message for r in results if r.verdict == "skip")
    no_sink = dataclasses.replace(entry, call=lambda c: {"out": _sglang_paged_prefill(
        **dict(S.paged_prefill_args(c), attn_sink=torch.full((c.inputs["q"].shape[1],), float("-inf"))))})
    sinks = [c for c in default_cases("prefill") if c.name == "sweep-huge-q-sinks"]
    assert [r.verdict for r in run_entry(no_sink, sinks, device="cpu")] == ["fail"]  # the sink reaches the kernel
    case = next(c for c in default_cases("prefill") if c.inputs.get("topk_length") is not None)
    a = S.paged_prefill_args(case)
    assert a["kv_indptr_prefix"].dtype == torch.int32 and int(a["kv_indptr_prefix"][-1]) == a["kv_indices_prefix"].numel()
    k = case.inputs["indices"].shape[1]
    assert int(a["kv_indptr_prefix"][-1]) == int(case.inputs["topk_length"].to(torch.int64).clamp(0, k).sum())


def _sglang_paged_decode(q, unified_kv, kv_indices, kv_indptr, attn_sink, softmax_scale):
    """The decode kernel's contract: every entry a slot of the pool (no sentinel check), then the
    prefill transcription's softmax with the sink (the two kernels share it, paged_prefill.py:31-33)."""
    assert bool(((kv_indices >= 0) & (kv_indices < unified_kv.shape[0])).all()), "a sentinel reached the kernel"
    empty = torch.zeros(q.shape[0] + 1, dtype=torch.int32)
    return _sglang_paged_prefill(q, unified_kv, kv_indices, kv_indptr, unified_kv[:1], empty[:0], empty, attn_sink,
                                 softmax_scale)


def test_paged_decode_adapter_against_sglang_transcription(monkeypatch):
    """SWA and compressed caches dequantised into one bf16 pool, each token's valid entries (inside
    its lengths, inside its cache) as one ragged list: NaN-poisoned unwritten slots, lonely rows,
    empty extra segments and no-sink cases pass."""
    entry = _with_production(monkeypatch, "sglang.paged_decode", _sglang_paged_decode)
    names = ("h64-swa-bs64-nanpoison", "h64-c4a-lonely-and-empty-extra", "sweep-odd-pages-61-576-no-sink")
    results = run_entry(entry, [c for c in default_cases("decode") if c.name in names], device="cpu")
    assert len(results) == 3 and all(r.verdict == "pass" for r in results), [(r.case, r.message) for r in results]


def test_index_adapters_pass_int32_and_copy_outputs(monkeypatch):
    seen = {}

    def combine(**kw):
        seen.update(kw)
        from dsv4_numerics.reference.indices.sglang import combine_topk_swa_indices_sglang as ref
        return ref(**kw)

    entry = _with_production(monkeypatch, "sglang.combine_topk_swa_indices", combine)
    results = run_entry(entry, device="cpu")
    assert [r.verdict for r in results if r.verdict != "skip"] == ["pass"]
    assert all(v.dtype == torch.int32 for v in seen.values() if isinstance(v, torch.Tensor))
    case = next(c for c in default_cases("swa_indices") if c.params["builder"] == "v4_paged_decode_indices")
    a = S.paged_decode_indices_args(case.inputs)
    assert a["swa_indices"].data_ptr() != case.inputs["swa_indices"].data_ptr()  # written in place: a copy
    assert a["positions"].dtype == torch.int32


def test_decode_adapter_reads_lse_as_b_sq_h(monkeypatch):
    """``triton_fp8_attention_fwd`` returns ``lse [b, s_q, h]`` (FlashMLA: a ``[b, h, s_q]`` view):
    a recorder returning ``lse[b, 0, h] = 1000 b + h`` must come back as ``lse[t, h] = 1000 t + h``,
    ``+inf`` (lonely) as ``-inf``."""
    case = default_cases("decode")[0]
    calls = {}

    def attend(**kw):
        calls.update(kw)
        b, s_q, hp = kw["q"].shape[:3]
        lse = (torch.arange(b)[:, None, None] * 1000.0 + torch.arange(hp)[None, None, :]).expand(b, s_q, hp).clone()
        lse[0, 0, 0] = float("inf")
        return torch.zeros(b, s_q, hp, 512, dtype=torch.bfloat16), lse

    monkeypatch.setattr(S, "triton_fn", lambda module, attr: attend)
    got = registry.get("sglang.triton_sparse_decode").call(case)
    t, h = case.inputs["q"].shape[:2]
    want = torch.arange(t)[:, None] * 1000.0 + torch.arange(h)[None, :]
    want[0, 0] = float("-inf")
    assert torch.equal(got["lse"], want.float())
    assert calls["tile_scheduler_metadata"] is None and calls["indices"].dtype == torch.int32


# --------------------------------------------------------------------------- cross-engine (reference level)


def _rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, 512, generator=g) * torch.logspace(-6, 3, n)[:, None]
    return k.to(torch.bfloat16)


def test_v4_page_layout_is_model1_with_vllms_padding():
    """SGLang's ``KVLayout.V4.page_bytes(bs) = ceil(bs*584, 576)`` (``kv_layout.py:101-104``) is
    vLLM's page stride for every block size; rows written by the reference at that stride through
    a permuted block table read back identically through vLLM's gather (block table, positions)
    and SGLang's reader (the slot list): 0 differing values."""
    for bs in (1, 2, 53, 64, 128, 256):
        assert -(-bs * 584 // 576) * 576 == production_page_stride(bs)
    bs, n = 64, 150
    table = torch.tensor([2, 0, 1])
    slots = table.repeat_interleave(bs)[:n] * bs + torch.arange(n) % bs
    k = _rows(n, 1)
    cache = cm.insert(cm.empty_cache(3, bs), k, slots, bs, rule=ScaleRule.AMAX_CLAMP)
    vllm_rows, valid = cm.gather(cache, table[None], torch.tensor([n]), bs, consumer=Ue8m0Consumer.TRITON)
    sglang_rows = sglang_v4_dequant(cache, slots, bs)[:, 0]
    assert bool(valid.all()) and vllm_rows.shape == (1, n, 512)
    assert int((vllm_rows[0].view(torch.int16) != sglang_rows.view(torch.int16)).sum()) == 0
    assert not torch.equal(sglang_rows, sglang_v4_dequant(cache, torch.arange(n), bs)[:, 0])  # order matters


def test_scale_decode_differences_counted_and_explained():
    """Scale bytes 0 and 255 written into the tiles of a cache: SGLang's Triton readers (``ue8m0 =
    triton``) and FlashMLA's decode (``flashmla``) disagree exactly on the 64 values of each such
    tile and nowhere else."""
    bs = 2
    cache = cm.insert(cm.empty_cache(2, bs), _rows(4, 2), torch.arange(4), bs, rule=ScaleRule.AMAX_CLAMP)
    flat = cache.view(-1)
    special = {(0, 1): 0, (1, 3): 255, (3, 6): 0}  # (slot, tile) -> scale byte
    for (slot, tile), byte in special.items():
        page, e = divmod(slot, bs)
        flat[page * cache.stride(0) + bs * 576 + e * 8 + tile] = byte
    sg = sglang_v4_dequant(cache, torch.arange(4), bs)[:, 0].to(torch.float64)
    fm = cm.dequantize_slots(cache, torch.arange(4), bs, consumer=Ue8m0Consumer.FLASHMLA).to(torch.float64)
    differ = ~((sg == fm) | (sg.isnan() & fm.isnan()))
    tiles = {(int(s), int(d) // 64) for s, d in torch.nonzero(differ)}
    assert tiles <= set(special) and len(tiles) >= 2
    # every differing value lies in one of the tiles, and the difference is the scale byte's reading
    for s, t in tiles:
        nz = fm[s, t * 64:(t + 1) * 64] != 0
        assert bool(differ[s, t * 64:(t + 1) * 64][nz].all())
    assert torch.equal(sg.to(torch.bfloat16), cm.dequantize_slots(cache, torch.arange(4), bs, consumer="triton"))


def test_v41_block_split_vs_interleaved_counted():
    """SGLang's ``KVLayout.V41`` stores a page block-split (all data rows, then all scale rows:
    ``page_footer``), ``V41_NEW`` interleaved (vLLM's order). The same rows written in one order
    and read in the other: every token whose scales move reads wrong values (all of them for
    ``bs = 4``: token 0's data is in place, its scales are not); read in its own order: 0."""
    bs, n = 4, 8
    k = _rows(n, 3)
    for rec in (V41Record.MXFP8, V41Record.NVFP4):
        split = v41.insert(v41.empty_cache(2, bs, rec), k, torch.arange(n), bs, rec, V41Layout.PAGE_FOOTER)
        own = v41.dequantize_slots(split, torch.arange(n), bs, rec, V41Layout.PAGE_FOOTER)
        other = v41.dequantize_slots(split, torch.arange(n), bs, rec, V41Layout.INTERLEAVED)
        inter = v41.insert(v41.empty_cache(2, bs, rec), k, torch.arange(n), bs, rec, V41Layout.INTERLEAVED)
        assert torch.equal(own.view(torch.int16), v41.dequantize_slots(inter, torch.arange(n), bs, rec,
                                                                        V41Layout.INTERLEAVED).view(torch.int16))
        wrong_tokens = int((own.view(torch.int16) != other.view(torch.int16)).any(dim=1).sum())
        assert wrong_tokens == n, (rec, wrong_tokens)


def test_combine_sglang_vs_vllm_common_counted_and_explained():
    """The c4 default case through both combines: exactly the entries whose top-k value is
    negative inside ``topk_len`` of a request ``r > 0`` differ (``M*r - 1`` vs ``-1``); under
    ``invalid_topk = shifted_by_base`` the SGLang reference reproduces vLLM's rows exactly."""
    common = combine_c4_inputs()
    vllm_idx, vllm_len = combine_topk_swa_indices(**common)
    sg = sglang_combine_inputs(common)
    sg_idx, sg_len = combine_topk_swa_indices_sglang(**sg)
    assert torch.equal(vllm_len, sg_len)
    diff = torch.nonzero(vllm_idx != sg_idx).tolist()
    assert diff == [[4, 1]]  # token 4 (request 1), column 1: the interior -1 of combine_c4_inputs
    assert int(common["topk_indices"][4, 1]) == -1
    assert int(vllm_idx[4, 1]) == common["M"] * 1 - 1 and int(sg_idx[4, 1]) == -1
    shifted, _ = combine_topk_swa_indices_sglang(**sg, invalid_topk=CombineInvalidTopk.SHIFTED_BY_BASE)
    assert torch.equal(shifted, vllm_idx)


def test_ring_indices_by_hand():
    """``v4_paged_decode_indices`` on the default ring case, expected values worked out by hand
    from ``paged_decode_indices.py:71-86``."""
    case = next(c for c in default_cases("swa_indices") if c.params["builder"] == "v4_paged_decode_indices")
    out = stages.get("swa_indices").expected(case, {})
    t0 = [43, 44, 45, 46, 47, 48, 49, 40]  # slot 4, positions 13..20 on a ring of 10
    t1 = [76, 77, 78, 79, 70, 71, 72, 73]  # slot 7, positions 6..13
    t2 = [10, 11, 12]                      # slot 1, positions 0..2 (short window)
    assert out["swa_indices"].tolist() == t0 + t1 + t2 + [-2] * 5
    assert out["csa_indices"].tolist() == t0 + [-2] * 2 + t1 + [-2] * 2 + t2 + [-2] * 7
    assert out["hca_indices"].tolist() == t0 + [-2] + t1 + t2 + [-2] * 6


def test_swa_token_ids_by_hand():
    case = next(c for c in default_cases("swa_indices") if c.params["builder"] == "build_swa_token_ids")
    out = stages.get("swa_indices").expected(case, {})
    inp = case.inputs
    assert out["swa_gather_lens"].tolist() == [5, 129, 1]      # min(seq, extend + 127)
    assert out["swa_first_pos"].tolist() == [0, 171, 0]
    assert out["swa_offsets"].tolist() == [0, 5, 134, 135]
    r2t, f2s = inp["req_to_token"].to(torch.int64), inp["full_to_swa"]
    want = [int(f2s[r2t[2, p]]) for p in range(5)] + [int(f2s[r2t[0, p]]) for p in range(171, 300)] + [int(f2s[r2t[3, 0]])]
    assert out["swa_token_ids"].tolist() == want


def test_bad_input_names_the_argument():
    from dsv4_numerics.reference.errors import InputError

    sg = sglang_combine_inputs(combine_c4_inputs())
    with pytest.raises(InputError, match="query_pos"):
        combine_topk_swa_indices_sglang(**dict(sg, query_pos=-sg["query_pos"] - 1))
    with pytest.raises(InputError, match="invalid_topk"):
        combine_topk_swa_indices_sglang(**sg, invalid_topk="nope")
    case = next(c for c in default_cases("gather"))
    with pytest.raises(InputError, match="block_table"):
        S.gather_slots(dict(case.inputs, block_table=case.inputs["block_table"][:, :1]))
