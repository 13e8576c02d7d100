"""Cross-engine checks at kernel level (``oracles/cross_engine.py``).

* GPU: every available pair of different engines among the 584-byte writers (SGLang's JIT store,
  vLLM's CUDA and Triton writers) is compared byte for byte on the ``swa_write`` cases, every
  differing byte predicted by the reference under the two entries' declared policies; and every
  available (writer, reader) pair of different engines (readers: vLLM's Triton gather, SGLang's
  gathers, FlashMLA's and SGLang's decodes) has the reader judged on its own cases with the
  records it reads rewritten by the foreign writer. The counts go to the JUnit properties
  (``cross_engine``) and the run's log.
* CPU: the same functions with the reference as both engines (writers under the Q_S and amax_clamp
  scale rules, the reference gather and decode as readers) and planted bugs the comparison must
  not explain away.
"""

from __future__ import annotations

import json

import pytest

from dsv4_numerics.kernels import registry
from dsv4_numerics.oracles import cross_engine as ce
from dsv4_numerics.reference.cases import Case, default_cases
from dsv4_numerics.reference.errors import InputError

from ..mutants import MutantEntry, reference_entry
from .conftest import entry_or_skip

WRITERS = ["sglang.store_jit", "vllm_cuda.swa_quant_insert", "vllm_triton.quantize_and_insert_k_cache"]
READERS = ["vllm_triton.dequantize_and_gather_k_cache", "sglang.dequantize_k_cache_paged_dsv4",
           "flashmla.sparse_decode.sm90", "sglang.triton_sparse_decode", "sglang.paged_decode"]
# the reader's cases a pair runs (each costs a kernel call and a reference; the decode defaults
# hold 13 cases: the first three cover bs64 / bs2 / bs256 pages, SWA and compressed extras)
READ_CASES = 3


def _writer_pairs():
    return [(a, b) for i, a in enumerate(WRITERS) for b in WRITERS[i + 1:]
            if ce.engine(registry.get(a)) != ce.engine(registry.get(b))]


def _read_pairs():
    return [(w, r) for w in WRITERS for r in READERS if ce.engine(registry.get(w)) != ce.engine(registry.get(r))]


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("a,b", _writer_pairs(), ids=lambda n: n)
def test_writers_of_two_engines_differ_only_where_their_policies_do(a, b, record_property):
    for n in (a, b):
        entry_or_skip(n)
    rows = [ce.compare_writers(registry.get(a), registry.get(b), c, device="cuda")
            for c in default_cases("swa_write")]
    record_property("cross_engine", json.dumps([r.to_dict() for r in rows]))
    for r in rows:
        print(r.line())
    ran = [r for r in rows if not r.skipped]
    assert ran, "no swa_write case ran on both writers: " + "; ".join(r.line() for r in rows)
    bad = [r.line() for r in ran if not r.explained]
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
@pytest.mark.parametrize("writer,reader", _read_pairs(), ids=lambda n: n)
def test_reader_judged_on_a_foreign_engines_cache(writer, reader, record_property):
    for n in (writer, reader):
        entry_or_skip(n)
    w, r = registry.get(writer), registry.get(reader)
    rows = [ce.read_foreign(w, r, c, device="cuda") for c in default_cases(r.stage)[:READ_CASES]]
    record_property("cross_engine", json.dumps([x.to_dict() for x in rows]))
    for x in rows:
        print(x.line())
    ran = [x for x in rows if not x.skipped]
    assert ran, "no case ran: " + "; ".join(x.line() for x in rows)
    bad = [x.line() for x in ran if x.verdict != "pass"]
    assert not bad, "\n".join(bad)


# --------------------------------------------------------------------------- CPU


def test_cpu_backend_decode_on_caches_its_own_writer_rewrote():
    """The same plumbing with production kernels on the CPU runners (vLLM's CPU backend, staged by
    .ci/run): its 584-byte writer rewrites the records each decode case reaches and its decode is
    judged on them. The bytes differ from the cases' reference-written ones on some records (the
    rewrite re-derives each tile's scale from the decoded rows); the decode must pass."""
    w, r = entry_or_skip("vllm_cpu.qnorm_rope_kv_insert"), entry_or_skip("vllm_cpu.sparse_decode")
    rows = [ce.read_foreign(w, r, c) for c in default_cases("decode")[:READ_CASES]]
    assert all(x.verdict == "pass" for x in rows), [x.line() for x in rows]
    assert all(0 < x.changed_records <= x.rewritten_records for x in rows), [x.line() for x in rows]


def _writer(engine: str, rule: str) -> MutantEntry:
    """The reference writer under one scale rule, named as an entry of ``engine``."""
    ref = reference_entry("swa_write", {"scale_rule": rule})
    return MutantEntry(f"{engine}_reference.swa_write.{rule}", "swa_write", "none (positive control)", ref.call,
                       {"scale_rule": rule})


def _q_s():  # SGLang's V4.1 store and the CuTe-DSL compressor write Q_S
    return _writer("sglang", "scale_clamp")


def _vllm_like_writer():
    return _writer("vllm", "amax_clamp")


def test_engine_names():
    assert ce.engine(registry.get("sglang.store_jit")) == "sglang"
    assert {ce.engine(registry.get(n)) for n in WRITERS[1:] + READERS[:1] + ["flashmla.sparse_decode.sm90"]} == {"vllm"}
    assert _writer_pairs() and all(ce.engine(registry.get(w)) != ce.engine(registry.get(r)) for w, r in _read_pairs())


def test_two_scale_rules_differ_exactly_where_the_reference_says():
    q_s = _q_s()
    rows = [ce.compare_writers(q_s, _vllm_like_writer(), c) for c in default_cases("swa_write")]
    assert all(r.explained for r in rows), [r.line() for r in rows if not r.explained]
    assert sum(r.differing_bytes for r in rows) > 0  # Q_S and amax_clamp do differ on these cases
    assert all(r.by_part["rope_bf16"] == 0 for r in rows)  # the rule moves scales and codes only
    assert rows[0].policy_differences == {"scale_rule": ("scale_clamp", "amax_clamp")}
    assert "scale_rule: scale_clamp vs amax_clamp" in rows[0].line()


def test_a_writer_bug_is_never_explained():
    """One flipped E4M3 code in one record: the comparison counts exactly that byte as unexplained."""
    ref = _vllm_like_writer()

    def flipped(case: Case) -> dict:
        out = ref.call(case)["cache"].clone()
        inp = case.inputs
        slot = int(inp["slot_mapping"][inp["slot_mapping"] >= 0][0])
        bs, p = inp["block_size"], inp["page_stride"]
        off = (slot // bs) * p + (slot % bs) * 576 + 5
        out.view(-1)[off] ^= 0x01
        return {"cache": out}

    bug = MutantEntry("sglang_bug.swa_write", "swa_write", "one code bit flipped", flipped, {"scale_rule": "amax_clamp"})
    r = ce.compare_writers(bug, ref, default_cases("swa_write")[0])
    assert not r.explained and r.unexplained_bytes == 1 and r.differing_records == 1
    assert r.by_part == {"nope_fp8": 1, "rope_bf16": 0, "scale": 0}
    assert "NOT explained (1 bytes)" in r.line()


@pytest.mark.parametrize("stage", ["gather", "decode"])
def test_reader_passes_on_a_foreign_cache_and_changed_records_are_counted(stage):
    q_s = _q_s()
    reader = reference_entry(stage)
    case = default_cases(stage)[0]
    x = ce.read_foreign(q_s, reader, case)
    assert x.verdict == "pass", x.line()
    assert x.rewritten_records == int(ce.reached_slots(case).numel()) > 0
    # the case's caches were written under amax_clamp: Q_S rewrites some records differently
    assert 0 < x.changed_records <= x.rewritten_records, x.line()
    # rewriting is not a no-op even under the case's own rule: a tile whose decoded amax rounded
    # down onto a power of two takes a smaller scale the second time; the bytes still decode right
    new, n, _ = ce.rewritten_case(_vllm_like_writer(), case)
    assert n == x.rewritten_records and ce.run_entry(reader, [new])[0].verdict == "pass"


def test_a_reader_bug_fails_on_the_foreign_cache():
    """A decode that reads the foreign cache with the wrong scale (x2 on every output) fails."""
    reader = reference_entry("decode")
    bug = MutantEntry("bug.decode", "decode", "output doubled",
                      lambda c: {k: (v * 2 if k == "out" else v) for k, v in reader.call(c).items()})
    x = ce.read_foreign(_q_s(), bug, default_cases("decode")[0])
    assert x.verdict == "fail", x.line()


def test_bad_input_names_the_argument():
    q_s = _q_s()
    with pytest.raises(InputError, match="writer_b"):
        ce.compare_writers(q_s, reference_entry("gather"), default_cases("swa_write")[0])
    with pytest.raises(InputError, match="case"):
        ce.compare_writers(q_s, q_s, default_cases("gather")[0])
    with pytest.raises(InputError, match="case"):
        ce.read_foreign(q_s, reference_entry("gather"), default_cases("decode")[0])
    with pytest.raises(InputError, match="reader"):
        ce.read_foreign(q_s, q_s, default_cases("swa_write")[0])
