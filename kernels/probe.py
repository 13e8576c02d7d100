"""Availability probes for kernel entries: ``None`` means "can run here", a string says why not.

A probe answers one question honestly and names the missing piece: the Python package (and the
version that is installed, when one is), the staged vLLM kernels (``DSV4_STAGED``, activated by
:func:`kernels.staged.activate` before any lookup), the GPU, its architecture, or a
shared library that is present but does not load. Probes compose with :func:`first_reason`.

Rules every probe here follows:

* importing this module initialises nothing: no CUDA context, no production import. All work
  happens when a probe is *called*;
* results are cached per process (``functools.lru_cache``): the answer cannot change while the
  process lives, and a probe may be asked once per test item;
* a probe never raises for "not available"; it returns the reason. A probe that raises is a bug
  (:meth:`kernels.registry.KernelEntry.available` still turns it into a reason that says so).

Architecture names used by registry entries (``KernelEntry.archs``):
``sm90`` (H100/H200, CC 9.x), ``sm100`` (B200/GB200, CC 10.0), ``sm103`` (B300, CC 10.3),
``sm107`` (CC 10.7), ``sm120`` (RTX Pro 6000, CC 12.0), ``sm121`` (DGX Spark, CC 12.1),
``gfx942`` / ``gfx950`` (ROCm MI300 / MI355), ``any-cuda`` (any NVIDIA GPU) and ``any-gpu``
(any CUDA or ROCm GPU; Triton kernels that also run on NVIDIA), ``cpu`` (any CPU: the reference
and plain-PyTorch kernels), and the x86 ISA tags of CPU production kernels (:data:`CPU_ISA_ARCHS`,
:func:`cpu_arch`): ``x86-avx512bf16`` (AVX512-BF16, the ISA vLLM's CPU ``_C`` library needs) and
``x86-amx`` (AVX512-BF16 plus AMX-BF16 tiles, which oneDNN/vLLM CPU GEMMs switch to). A CPU
kernel's rows are recorded under the tag of the host they ran on, as GPU rows are under ``sm90``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass
from typing import Callable, Iterable

from dsv4_numerics.kernels import gpu_facts, staged

Probe = Callable[[], "str | None"]

# Compute capability -> architecture name (spec README section 5; FlashInfer
# `_resolve_dsv4_sparse_mla_backend`, FI mla/_core.py:1293-1333, uses exactly these pairs).
CC_ARCH = {
    (9, 0): "sm90",
    (10, 0): "sm100",
    (10, 3): "sm103",
    (10, 7): "sm107",
    (12, 0): "sm120",
    (12, 1): "sm121",
}
CUDA_ARCHS = frozenset(CC_ARCH.values()) | {"any-cuda"}
ROCM_ARCHS = frozenset({"gfx942", "gfx950"})
# x86 ISA tags, most specific first (cpu_arch picks the first whose flags the host has).
CPU_ISA_TAGS = (
    ("x86-amx", ("avx512_bf16", "amx_bf16")),
    ("x86-avx512bf16", ("avx512_bf16",)),
)
CPU_ISA_ARCHS = frozenset(tag for tag, _ in CPU_ISA_TAGS)
ALL_ARCHS = CUDA_ARCHS | ROCM_ARCHS | CPU_ISA_ARCHS | {"any-gpu", "cpu"}


def runs_on_cpu(archs: Iterable[str]) -> bool:
    """An entry with these ``archs`` runs on the CPU (the reference, plain PyTorch, or a CPU
    production kernel such as vLLM's CPU backend): no GPU marker, judged on the CPU."""
    return set(archs) <= {"cpu"} | CPU_ISA_ARCHS


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The ISA flags of this host's CPU (``/proc/cpuinfo``'s first ``flags`` line; empty where
    that file does not exist, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.lru_cache(maxsize=None)
def cpu_arch() -> str:
    """Architecture tag of this host's CPU: a :data:`CPU_ISA_TAGS` name when its flags are
    present, else ``x86-avx512`` / ``x86-avx2`` / ``x86`` on x86-64, or the machine name
    (``aarch64``, ...)."""
    import platform

    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return machine or "unknown-cpu"
    flags = cpu_flags()
    for tag, need in CPU_ISA_TAGS:
        if all(f in flags for f in need):
            return tag
    if "avx512f" in flags:
        return "x86-avx512"
    return "x86-avx2" if "avx2" in flags else "x86"


@dataclass(frozen=True)
class GpuInfo:
    """What the visible device 0 is. ``present`` False means no usable GPU (``why`` says why)."""

    present: bool
    vendor: str = ""  # "cuda" or "rocm"
    name: str = ""
    capability: tuple[int, int] | None = None
    arch: str = ""  # "sm90", "gfx942", ... ("" if unknown)
    why: str = ""

    def describe(self) -> str:
        if not self.present:
            return self.why or "no GPU visible"
        if self.vendor == "rocm":
            return f"{self.arch or 'unknown gfx'} {self.name}".strip()
        cc = f"sm{self.capability[0]}{self.capability[1]}" if self.capability else "sm??"
        return f"{cc} {self.name}".strip()


@functools.lru_cache(maxsize=None)
def gpu_info() -> GpuInfo:
    """Describe GPU 0 of this process (after ``CUDA_VISIBLE_DEVICES``). Cached; never raises. An
    NVIDIA GPU is described from NVML (``gpu_facts``: no CUDA initialisation, which the driver
    serialises between processes), anything else by torch."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a hard dependency
        return GpuInfo(False, why=f"torch not importable ({e})")
    if torch.version.cuda is not None:  # NVML first: the name and capability without initialising CUDA
        facts = gpu_facts.visible_gpu_facts()
        if facts is not None:
            if not facts:
                return GpuInfo(False, why=f"no GPU visible to torch {torch.__version__} (CUDA {torch.version.cuda}; "
                                          f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
            cap = facts[0].capability
            return GpuInfo(True, "cuda", facts[0].name, cap, CC_ARCH.get(cap, f"sm{cap[0]}{cap[1]}"))
    try:
        if not torch.cuda.is_available():
            if torch.version.cuda is None and torch.version.hip is None:
                return GpuInfo(False, why=f"no GPU visible; torch {torch.__version__} is a CPU-only build")
            return GpuInfo(False, why=f"no GPU visible to torch {torch.__version__} "
                                      f"(CUDA {torch.version.cuda}, HIP {torch.version.hip})")
        name = torch.cuda.get_device_name(0)
        cap = tuple(torch.cuda.get_device_capability(0))
        if torch.version.hip is not None:
            props = torch.cuda.get_device_properties(0)
            gcn = str(getattr(props, "gcnArchName", "")).split(":")[0]
            return GpuInfo(True, "rocm", name, cap, gcn)
        return GpuInfo(True, "cuda", name, cap, CC_ARCH.get(cap, f"sm{cap[0]}{cap[1]}"))
    except Exception as e:  # a broken driver is a reason, not a crash
        return GpuInfo(False, why=f"GPU query failed: {type(e).__name__}: {e}")


def arch_reason(archs: Iterable[str]) -> str | None:
    """``None`` if GPU 0 matches one of ``archs``; otherwise e.g.
    ``"needs sm100/sm103 (found sm90 NVIDIA H200)"`` or ``"needs ROCm gfx942 (found CUDA ...)"``."""
    archs = tuple(archs)
    unknown = [a for a in archs if a not in ALL_ARCHS]
    if unknown:
        return f"unknown architecture name(s) {unknown} in the entry (known: {sorted(ALL_ARCHS)})"
    if "cpu" in archs:
        return None
    cpu_isas = [a for a in archs if a in CPU_ISA_ARCHS]
    if cpu_isas:
        here = cpu_arch()
        if here in cpu_isas:
            return None
        return f"needs an x86-64 CPU with {'/'.join(cpu_isas)} (found {here})"
    info = gpu_info()
    want = "/".join(archs)
    rocm_only = all(a in ROCM_ARCHS for a in archs)
    if not info.present:
        return f"needs {'ROCm ' if rocm_only else ''}{want} GPU ({info.describe()})"
    if "any-gpu" in archs:
        return None
    if info.vendor == "rocm":
        if info.arch in archs:
            return None
        return f"needs {want} (found ROCm {info.describe()})"
    if "any-cuda" in archs or info.arch in archs:
        return None
    if rocm_only:
        return f"needs ROCm {want} (found CUDA {info.describe()})"
    return f"needs {want} (found {info.describe()})"


def dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _find_spec(module: str):
    staged.activate()  # DSV4_STAGED folders first (idempotent)
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a missing parent package raises here
        return None


@functools.lru_cache(maxsize=None)
def module_reason(module: str, dist: str | None = None, min_version: str | None = None) -> str | None:
    """``None`` if ``module`` can be found (without importing it); else ``"<dist> not installed
    (module <module>)"``. With ``min_version``, an older installed distribution is a reason too."""
    label = dist or module
    if _find_spec(module) is None:
        return f"{label} not installed (module {module} not importable)"
    if dist and min_version:
        have = dist_version(dist)
        if have is not None and _version_tuple(have) < _version_tuple(min_version):
            return f"{dist} {have} installed, needs >= {min_version}"
    return None


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.replace("+", ".").split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if digits == "":
            break
        out.append(int(digits))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def staged_vllm_reason(module: str, part: str | None = None) -> str | None:
    """The vLLM file ``module`` is importable, either from an installed vLLM or from a folder
    staged by ``dsv4-numerics stage-vllm`` (part ``part``) and named by ``DSV4_STAGED``. Found
    without importing; the reason names the command that stages it."""
    if _find_spec(module) is not None:
        return None
    problems = staged.activate()
    if problems:
        return "; ".join(problems)
    have = dist_version("vllm")
    if have is not None and not staged.folders():
        return f"vllm {have} installed but {module} not importable (needs vllm 0.33.0 DSv4 sources)"
    return staged.missing_hint(module, part)


@functools.lru_cache(maxsize=None)
def import_reason(module: str) -> str | None:
    """Actually import ``module`` (e.g. a compiled ``.so``); ``None`` on success, else the loader's
    message (``OSError`` from ``dlopen``, undefined symbols, missing CUDA runtime, ...).

    Call this last in a probe chain: it has the side effects of an import."""
    staged.activate()
    try:
        importlib.import_module(module)
    except OSError as e:
        return f"{module} failed to load: OSError: {e}"
    except ImportError as e:
        return f"{module} failed to import: {e}"
    except Exception as e:  # a library whose init raises (e.g. no driver) is "not available"
        return f"{module} failed to import: {type(e).__name__}: {e}"
    return None


@functools.lru_cache(maxsize=None)
def torch_op_reason(namespace: str, op: str) -> str | None:
    """``torch.ops.<namespace>.<op>`` is registered (after the library was loaded)."""
    import torch

    try:
        getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError) as e:
        return f"torch.ops.{namespace}.{op} is not registered ({type(e).__name__})"
    return None


@functools.lru_cache(maxsize=None)
def dtype_reason(name: str) -> str | None:
    """This torch build has ``torch.<name>`` (e.g. ``float8_e4m3fnuz``)."""
    import torch

    if getattr(torch, name, None) is None:
        return f"torch {torch.__version__} has no torch.{name}"
    return None


def first_reason(*probes: Probe) -> str | None:
    """Run ``probes`` in order; the first non-``None`` reason wins (cheap checks first)."""
    for p in probes:
        r = p()
        if r:
            return r
    return None


def chain(*probes: Probe) -> Probe:
    """A cached probe that is the conjunction of ``probes`` (see :func:`first_reason`)."""

    @functools.lru_cache(maxsize=None)
    def probe() -> str | None:
        return first_reason(*probes)

    return probe


def needs_arch(*archs: str) -> Probe:
    return lambda: arch_reason(archs)


def needs_module(module: str, dist: str | None = None, min_version: str | None = None) -> Probe:
    return lambda: module_reason(module, dist, min_version)


def needs_staged_vllm(module: str, part: str | None = None) -> Probe:
    return lambda: staged_vllm_reason(module, part)


def needs_import(module: str) -> Probe:
    return lambda: import_reason(module)


def needs_dtype(name: str) -> Probe:
    return lambda: dtype_reason(name)


def reset_caches() -> None:
    """Forget cached answers (tests only)."""
    for f in (gpu_info, cpu_flags, cpu_arch, module_reason, staged_vllm_reason, import_reason, torch_op_reason, dtype_reason):
        f.cache_clear()


# --------------------------------------------------------------------------- every failing requirement at once

SM100_ARCHS = ("sm100", "sm103")  # the Blackwell datacentre parts (B200/GB200, B300/GB300)


def all_reasons(*probes) -> "callable":
    """A cached probe that reports *every* failing requirement joined by ``"; "`` (e.g. both
    "needs sm100/sm103 (found sm90 ...)" and "flashinfer-python not installed"), so a reader on
    an H200 learns everything that is missing at once. Import probes run only when the cheap
    ones before them pass (they have side effects)."""

    @functools.lru_cache(maxsize=None)
    def probe() -> str | None:
        reasons = []
        for p in probes:
            if getattr(p, "_after_ok", False) and reasons:
                continue
            r = p()
            if r:
                reasons.append(str(r))
        return "; ".join(reasons) if reasons else None

    return probe


def after_others(p):
    """Mark an (import) probe to run only when every probe before it passed."""
    p._after_ok = True  # noqa: SLF001
    return p


def import_after_others(module: str) -> Probe:
    """``needs_import(module)`` marked to run only when every probe before it passed (``all_reasons``)."""
    return after_others(needs_import(module))
