"""The GPUs this process may use, found without initialising CUDA and without torch: what the
xdist workers are pinned to (``pytest_plugin.pin_xdist_worker_to_gpu``) and what the kernel
broker and the isolated pools spread their children over (``visible_gpu_ids(torch_fallback=True)``).

``visible_gpu_ids()``: the inherited ``CUDA_VISIBLE_DEVICES`` list when it is set, else one id per
``/dev/nvidiaN`` device node, else one per ``GPU`` line of ``nvidia-smi -L``, else none. Asking
torch instead (``torch.cuda.device_count()``) initialises the CUDA driver in the asking process,
and the xdist controller asks before it starts its first worker: every worker would start later.
"""
from __future__ import annotations

import os
import re
import subprocess

__all__ = ["visible_gpu_ids"]


def visible_gpu_ids(torch_fallback: bool = False) -> list[str]:
    """GPU ids visible to this process (module docstring); ``[]`` where none is found.

    ``torch_fallback``: where neither ``CUDA_VISIBLE_DEVICES`` nor the NVIDIA device nodes nor
    ``nvidia-smi`` name a GPU (a ROCm host), ``0 .. torch.cuda.device_count() - 1`` -- this
    initialises the driver in the asking process, so the pytest controller never asks for it; the
    pools and the broker, which hand these ids to children as ``CUDA_VISIBLE_DEVICES``, do."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is not None:
        return [d.strip() for d in inherited.split(",") if d.strip()]
    ids = _device_ids()
    if ids or not torch_fallback:
        return ids
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001
        return []


def _device_ids() -> list[str]:
    """One id per ``/dev/nvidiaN`` node, else per ``GPU`` line of ``nvidia-smi -L``, else none."""
    try:
        nodes = sorted(n for n in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", n))
    except OSError:
        nodes = []
    if nodes:
        return [str(i) for i in range(len(nodes))]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
        return [str(i) for i, line in enumerate(out.stdout.splitlines()) if line.startswith("GPU ")]
    except (OSError, subprocess.SubprocessError):
        return []
