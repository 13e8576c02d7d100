"""Deliberately wrong implementations of the pipeline stages (the mutation suite, issue 5).

Each mutant is a small function over the reference that reproduces one real bug class (cited),
wrapped as an entry-like object with the fields of ``kernels.registry.KernelEntry`` (family
``"mutant"``), so it is judged by exactly the runner, comparators and tolerance records the kernel
matrix uses (``oracles.matrix.run_entry``). ``tests/test_mutants.py`` requires every mutant to be
caught on the default case set, and the reference itself (``reference_entry``) to pass.

A mutant that survives means a default case or a judge is too weak -- never a reason to weaken
the mutant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dsv4_numerics.oracles import stages as st
from dsv4_numerics.oracles.matrix import expected_outputs
from dsv4_numerics.reference.caches import model1 as cache_model1
from dsv4_numerics.reference.caches import v41 as cache_v41
from dsv4_numerics.reference.formats import fp4
from dsv4_numerics.reference.pipeline import query_quant
from dsv4_numerics.reference.attention.ordered import Segment, sparse_attention
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.constants import DATA_ROW_BYTES, E4M3_MAX, NOPE_DIM, RECORD_BYTES, SCALE_FLOOR_F32, TILE
from dsv4_numerics.reference.formats.fp8 import decode_fp8, decode_ue8m0, encode_fp8, pow2_f64
from dsv4_numerics.reference.caches.gather_plan import gather_plan
from dsv4_numerics.reference.policies import Fp8Flavour, IndexRule, RopeArithmetic, ScaleRule


@dataclass(frozen=True)
class MutantEntry:
    """Entry-like wrapper (the ``KernelEntry`` fields ``run_entry`` reads)."""

    name: str
    stage: str
    bug: str  # the bug class and where it was seen
    call: Callable[[Case], dict]
    policies: dict[str, str] = field(default_factory=dict)
    family: str = "mutant"
    source: str = "tests/mutants.py"
    archs: tuple[str, ...] = ("cpu",)
    dtypes: tuple[str, ...] = ("bfloat16",)
    dimension: str = ""  # the case-sweep dimension that alone catches it (reference/cases/attention_sweep.py)

    @property
    def tolerance_scope(self) -> str:
        return f"mutant.{self.name}"

    def probe(self) -> str | None:
        return None


def _outputs(d: dict) -> dict:
    return {k: v for k, v in d.items() if not k.startswith("_")}


def reference_entry(stage: str, policies: dict | None = None, bf16_p: bool = False,
                    memo: dict | None = None) -> MutantEntry:
    """The reference wrapped as an entry (positive control). ``bf16_p``: a numeric stage returns
    the oracle's bf16-kernel emulation instead (must pass the same tolerance tier). ``memo``: the
    ``expected_cache`` dict given to ``run_entry`` (same key), so the reference runs once."""
    spec = st.get(stage)
    pol = dict(policies or {})
    if bf16_p:
        pol["attention_mode"] = "bf16_p"

    def call(case: Case) -> dict:
        full = spec.policies(pol)
        e = expected_outputs(spec, stage, case, full, memo)
        out = _outputs(e)
        if bf16_p:
            out["out"] = e["_same_precision"].to(torch.bfloat16)
        elif spec.kind == "numeric" and "out" in out and stage != "rope":
            out["out"] = out["out"].to(torch.bfloat16)  # what a bf16 kernel returns
        return out

    return MutantEntry(f"reference.{stage}" + (".bf16_p" if bf16_p else ""), stage, "none (positive control)",
                       call, pol, family="reference")


def fp32_compressor_entry() -> MutantEntry:
    """The fp32 producer model the compressor tolerance was derived from (positive control)."""
    from dsv4_numerics.oracles.derive import compressor_fp32
    from dsv4_numerics.reference.pipeline.compressor import state_windows

    def call(case: Case) -> dict:
        inp = case.inputs
        kv, score, valid = state_windows(inp["state"], inp["positions"], inp["ratio"])
        return {"normed": compressor_fp32(kv, score, valid, inp["norm_weight"], inp["eps"])}

    return MutantEntry("reference.pipeline.compressor.fp32_model", "compressor", "none (positive control)", call,
                       family="reference")


# --------------------------------------------------------------------------- cache writers


def _flat(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(-1) if cache.is_contiguous() else cache.reshape(-1)


def _write_records(case: Case, data: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor,
                   layout: str = "planar") -> dict:
    """Write record parts at ``slots`` under a (possibly wrong) layout into a copy of the cache."""
    inp = case.inputs
    out = inp["cache"].clone()
    flat = _flat(out)
    bs, P = inp["block_size"], inp["cache"].stride(0)
    for t, s in enumerate(slots.tolist()):
        page, e = divmod(s, bs)
        if layout == "interleaved":  # V4.1-style per-token records (vFMLA :119-131, H10)
            base = page * P + e * RECORD_BYTES
            flat[base:base + DATA_ROW_BYTES] = data[t]
            flat[base + DATA_ROW_BYTES:base + RECORD_BYTES] = scales[t]
            continue
        pstride = {"packed": bs * RECORD_BYTES,  # packed: stride(0) ignored (H12)
                   "sglang_padded": -(-bs * RECORD_BYTES // DATA_ROW_BYTES) * DATA_ROW_BYTES}.get(layout, P)
        d0 = page * pstride + e * DATA_ROW_BYTES
        s0 = page * pstride + bs * DATA_ROW_BYTES + e * 8
        if s0 + 8 > flat.numel():  # past the allocation: an out-of-bounds write, lost here
            continue
        flat[d0:d0 + DATA_ROW_BYTES] = data[t]
        flat[s0:s0 + 8] = scales[t]
    return {"cache": out}


def _kept(case: Case):
    s = case.inputs["slot_mapping"].to(torch.int64)
    keep = s >= 0
    return case.inputs["k"][: s.shape[0]][keep], s[keep]


def _layout_mutant(layout: str, rule: str = ScaleRule.AMAX_CLAMP.value):
    def call(case: Case) -> dict:
        k, slots = _kept(case)
        data, scales = cache_model1.encode_records(k, rule)
        return _write_records(case, data, scales, slots, layout)
    return call


def _insert_with(rule: str, **kw):
    def call(case: Case) -> dict:
        inp = case.inputs
        return {"cache": cache_model1.insert(inp["cache"], inp["k"], inp["slot_mapping"], inp["block_size"], rule, **kw)}
    return call


def _minus1_as_slot0(case: Case) -> dict:
    """Every ``-1`` token written to slot 0 (a writer that clamps the sentinel to 0 instead of
    skipping it; datapath 2.1 step 1 / 2.2: only ``slot >= 0`` may be written)."""
    inp = case.inputs
    out = cache_model1.insert(inp["cache"], inp["k"], inp["slot_mapping"], inp["block_size"], ScaleRule.AMAX_CLAMP)
    s = inp["slot_mapping"].to(torch.int64)
    for t in (s == -1).nonzero().reshape(-1).tolist():
        data, scales = cache_model1.encode_records(inp["k"][t:t + 1], ScaleRule.AMAX_CLAMP)
        out = _write_records(Case(case.name, case.stage, {**inp, "cache": out}), data, scales, torch.tensor([0]))["cache"]
    return {"cache": out}


def _approx_log2_writer(case: Case) -> dict:
    """Q_A with ``log2`` computed approximately in float32 (``ln(r) * fl32(1/ln 2)``) before the ceil:
    the fast-math bug class of datapath 2.8 / H2 (exact ties ``amax = 1.75 * 2**m`` go to m - 7)."""
    k, slots = _kept(case)
    x = k[:, :NOPE_DIM].to(torch.float32).reshape(-1, NOPE_DIM // TILE, TILE)
    a = x.abs().amax(-1)
    r = torch.maximum(a, torch.tensor(SCALE_FLOOR_F32, dtype=torch.float32)) / torch.tensor(E4M3_MAX, dtype=torch.float32)
    e = torch.ceil(torch.log(r) * torch.tensor(1.0 / math.log(2.0), dtype=torch.float32)).to(torch.int64)
    y = x.to(torch.float64) * pow2_f64(-e).unsqueeze(-1)
    codes = encode_fp8(y, Fp8Flavour.E4M3FN, clamp=E4M3_MAX).reshape(-1, NOPE_DIM)
    data, scales = cache_model1.encode_records(k, ScaleRule.AMAX_CLAMP)
    data[:, :NOPE_DIM] = codes
    scales[:, : NOPE_DIM // TILE] = torch.clamp(e + 127, 0, 255).to(torch.uint8)
    return _write_records(case, data, scales, slots)


# --------------------------------------------------------------------------- gather


def _gather_as(flavour: str):
    def call(case: Case) -> dict:
        inp = case.inputs
        out, _ = cache_model1.gather(inp["cache"], inp["block_table"], inp["seq_lens"], inp["block_size"],
                                     inp.get("gather_lens"), flavour=flavour)
        return {"out": out}
    return call


# --------------------------------------------------------------------------- index stages


def _index(case: Case, **override: Any) -> dict:
    from dsv4_numerics.reference.cases.index import INDEX_BUILDERS

    fn, names = INDEX_BUILDERS[override.pop("_builder", case.params["builder"])]
    res = fn(**{**case.inputs, **override})
    return dict(zip(names, res if isinstance(res, tuple) else (res,)))


def _topk_minus1_as_local0(case: Case) -> dict:
    """``-1`` local indices mapped through the block table as local index 0 (no sentinel check,
    datapath 4.1 / H10: a valid slot of the request appears where the row is empty)."""
    if case.params["builder"] != "compute_global_topk_indices_and_lens":
        return _index(case)
    out = _index(case)
    topk = case.inputs["topk_indices"].to(torch.int64)
    zero = _index(case, topk_indices=torch.zeros_like(case.inputs["topk_indices"]))
    out["global_topk_indices"] = torch.where(topk == -1, zero["global_topk_indices"], out["global_topk_indices"])
    return out


def _topk_wrong_request_row(case: Case) -> dict:
    """Block-table row chosen by the token index instead of ``token_to_req_indices``."""
    if "token_to_req_indices" not in case.inputs:
        return _index(case)
    t2r = case.inputs["token_to_req_indices"]
    R = case.inputs["block_table"].shape[0]
    return _index(case, token_to_req_indices=(torch.arange(t2r.shape[0]) % R).to(t2r.dtype))


def _swa_lens_forced_to_window(case: Case) -> dict:
    """``swa_lens`` forced to the window size for every valid token (vLLM#41757, H18)."""
    out = _index(case)
    if "swa_lens" in out:
        ln = out["swa_lens"]
        out["swa_lens"] = torch.where(ln > 0, torch.full_like(ln, case.inputs["window_size"]), ln)
    return out


def _swa_window_off_by_one(case: Case) -> dict:
    """Window start ``p - W`` instead of ``p - (W - 1)``: one stale token in, the newest one out."""
    W = case.inputs["window_size"]
    out = _index(case, window_size=W + 1)
    if "swa_indices" in out:
        out["swa_indices"] = out["swa_indices"][:, :W]
        out["swa_lens"] = torch.clamp(out["swa_lens"], max=W)
    return out


def _combine_without_request_offset(case: Case) -> dict:
    """Request ``r``'s workspace offset ``M * r`` forgotten (every request reads request 0's rows)."""
    out = _index(case)
    if case.params["builder"] not in ("combine_topk_swa_indices", "combine_topk_swa_indices_rocm"):
        return out
    qsl = case.inputs["query_start_loc"].to(torch.int64)
    M = case.inputs["M"]
    idx = out["combined_indices"].to(torch.int64).clone()
    for r in range(qsl.shape[0] - 1):
        rows = slice(int(qsl[r]), int(qsl[r + 1]))
        idx[rows] = torch.where(idx[rows] >= 0, idx[rows] - M * r, idx[rows])
    out["combined_indices"] = idx.to(out["combined_indices"].dtype)
    return out


def _combine_common_validates(case: Case) -> dict:
    """The common combine validating ``-1`` like the ROCm twin: it must not (datapath 4.5, H10:
    the common kernel turns an interior ``-1`` into ``M*r - 1``)."""
    if case.params["builder"] == "combine_topk_swa_indices":
        return _index(case, _builder="combine_topk_swa_indices_rocm")
    return _index(case)


def _builder_with(builder: str, **override: str) -> Callable[[Case], dict]:
    """The index reference with ``override`` (named policies of ``builder``) on ``builder``'s cases;
    every other builder's cases as the reference builds them."""

    def call(case: Case) -> dict:
        return _index(case, **override) if case.params["builder"] == builder else _index(case)

    return call


def _mixed_replay_start_dropped(case: Case) -> dict:
    """vLLM's V4.1 mixed-table builder with ``replay_start`` dropped: every prefill window starts at
    ``max(p - (W-1), 0)`` as in V4, reading window KV below the request's replay start."""
    return _index(Case(case.name, case.stage, {k: v for k, v in case.inputs.items() if k != "replay_start"},
                       case.params))


def _v41_compress(case: Case, ring_head: bool = False, first_without_ring: bool = False,
                  rope_at_last: bool = False) -> dict:
    """vLLM V4.1's fused compressor (``compressor_v41``) with one rule broken: ``ring_head`` stores
    the chunk's FIRST ``capacity`` rows to the ring instead of its last; ``first_without_ring``
    pools a chunk's first group from its current row only (the ring predecessor dropped);
    ``rope_at_last`` rotates at the group's last position ``p`` instead of ``p // r * r``."""
    from dsv4_numerics.oracles.stages import v41_compress as sc
    from dsv4_numerics.reference.pipeline.compressor import compress_windows
    from dsv4_numerics.reference.pipeline.rope import cos_sin_cache

    spec = st.get("v41_compress_insert")
    pol = spec.policies({})
    e = spec.expected(case, pol)
    inp = case.inputs
    out = {"latent": e["latent"].clone(), "cache": e["cache"]}
    if "state" in e:
        out["state"] = e["state"]
    if ring_head and inp["compress_ratio"] == 2:
        state, cap = inp["state_cache"].clone(), inp["state_cache"].shape[1]
        qsl, slots = inp["query_start_loc"].tolist(), inp["state_slots"].tolist()
        for r in range(len(qsl) - 1):
            a, b = qsl[r], qsl[r + 1]
            if a < b and slots[a] >= 0:
                for u in range(a, a + min(b - a, cap)):
                    if slots[u] >= 0:
                        state[slots[u] // cap, slots[u] % cap] = inp["kv_score"][u]
        out["state"] = state
    if first_without_ring and inp["compress_ratio"] == 2:
        tok = e["_tokens"]
        first = torch.tensor([int(t) == int(inp["query_start_loc"][int(inp["token_to_req_indices"][t])])
                              for t in tok.tolist()], dtype=torch.bool)
        if bool(first.any()):
            cur = inp["kv_score"][tok[first]]
            kv = torch.stack((torch.zeros_like(cur[:, :512]), cur[:, :512]), dim=1)  # row 0 masked below
            sc_ = torch.stack((torch.zeros_like(cur[:, 512:]), cur[:, 512:]), dim=1)
            valid = torch.tensor([[False, True]]).expand(kv.shape[0], 2)
            normed = compress_windows(kv.contiguous(), sc_.contiguous(), valid.contiguous(), inp["norm_weight"],
                                      inp["eps"])
            out["latent"][tok[first]] = normed.to(torch.bfloat16)
            out["cache"] = sc.v41_compress_expected_cache(case, out["latent"], pol)
    if rope_at_last:
        shifted = Case(case.name, case.stage, dict(inp, cos_sin=cos_sin_cache(inp["cos_sin"].shape[0] + 1)[1:]),
                       case.params)
        out["cache"] = sc.v41_compress_expected_cache(shifted, out["latent"], pol)
    return out


def _v41_indexer(case: Case, rope_at_last: bool = False, nibbles_swapped: bool = False) -> dict:
    """vLLM V4.1's indexer K store (``caches.indexer_v41``) with one rule broken: RoPE at the
    group's last position instead of its first; MXFP4 nibbles swapped (even element high)."""
    from dsv4_numerics.reference.caches.indexer_v41 import insert_indexer_k
    from dsv4_numerics.reference.pipeline.rope import cos_sin_cache

    i = dict(case.inputs)
    if rope_at_last:
        i["cos_sin"] = cos_sin_cache(i["cos_sin"].shape[0] + 1)[1:]
    out = insert_indexer_k(i["cache"], i["k_pre"], i["positions"], i["cos_sin"], i["weight"], i["eps"], i["slots"],
                           i["compress_ratio"], i["record"])
    if nibbles_swapped and i["record"] == "mxfp4":
        nb, bs, rb = out.shape
        vw = rb - 4
        pages = out.reshape(nb, bs * rb)
        new = pages[:, :bs * vw] != i["cache"].reshape(nb, bs * rb)[:, :bs * vw]  # bytes the store changed
        vals = pages[:, :bs * vw]
        pages[:, :bs * vw] = torch.where(new, (vals >> 4) | (vals << 4), vals)
    return {"cache": out}


def _ring_not_wrapped(case: Case) -> dict:
    """SGLang's paged-decode SWA prefix without the ring wrap (``slot * ring_stride + abs_pos``
    instead of ``+ abs_pos % ring_stride``): reads another sequence's ring once ``pos >= ring_stride``."""
    if case.params["builder"] != "v4_paged_decode_indices":
        return _index(case)
    big = case.inputs["ring_stride"] * 1000  # no wrap for any position of the default cases
    out = _index(case, ring_stride=big)
    slots = case.inputs["state_slot_per_seq"].to(torch.int64)
    for k in ("swa_indices", "csa_indices", "hca_indices"):
        v = out[k].to(torch.int64)
        written = v >= 0
        # slot * big + abs_pos  ->  slot * ring_stride + abs_pos
        v = torch.where(written, (v // big) * case.inputs["ring_stride"] + v % big, v)
        out[k] = v.to(torch.int32)
    assert slots.numel()
    return out


# --------------------------------------------------------------------------- attention


_PLAIN: dict[int, tuple[Case, Any]] = {}  # id(case) -> (case, the ordered oracle on its own segments)


def _copy(r):
    return type(r)(**{k: v.clone() for k, v in r.as_dict().items()})


def _oracle(case: Case, segs: list, **kw: Any):
    """The ordered oracle on ``case`` with ``segs`` (and ``kw``: ``scale``, ``sink``, ``sparse_attention``'s
    options). The plain call -- the case's own segments (``_segs``), nothing overridden -- is what
    most attention mutants start from: it runs once per case and process, and each caller gets its
    own copies of the outputs (a mutant may change them in place)."""
    inp = case.inputs
    hit = _SEGS.get(id(case))
    plain = not kw and hit is not None and hit[0] is case and segs is hit[1]
    if plain:
        memo = _PLAIN.get(id(case))
        if memo is not None and memo[0] is case:
            return _copy(memo[1])
    res = sparse_attention(inp["q"], segs, kw.pop("scale", inp["scale"]), kw.pop("sink", inp.get("sink")), **kw)
    if plain:
        if len(_PLAIN) >= 64:  # bounded as _SEGS
            _PLAIN.clear()
        _PLAIN[id(case)] = (case, _copy(res))
    return res


def attn_out(res, lse: torch.Tensor | None = None) -> dict:
    return {"out": res.out.to(torch.bfloat16), "lse": (res.lse if lse is None else lse).to(torch.float32),
            "max_logits": res.max_logits.to(torch.float32)}


_SEGS: dict[int, tuple[Case, list]] = {}  # id(case) -> (case, segments): the mutants share one dequantisation


def _segs(case: Case) -> list:
    hit = _SEGS.get(id(case))
    if hit is not None and hit[0] is case:
        return hit[1]
    if case.stage == "decode":
        segs = st.decode_segments(case, {})
    else:
        segs = st.prefill_segments(case, {"index_rule": case.params.get("index_rule", "minus1_only")})
    if len(_SEGS) >= 64:  # bounded: the default cases of both stages fit
        _SEGS.clear()
    _SEGS[id(case)] = (case, segs)
    return segs


def _extra_dropped(case: Case) -> dict:
    """The compressed (extra) segment not attended: main-only decode."""
    return attn_out(_oracle(case, _segs(case)[:1]))


def _separate_softmaxes(case: Case) -> dict:
    """Each segment softmaxed on its own and the outputs added (attention 2.6 requires one softmax
    over the union)."""
    segs = _segs(case)
    if len(segs) == 1:
        return attn_out(_oracle(case, segs))
    parts = [_oracle(case, [s]) for s in segs]
    out = sum(p.out for p in parts)
    return {"out": out.to(torch.bfloat16), "lse": parts[0].lse.to(torch.float32)}


def sink_negated(case: Case) -> dict:
    """Sink applied with the wrong sign (``sigmoid(lse + sink)``)."""
    sink = case.inputs.get("sink")
    return attn_out(_oracle(case, _segs(case), sink=None if sink is None else -sink))


def _sink_scaled(case: Case) -> dict:
    """Sink multiplied by the softmax scale (attention 1.1, H14: the sink is never scaled)."""
    sink = case.inputs.get("sink")
    return attn_out(_oracle(case, _segs(case), sink=None if sink is None else sink * case.inputs["scale"]))


def _lse_base2(case: Case) -> dict:
    """LSE returned in base 2 (FlashMLA README's stale claim, attention 2.1; FI SM120's convention)."""
    r = _oracle(case, _segs(case))
    return attn_out(r, r.lse / math.log(2.0))


LSE_OFFSET = 2.0**-12  # the constant-offset mutant's shift (~2.4e-4: 25x the tier-A lse atol)


def _lse_sink_merged(case: Case) -> dict:
    """The sink term ``ln(1 + exp(sink - lse))`` folded into the returned sink-free LSE (a sink-merged
    LSE, FlashInfer SM120's convention, returned where the sink-free one is declared; attention 2.2).
    Lonely rows and ``+-inf`` sinks keep the sink-free value, so only the tolerance, not the anomaly
    rule, can catch it."""
    r = _oracle(case, _segs(case))
    return attn_out(r, torch.where(torch.isfinite(r.lse) & torch.isfinite(r.lse_with_sink), r.lse_with_sink, r.lse))


def _lse_offset(case: Case) -> dict:
    """LSE off by a constant ``LSE_OFFSET`` (a stale correction term): the per-row logit allowance
    (issue 23) must not hide it."""
    r = _oracle(case, _segs(case))
    return attn_out(r, r.lse + LSE_OFFSET)


def _lonely_nan(case: Case) -> dict:
    """A query with no valid key gives 0/0 = NaN instead of exact 0 (attention 2.4)."""
    r = _oracle(case, _segs(case))
    lonely = (r.n_valid == 0).reshape(-1, 1, 1)
    out = torch.where(lonely, torch.full_like(r.out, float("nan")), r.out)
    return {"out": out.to(torch.bfloat16), "lse": r.lse.to(torch.float32)}


def _lse_plus_inf_lonely(case: Case) -> dict:
    """FlashMLA's ``+inf`` empty-row LSE passed through without conversion (H1)."""
    r = _oracle(case, _segs(case))
    lse = torch.where(r.lse == -math.inf, torch.full_like(r.lse, math.inf), r.lse)
    return attn_out(r, lse)


def _rope_dims_not_in_v(case: Case) -> dict:
    """V taken as the 448 NoPE dims only (the V3.2 convention; DSv4's V is the full 512-dim row)."""
    r = _oracle(case, _segs(case))
    out = r.out.clone()
    out[..., NOPE_DIM:] = 0.0
    return {"out": out.to(torch.bfloat16), "lse": r.lse.to(torch.float32)}


def _topk_length_ignored(case: Case) -> dict:
    """``topk_length`` / segment lengths ignored: every column is attended (vLLM#36616)."""
    segs = [Segment(s.rows, s.idx, None, s.rule) for s in _segs(case)]
    return attn_out(_oracle(case, segs))


def _dense(case: Case, *, zero_invalid: bool = True, sum_bf16: bool = False) -> dict:
    """A plain dense attention over the gathered rows (float64), with two bug switches:
    ``zero_invalid=False``: invalid slots are masked in the logits but their (clamped) rows are
    not zeroed, so NaN in unreferenced rows leaks through ``0 * NaN`` (attention 2.7; FlashMLA
    zero-fills them for this reason); ``sum_bf16``: the softmax row sum is accumulated in bf16."""
    from dsv4_numerics.reference.attention.ordered import segment_validity

    inp = case.inputs
    segs = _segs(case)
    q = inp["q"].to(torch.float64)
    T = q.shape[0]
    valid = segment_validity(segs, T)
    rows = torch.cat([s.rows.index_select(0, s.idx.to(torch.int64).clamp(0, s.rows.shape[0] - 1).reshape(-1))
                      .reshape(T, -1, s.rows.shape[1]) for s in segs], dim=1).to(torch.float64)
    if zero_invalid:
        rows = rows.masked_fill(~valid.unsqueeze(-1), 0.0)
    s = torch.einsum("thd,tkd->thk", q, torch.nan_to_num(rows, nan=0.0) if not zero_invalid else rows) * inp["scale"]
    s = s.masked_fill(~valid.unsqueeze(1), -math.inf)
    m = s.amax(-1, keepdim=True)
    has = torch.isfinite(m)
    p = torch.exp(s - torch.where(has, m, torch.zeros_like(m)))
    if sum_bf16:
        acc = torch.zeros(p.shape[:-1], dtype=torch.bfloat16, device=p.device)
        for k in range(p.shape[-1]):
            acc = acc + p[..., k].to(torch.bfloat16)
        L = acc.to(torch.float64).unsqueeze(-1)
    else:
        L = p.sum(-1, keepdim=True)
    sink = inp.get("sink")
    den = L if sink is None else L + torch.exp(sink.to(torch.float64).view(1, -1, 1) - torch.where(has, m, torch.zeros_like(m)))
    out = torch.einsum("thk,tkd->thd", p, rows) / den
    out = torch.where(has, out, torch.zeros_like(out))
    if sink is not None:
        out = torch.where(torch.isposinf(sink.view(1, -1, 1)), torch.zeros_like(out), out)
    lse = torch.where(has, m + torch.log(L), torch.full_like(m, -math.inf)).squeeze(-1)
    return {"out": out.to(torch.bfloat16), "lse": lse.to(torch.float32)}


def _oob_clamped(case: Case) -> dict:
    """An any-out-of-range consumer that clamps out-of-range indices into ``[0, N)`` instead of
    masking them (FlashMLA#184 class: positive OOB indices must be masked)."""
    s = _segs(case)[0]
    n = s.rows.shape[0]
    idx = s.idx.to(torch.int64)
    ln = s.length.to(torch.int64) if s.length is not None else torch.full((idx.shape[0],), idx.shape[1])
    inpre = torch.arange(idx.shape[1])[None, :] < ln[:, None]
    clamped = torch.where(inpre & (idx != -1), idx.clamp(0, n - 1), idx)
    return attn_out(_oracle(case, [Segment(s.rows, clamped, s.length, s.rule)]))


# --------------------------------------------------------------------------- sweep dimensions (issue 23)
# Each is caught only by the default cases of its dimension (``case.params["dimension"]``);
# tests/test_mutants.py shows it passes every default case without that dimension.


def _with_idx(segs: list, idxs: list) -> list:
    return [Segment(s.rows, i, s.length, s.rule) for s, i in zip(segs, idxs)]


def _pow2_page_addressing(case: Case) -> dict:
    """Page and offset by shift and mask, ``slot >> log2(bs)`` / ``slot & (bs - 1)`` with
    ``log2`` floored: right for power-of-two pages (2, 64, 256), wrong for 53, 61, 69, 576."""
    inp = case.inputs
    segs = _segs(case)
    sizes = [inp["swa_block_size"], inp.get("extra_block_size")]
    idxs = []
    for s, bs in zip(segs, sizes):
        sh = int(bs).bit_length() - 1
        i = s.idx.to(torch.int64)
        moved = ((i >> sh) * bs + (i & ((1 << sh) - 1))) % s.rows.shape[0]
        idxs.append(torch.where(i >= 0, moved, i).to(s.idx.dtype))
    return attn_out(_oracle(case, _with_idx(segs, idxs)))


TOPK_LOOP_MAX = 512  # the production DSv4 top-k (attention 1.1): a loop bound compiled for it


def _topk_tail_dropped(case: Case) -> dict:
    """Only the first 512 columns of a segment attended (a loop bound sized for the production
    top-k); columns past it are ignored."""
    segs = _segs(case)
    idxs = []
    for s in segs:
        i = s.idx.clone()
        i[:, TOPK_LOOP_MAX:] = -1
        idxs.append(i)
    return attn_out(_oracle(case, _with_idx(segs, idxs)))


def _empty_main_row_skipped(case: Case) -> dict:
    """A token whose main segment has no valid entry exits early as a lonely query (out 0, LSE
    -inf), never reading its extra segment (an early return on the main ``topk_length``)."""
    from dsv4_numerics.reference.attention.ordered import segment_validity

    segs = _segs(case)
    if len(segs) == 1:
        return attn_out(_oracle(case, segs))
    T = segs[0].idx.shape[0]
    empty = ~segment_validity(segs[:1], T).any(dim=1)
    extra = segs[1].idx.masked_fill(empty[:, None], -1)
    return attn_out(_oracle(case, _with_idx(segs, [segs[0].idx, extra])))


def _dequant_fp16(case: Case) -> dict:
    """K/V dequantised into float16 (FP8 code x scale in a 5-bit-exponent type): exact for the
    simulated magnitudes, overflowing above 65504 and losing bits below 2**-14."""
    segs = [Segment(s.rows.to(torch.float16).to(torch.float64), s.idx, s.length, s.rule) for s in _segs(case)]
    return attn_out(_oracle(case, segs))


FP32_EXP_OVERFLOW = math.log(torch.finfo(torch.float32).max)  # 88.72: exp overflows to inf above it


def _softmax_without_max(case: Case) -> dict:
    """``exp(logit)`` in float32 without subtracting the running max: a row whose largest logit
    exceeds ``ln(FLT_MAX)`` (~88.7) overflows, ``inf / inf`` gives NaN output and LSE."""
    r = _oracle(case, _segs(case))
    over = r.max_logits > FP32_EXP_OVERFLOW
    out = r.out.masked_fill(over[..., None], math.nan)
    return {"out": out.to(torch.bfloat16), "lse": r.lse.masked_fill(over, math.nan).to(torch.float32),
            "max_logits": r.max_logits.to(torch.float32)}


# --------------------------------------------------------------------------- rope / epilogue


def _rope_separate(case: Case) -> dict:
    """Separate fp32 multiplies instead of the FMA-contracted RoPE (datapath 2.1 step 3, H6)."""
    from dsv4_numerics.reference.pipeline.rope import apply_rope

    inp = case.inputs
    return {"out": apply_rope(inp["x"], inp["positions"], inp["cos_sin"], bool(inp.get("inverse", False)),
                              RopeArithmetic.SEPARATE)}


def _epilogue(case: Case, skip_inverse_rope: bool = False, token_major: bool = False) -> dict:
    from dsv4_numerics.reference.attention.epilogue import inv_rope_fp8_quant

    inp = case.inputs
    pos = inp["positions"]
    cs = inp["cos_sin"]
    if skip_inverse_rope:  # identity table row at position 0: cos = 1, sin = 0
        pos = torch.zeros_like(pos)
        cs = st.identity_cos_sin()
    r = inv_rope_fp8_quant(inp["o"], pos, cs, inp["heads_per_group"])
    codes = r.codes.reshape(r.codes_tgd.shape) if token_major else r.codes_tgd.contiguous()
    return {"codes": codes, "exponents": r.exponents, "deq": r.dequantized}


def _compressor_masked_rows_scored(case: Case) -> dict:
    """Window rows before position 0 kept with score 0 (kv 0) instead of score -inf: they still
    take softmax weight (datapath 5.1 step 3 masks them)."""
    from dsv4_numerics.reference.pipeline.compressor import compress_windows, state_windows

    inp = case.inputs
    kv, score, valid = state_windows(inp["state"], inp["positions"], inp["ratio"])
    score = torch.where(valid[..., None], score, torch.zeros_like(score))
    normed = compress_windows(kv, score, torch.ones_like(valid), inp["norm_weight"], inp["eps"])
    return {"normed": normed}


def _compressor_bf16_normed(case: Case) -> dict:
    """``normed`` rounded to bf16 before it leaves the compressor (the RoPE lanes must see the
    unrounded fp32 values, H9)."""
    from dsv4_numerics.reference.pipeline.compressor import compressor_boundary

    inp = case.inputs
    b = compressor_boundary(inp["state"], inp["positions"], inp["ratio"], inp["norm_weight"], inp["eps"], inp["cos_sin"])
    return {"normed": b.normed.to(torch.bfloat16).to(torch.float32)}


# --------------------------------------------------------------------------- the list


def _v41_kept(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    inp = case.inputs
    slots = inp["slot_mapping"]
    keep = slots >= 0
    return inp["k"][: slots.shape[0]][keep], slots[keep]


def _v41_records(case: Case, data: torch.Tensor, scales: torch.Tensor) -> dict:
    """Write record parts of the kept tokens into a copy of the case's cache, interleaved order."""
    inp = case.inputs
    _, slots = _v41_kept(case)
    out = inp["cache"].clone()
    flat = out.view(-1)
    da, sa = cache_v41.slot_addresses(slots, inp["block_size"], inp["page_stride"], inp["record"], "interleaved")
    flat[(da.unsqueeze(1) + torch.arange(data.shape[1])).flatten()] = data.flatten()
    flat[(sa.unsqueeze(1) + torch.arange(scales.shape[1])).flatten()] = scales.flatten()
    return {"cache": out}


def _v41_insert_with(**kw: str) -> Callable[[Case], dict]:
    def call(case: Case) -> dict:
        inp = case.inputs
        layout = kw.get("layout", "interleaved")
        rest = {k: v for k, v in kw.items() if k != "layout"}
        return {"cache": cache_v41.insert(inp["cache"], inp["k"], inp["slot_mapping"], inp["block_size"],
                                          inp["record"], layout, **rest)}
    return call


def _v41_nvfp4(case: Case, *, swap_nibbles: bool = False, unrounded_divisor: bool = False,
               ties_away: bool = False) -> dict:
    """The NVFP4 writer with one defect; MXFP8 cases are written correctly."""
    if case.inputs["record"] != "nvfp4_288":
        return _v41_insert_with()(case)
    k, _ = _v41_kept(case)
    x = k.float().reshape(k.shape[0], -1, 16)
    amax = x.abs().amax(dim=-1)
    sbytes = fp4.nvfp4_scale_bytes(amax, "recip_mul")
    div = (amax / 6).clamp(2.0**-9, 448.0) if unrounded_divisor else fp4.decode_nvfp4_scales(sbytes)
    y = fp4.div_rn_f32(x, div.unsqueeze(-1))
    if ties_away:  # nudge exact ties outwards so RNE rounds them away from zero
        tie = torch.isin(y.abs(), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]))
        y = torch.where(tie, y * (1 + 2.0**-20), y)
    codes = fp4.encode_e2m1(y).reshape(k.shape[0], -1)
    if swap_nibbles:
        codes = codes.reshape(k.shape[0], -1, 2).flip(-1).reshape(k.shape[0], -1)
    return _v41_records(case, fp4.pack_e2m1(codes), sbytes)


def _v41_gather_with(layout: str = "interleaved", swap_nibbles: bool = False, window_from_start: bool = False,
                     scale_bias: int = 127) -> Callable[[Case], dict]:
    """A V4.1 gather with one defect: the wrong byte order (H13), the odd element read from the
    low nibble, the first ``g`` positions instead of the last ``g`` (window start ``L - g``
    dropped), or UE8M0 bytes decoded with the wrong bias."""

    def call(case: Case) -> dict:
        inp = case.inputs
        seq, gl = inp["seq_lens"], inp.get("gather_lens")
        if window_from_start and gl is not None:
            seq = gl  # position L - g + i read as i
        out, valid = cache_v41.gather(inp["cache"], inp["block_table"], seq, inp["block_size"], inp["record"], layout,
                                      gl, consumer="triton", offset=inp.get("offset", 0))
        if swap_nibbles or scale_bias != 127:
            nb, bs, _ = cache_v41.cache_geometry("mutant", inp["cache"], inp["block_size"], cache_v41.as_record("m", inp["record"]))
            plan = gather_plan("mutant", inp["block_table"], inp["seq_lens"], bs, nb, gl, inp.get("offset", 0))
            data, scales = cache_v41.read_records(inp["cache"], plan.slot, bs, inp["record"], layout)
            if swap_nibbles and inp["record"] == "nvfp4_288":
                data = (data >> 4) | (data << 4)
            if scale_bias != 127 and inp["record"] == "mxfp8_528":
                scales = (scales.to(torch.int64) + 127 - scale_bias).clamp(0, 255).to(torch.uint8)
            out[plan.req, plan.row] = cache_v41.decode_records(data, scales, inp["record"], "triton")
        return {"out": out}

    return call

# --------------------------------------------------------------------------- V4.1 attention readers


def _v41_rows(cache: torch.Tensor, bs: int, record: str, layout: str, *, scales_per_64: bool = False,
              nibbles_swapped: bool = False, nvfp4_scale_ue8m0: bool = False) -> torch.Tensor:
    """Every slot of a V4.1 cache decoded by a wrong reader (one deviation per flag)."""
    nb = cache_v41.cache_geometry("mutant", cache, bs, cache_v41.V41Record(record))[0]
    data, scales = cache_v41.read_records(cache, torch.arange(nb * bs), bs, record, layout)
    if record == "mxfp8_528":
        vals = decode_fp8(data, Fp8Flavour.E4M3FN).to(torch.float64)
        mult = decode_ue8m0(scales).to(torch.float64)
        width = 64 if scales_per_64 else 32  # V4's 64-wide tile: byte j read for dims [64j, 64j + 64)
        mult = mult[:, torch.arange(512) // width]
    else:
        codes = fp4.unpack_e2m1(data)
        if nibbles_swapped:
            codes = codes.reshape(-1, 256, 2).flip(-1).reshape(-1, 512)
        vals = fp4.decode_e2m1(codes).to(torch.float64)
        mult = (decode_ue8m0(scales) if nvfp4_scale_ue8m0 else fp4.decode_nvfp4_scales(scales)).to(torch.float64)
        mult = mult[:, torch.arange(512) // 16]
    return (vals * mult).to(torch.bfloat16)


def _v41_reader(main: dict | None = None, extra: dict | None = None, extra_layout: str | None = None,
                prefill_swapped: bool = False) -> Callable[[Case], dict]:
    """A V4.1 attention whose cache reader deviates (``_v41_rows`` flags per cache); ``extra_layout``:
    the extra cache always read in that byte order; ``prefill_swapped``: the workspace regions
    concatenated SWA first (the extra region's offset 0 lost)."""

    def call(case: Case) -> dict:
        inp = case.inputs
        lay = inp["v41_layout"]
        rows = [_v41_rows(inp["swa_cache"], inp["swa_block_size"], inp["swa_record"], lay, **(main or {}))]
        if "extra_cache" in inp:
            rows.append(_v41_rows(inp["extra_cache"], inp["extra_block_size"], inp["extra_record"],
                                  extra_layout or lay, **(extra or {})))
        rule = IndexRule(case.params["index_rule"])
        if case.stage == "v41_sparse_decode":
            segs = [Segment(rows[0], inp["swa_indices"], inp["swa_lens"], rule)]
            if len(rows) > 1:
                segs.append(Segment(rows[1], inp["extra_indices"], inp["extra_lens"], rule))
        else:
            ws = torch.cat(rows if prefill_swapped else rows[::-1])
            segs = [Segment(ws, inp["indices"], inp["topk_length"], rule)]
        return attn_out(_oracle(case, segs))

    return call


def v41_nonfinite_entry(name: str, call: Callable[[Case], dict]) -> MutantEntry:
    """A ``v41_write`` entry declaring vLLM's non-finite rule (``nonfinite = triton``) for the
    non-finite cases of ``tests/kernels/test_vllm_v41.py`` (default cases are finite, so these are
    not in ``MUTANTS``)."""
    return MutantEntry(name, "v41_write", "see the test", call, {"nonfinite": "triton"})


def v41_nvfp4_nan_as_zero(case: Case) -> dict:
    """vLLM's NVFP4 writer modelled with NaN -> code 0 (as if cvt flushed NaN) instead of +6."""
    inp = case.inputs
    k = inp["k"].clone()
    k = torch.where(torch.isnan(k), torch.zeros_like(k), k)
    return {"cache": cache_v41.insert(inp["cache"], k, inp["slot_mapping"], inp["block_size"], inp["record"],
                                      "interleaved", nonfinite="triton")}


def v41_nvfp4_poisoned(case: Case) -> dict:
    """FlashInfer's POISON rule where vLLM's Triton writer saturates (the two producers disagree)."""
    inp = case.inputs
    return {"cache": cache_v41.insert(inp["cache"], inp["k"], inp["slot_mapping"], inp["block_size"], inp["record"],
                                      "interleaved", nonfinite="poison")}


def _query_quant(case: Case, *, exponent_rne: bool = False, zero_inverse_kept: bool = False,
                 row_major_scales: bool = False) -> dict:
    """The V4.1 query quantiser with one wrong step (``reference.pipeline.query_quant`` otherwise)."""
    inp = case.inputs
    ref = query_quant.fused_q_kv_rmsnorm_quant(inp["qr"], inp["kv"], inp["q_weight"], inp["kv_weight"], inp["eps"])
    if row_major_scales:
        sf = ref["q_sf"]
        flat = torch.zeros_like(ref["q_scales"])
        flat[: sf.numel()] = sf.reshape(-1)
        return dict(ref, q_scales=flat)
    y = query_quant.rms_norm_rows(inp["qr"], inp["q_weight"], inp["eps"]).to(torch.bfloat16)
    t, q = y.shape
    groups = y.to(torch.float64).reshape(t, q // 32, 32)
    sf = ref["q_sf"].to(torch.int64)
    if exponent_rne:  # round(log2 r) instead of its ceiling: amax/2**e may exceed 448 (saturates)
        r = groups.abs().amax(dim=-1).to(torch.float32).to(torch.float64) * float(torch.tensor(1 / 448, dtype=torch.float32))
        sf = torch.where(r > 0, (torch.round(torch.log2(r)) + 127).clamp(0, 254), torch.zeros_like(r)).to(torch.int64)
    inv = pow2_f64(127 - sf)
    if not zero_inverse_kept:
        inv = torch.where((sf >= 1) & (sf <= 253), inv, torch.zeros_like(inv))
    codes = encode_fp8((groups * inv.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX), Fp8Flavour.E4M3FN)
    sfb = sf.to(torch.uint8)
    return dict(ref, q_codes=codes.reshape(t, q), q_scales=query_quant.swizzle_f8_128x4(sfb), q_sf=sfb)


def _m(name: str, stage: str, bug: str, call: Callable, dimension: str = "", **policies: str) -> MutantEntry:
    return MutantEntry(name, stage, bug, call, dict(policies), dimension=dimension)


MUTANTS: list[MutantEntry] = [
    # cache bytes
    _m("planar_as_interleaved", "swa_write", "per-token interleaved data+scales instead of the V4 planar page "
       "(V4.1 layout switch, vFMLA :119-131, H10)", _layout_mutant("interleaved")),
    _m("page_stride_ignored", "swa_write", "page base bs*584 instead of cache.stride(0) (H12)", _layout_mutant("packed")),
    _m("minus1_written_to_slot0", "swa_write", "-1 slot clamped to slot 0 instead of skipped (datapath 2.1/2.2)",
       _minus1_as_slot0),
    _m("swa_scale_rule_swapped", "swa_write", "Q_S where the SWA writer uses Q_A (H1)", _insert_with(ScaleRule.SCALE_CLAMP.value)),
    _m("approx_log2", "swa_write", "float32 ln(r)/ln 2 then ceil instead of the exact exponent (fast-math, H2/H16)",
       _approx_log2_writer),
    _m("fnuz_clamp_240_not_224", "swa_write", "gfx942 FNUZ writer dividing/clamping by 240 (older source) instead of "
       "224 (H8)", _insert_with(ScaleRule.AMAX_CLAMP.value, flavour=Fp8Flavour.E4M3FNUZ.value),
       fp8=Fp8Flavour.E4M3FNUZ.value, fp8_clamp="224.0"),
    _m("compressed_scale_rule_swapped", "compressed_write", "Q_A where the CuTe compressor uses Q_S (H1)",
       _insert_with(ScaleRule.AMAX_CLAMP.value)),
    # DeepSeek-V4.1 records (issue 22)
    _m("v41_page_footer_for_interleaved", "v41_write", "V4.1 record written in FlashInfer 0.7.2's page-footer order "
       "where vLLM 0.33.0 / FlashMLA read interleaved records (vFMLA :122-128 BREAKING CHANGE, H13)",
       _v41_insert_with(layout="page_footer")),
    _m("v41_mxfp8_scale_rule_swapped", "v41_write", "FlashInfer's Q_S (floor 2**-13) where the vLLM MXFP8 writer uses "
       "Q_A (floor 2**-22): tiny and zero groups (cache_utils.py:225-226 vs FI cake_dsv41_fp8_cache_ops.cu:161-165)",
       _v41_insert_with(mxfp8_rule="scale_clamp")),
    _m("v41_nvfp4_nibbles_swapped", "v41_write", "even element in the HIGH nibble (cvt.e2m1x2 operand order, "
       "fused_indexer_q.py:40 'NOTE: $1 is high nibble')", lambda c: _v41_nvfp4(c, swap_nibbles=True)),
    _m("v41_nvfp4_unrounded_divisor", "v41_write", "values divided by amax/6 instead of the stored E4M3-rounded scale "
       "(dsv41_fp4_cache_ops.cu:129 'The stored (E4M3-rounded) scale is what the values are divided by')",
       lambda c: _v41_nvfp4(c, unrounded_divisor=True)),
    _m("v41_e2m1_ties_away", "v41_write", "E2M1 ties rounded away from zero (approximate division, fused_compress_"
       "quant_cache.py:522-524 'div.full misplaces values that land exactly on an e2m1 tie')",
       lambda c: _v41_nvfp4(c, ties_away=True)),
    _m("v41_gather_page_footer", "v41_gather", "V4.1 cache read in the page-footer order it was not written in "
       "(vFMLA :122-128 'a cache written in the old layout is NOT rejected, it is misread', H13)",
       _v41_gather_with(layout="page_footer"), ue8m0="triton"),
    _m("v41_gather_nibbles_swapped", "v41_gather", "NVFP4 even element read from the HIGH nibble (cache_utils.py:625 "
       "'Even element in the low nibble')", _v41_gather_with(swap_nibbles=True), ue8m0="triton"),
    _m("v41_gather_window_start_dropped", "v41_gather", "positions i instead of L - g + i (start_pos = seq_len - "
       "gather_len dropped, cache_utils.py:552-559)", _v41_gather_with(window_from_start=True), ue8m0="triton"),
    _m("v41_gather_ue8m0_bias_128", "v41_gather", "MXFP8 scale decoded as exp2(b - 128) (off-by-one bias)",
       _v41_gather_with(scale_bias=128), ue8m0="triton"),
    # gather
    _m("fnuz_codes_read_as_ocp", "gather", "FNUZ cache decoded as OCP (vLLM#42893: dropped use_fnuz, H9)",
       _gather_as(Fp8Flavour.E4M3FN.value), fp8=Fp8Flavour.E4M3FNUZ.value),
    _m("ocp_codes_read_as_fnuz", "gather", "OCP cache decoded as FNUZ (one IS_FNUZ flag for both caches, vLLM#42893)",
       _gather_as(Fp8Flavour.E4M3FNUZ.value)),
    # index plumbing
    _m("topk_minus1_as_local0", "topk_global", "-1 local index mapped through the block table (H10)", _topk_minus1_as_local0),
    _m("topk_wrong_request_row", "topk_global", "block-table row by token index, not token_to_req", _topk_wrong_request_row),
    _m("swa_lens_forced_to_window", "swa_indices", "decode_swa_lens = window_size (vLLM#41757, H18)", _swa_lens_forced_to_window),
    _m("swa_window_off_by_one", "swa_indices", "window start p-W instead of p-(W-1)", _swa_window_off_by_one),
    _m("combine_missing_request_offset", "combine_prefill", "workspace offset M*r not added (datapath 4.5)",
       _combine_without_request_offset),
    _m("combine_common_validates_minus1", "combine_prefill", "common combine modelled with the ROCm twin's -1 "
       "validation; production turns an interior -1 into M*r-1 (H10)", _combine_common_validates),
    _m("sglang_combine_minus1_shifted", "combine_prefill", "SGLang combine shifting an interior -1 to M*r-1 like "
       "vLLM's common form; SGLang 0.5.23 writes -1 (CombineInvalidTopk)",
       _builder_with("combine_topk_swa_indices_sglang", invalid_topk="shifted_by_base"),
       invalid_topk="kept_minus1"),
    _m("v41_combine_out_of_pool_shifted", "combine_prefill", "V4.1 combine shifting a top-k entry outside [0, N) "
       "by the request base; vLLM 0.33.0 V4.1 writes -1 (CombineInvalidTopk.BOUNDED_MINUS1)",
       _builder_with("combine_topk_swa_indices", invalid_topk="shifted_by_base", window_start="gathered"),
       invalid_topk="bounded_minus1", window_start="gathered"),
    _m("v41_combine_window_before_gather", "combine_prefill", "V4.1 combine window not clamped to gather_start "
       "(CombineWindowStart.GATHERED, bounded replay)",
       _builder_with("combine_topk_swa_indices", invalid_topk="bounded_minus1", window_start="sequence"),
       invalid_topk="bounded_minus1", window_start="gathered"),
    _m("v41_mixed_replay_start_dropped", "flashinfer_mixed", "V4.1 mixed table built without the SWA bounded "
       "replay (cache_utils.py:1519-1520 'no window KV exists below the request's replay start')",
       _mixed_replay_start_dropped),
    _m("v41_compress_ring_head_stored", "v41_compress_insert", "ring keeps the chunk's first capacity rows instead "
       "of its last (fused_compress_quant_cache.py:230-244 'stores the chunk's last capacity rows to the ring')",
       lambda c: _v41_compress(c, ring_head=True)),
    _m("v41_compress_ring_predecessor_dropped", "v41_compress_insert", "a chunk's first group pooled without the "
       "open row its predecessor left in the ring (fused_compress_quant_cache.py:186-190)",
       lambda c: _v41_compress(c, first_without_ring=True)),
    _m("v41_compress_rope_at_group_end", "v41_compress_insert", "compressed entry rotated at the group's last "
       "position p instead of p // ratio * ratio (fused_compress_quant_cache.py:453)",
       lambda c: _v41_compress(c, rope_at_last=True)),
    _m("v41_indexer_rope_at_group_end", "v41_indexer_k_store", "indexer key rotated at the group's last position "
       "instead of (p // ratio) * ratio (indexer_k_store.py:197-199 'group j takes position j * compress_ratio')",
       lambda c: _v41_indexer(c, rope_at_last=True)),
    _m("v41_indexer_mxfp4_nibbles_swapped", "v41_indexer_k_store", "MXFP4 key with the even element in the high "
       "nibble (_fp32x2_to_fp4x2 operand order)", lambda c: _v41_indexer(c, nibbles_swapped=True)),
    _m("v41_nvfp4_zero_sign", "v41_gather", "NVFP4 code 0x8 read as +0 where the entry declares -0 (E2m1Zero)",
       reference_entry("v41_gather", {"e2m1_zero": "positive"}).call),
    _m("sglang_decode_ring_not_wrapped", "swa_indices", "SGLang paged-decode SWA offsets without the ring wrap "
       "(abs_pos % ring_stride dropped, paged_decode_indices.py:104-106)", _ring_not_wrapped),
    # attention
    _m("extra_segment_dropped", "decode", "compressed segment not attended (attention 2.6)", _extra_dropped),
    _m("segments_separate_softmax", "decode", "one softmax per segment instead of over the union (attention 2.6)",
       _separate_softmaxes),
    _m("sink_wrong_sign", "decode", "sigmoid(lse + sink) (attention 2.3)", sink_negated),
    _m("sink_scaled", "decode", "sink multiplied by the softmax scale (H14)", _sink_scaled),
    _m("lse_base2", "decode", "LSE returned in base 2 (FlashMLA README, H1)", _lse_base2),
    _m("lse_plus_inf_lonely_unconverted", "decode", "FlashMLA's +inf empty-row LSE not converted (H1)", _lse_plus_inf_lonely),
    _m("lse_sink_merged", "decode", "sink term folded into the sink-free LSE (attention 2.2; issue 23)", _lse_sink_merged),
    _m("lse_constant_offset", "decode", "LSE off by a constant 2**-12 (issue 23: hidden by no per-row allowance)",
       _lse_offset),
    _m("lonely_query_nan", "decode", "0/0 for a query with no valid key (attention 2.4)", _lonely_nan),
    _m("rowsum_in_bf16", "decode", "softmax row sum accumulated in bf16 (attention 4.1: L stays fp32)",
       lambda c: _dense(c, sum_bf16=True)),
    _m("rope_dims_excluded_from_v", "decode", "V = NoPE dims only (V3.2 convention; DSv4 V is 512 wide)", _rope_dims_not_in_v),
    _m("invalid_rows_not_zeroed", "decode", "unreferenced NaN rows leak through 0*NaN (attention 2.7, FMLA zero-fill)",
       lambda c: _dense(c, zero_invalid=False)),
    _m("topk_length_ignored", "decode", "segment lengths ignored: columns past the prefix attended (vLLM#36616)",
       _topk_length_ignored),
    _m("prefill_topk_length_ignored", "prefill", "topk_length not passed to the prefill kernel (vLLM#36616)",
       _topk_length_ignored),
    # sweep dimensions (issue 23): each caught only by the default cases of its dimension
    _m("page_size_pow2_addressing", "decode", "page/offset by shift and mask: power-of-two page sizes only",
       _pow2_page_addressing, dimension="odd_page_size"),
    _m("topk_tail_dropped", "decode", "top-k loop bounded at the production 512: longer rows truncated",
       _topk_tail_dropped, dimension="long_topk"),
    _m("empty_main_row_skipped", "decode", "early exit on an empty main segment skips the extra segment",
       _empty_main_row_skipped, dimension="empty_main"),
    _m("cache_dequant_fp16", "decode", "K/V dequantised into float16 (narrower exponent range than the cache)",
       _dequant_fp16, dimension="kv_magnitude"),
    _m("softmax_without_max_fp32", "decode", "fp32 exp of unshifted logits (no running max): overflow",
       _softmax_without_max, dimension="q_magnitude"),
    _m("oob_index_clamped", "prefill", "out-of-range index clamped into range instead of masked (FlashMLA#184 class)",
       _oob_clamped, index_rule="any_out_of_range_invalid"),
    _m("compressor_masked_rows_scored", "compressor", "rows before position 0 keep softmax weight (datapath 5.1 step 3)",
       _compressor_masked_rows_scored),
    _m("compressor_normed_rounded_bf16", "compressor", "normed rounded to bf16 in the producer (H9)",
       _compressor_bf16_normed),
    # rope / output epilogue
    _m("rope_separate_multiplies", "rope", "separate fp32 multiplies instead of the FMA contraction (H6)", _rope_separate),
    _m("inverse_rope_skipped", "inv_rope_fp8", "output quantised without the inverse RoPE (attention 3.3)",
       lambda c: _epilogue(c, skip_inverse_rope=True)),
    _m("group_major_read_as_token_major", "inv_rope_fp8", "group-major [G, T, D] codes reinterpreted as [T, G, D] "
       "(attention 3.3 layout)", lambda c: _epilogue(c, token_major=True)),
    # --- SGLang 0.5.23 JIT / TileLang kernels (kernels/sglang/jit.py) ---
    _m("sglang_padded_page_stride", "swa_write", "pages addressed at SGLang's kv_page_bytes (bs*584 rounded up "
       "to 576, kv_layout.cuh:111-115) instead of cache.stride(0) on an unpadded cache", _layout_mutant("sglang_padded")),
    _m("sglang_requant_gather_values_kept", "gather", "the Q8KV8 FP8 workspace holding the exact dequantised values "
       "(a bf16 workspace) where gather_dequant_requant_fp8_paged_dsv4 re-encodes them as unit-scale E4M3 "
       "(dequant_k_cache.py:458-462)", lambda c: _outputs(st.get("gather").expected(c, st.get("gather").policies({}))),
       gather_out="e4m3_requant"),
    _m("sglang_norm_rope_store_negative_slot_skipped", "kv_norm_rope_store", "SGLang's uniform-FP8 store skipping a "
       "negative slot like the CUDA writers; kv_norm_rope_store.py:45-47 wraps it to CACHE_ROWS + slot (PyTorch's index)",
       reference_entry("kv_norm_rope_store", {"slot_skip": "all_negative"}).call, slot_skip="negative_wraps"),
    _m("sglang_norm_rope_store_torch_cast", "kv_norm_rope_store", "normed rows cast to E4M3 by torch 2.11's cast "
       "(overflow -> NaN, the 'old path') where the Triton store saturates to 448",
       reference_entry("kv_norm_rope_store", {"slot_skip": "negative_wraps", "nonfinite": "torch"}).call,
       slot_skip="negative_wraps"),
    _m("fp8_exp0_read_as_normal", "decode", "exponent-0 FP8 codes (zero included) read as (1 + m/8) * 2**-7 times the "
       "scale (SGLang's TileLang decode, vLLM's CPU decode) where the consumer reads them exactly",
       reference_entry("decode", {"fp8_decode": "exp0_as_normal"}).call),


    # DeepSeek-V4.1 attention and query quantiser (issue 22, part A)
    _m("v41_mxfp8_scales_per_64_dims", "v41_sparse_decode", "MXFP8 UE8M0 byte j applied to dims [64j, 64j+64): V4's "
       "tile width kept for the 32-wide V4.1 groups (cache_utils.py:44-45 'one UE8M0 scale per 32 dims')",
       _v41_reader(main={"scales_per_64": True})),
    _m("v41_nvfp4_nibbles_swapped_on_read", "v41_sparse_decode", "NVFP4 extra cache read with the even element in the "
       "HIGH nibble (flash_mla_interface.py 'the even-indexed one in the low nibble')",
       _v41_reader(extra={"nibbles_swapped": True})),
    _m("v41_nvfp4_scales_read_as_ue8m0", "v41_sparse_decode", "NVFP4 E4M3 group scales decoded as UE8M0 powers of two "
       "(the MXFP8 record's scale format)", _v41_reader(extra={"nvfp4_scale_ue8m0": True})),
    _m("v41_extra_read_interleaved_when_page_footer", "v41_sparse_decode", "the compressed (extra) cache read in the "
       "interleaved order while its writer used FlashInfer 0.7.2's page footer (H13; only the SWA reader followed "
       "the layout)", _v41_reader(extra_layout="interleaved")),
    _m("v41_prefill_workspace_regions_swapped", "v41_sparse_prefill", "SWA region gathered at offset 0 and the "
       "compressed region after it (vLLM gathers the compressed rows first, offset=0, then SWA at offset=N)",
       _v41_reader(prefill_swapped=True)),
    _m("v41_query_scale_exponent_rounded", "v41_query_quant", "UE8M0 exponent rounded to nearest instead of the "
       "ceiling (query_quant.py:71-75 'bump' when the mantissa is non-zero)",
       lambda c: _query_quant(c, exponent_rne=True)),
    _m("v41_query_zero_byte_inverse_kept", "v41_query_quant", "groups with UE8M0 byte 0 scaled by 2**127 instead of "
       "the zero inverse (query_quant.py:77-78 inv_bits = 0 when sf == 0)",
       lambda c: _query_quant(c, zero_inverse_kept=True)),
    _m("v41_query_scales_row_major", "v41_query_quant", "scale bytes row-major [T, G] instead of F8_128x4 "
       "(query_quant.py:26-29 mxfp8_scale_offset)", lambda c: _query_quant(c, row_major_scales=True)),
]
