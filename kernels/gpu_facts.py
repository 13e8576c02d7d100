"""Name and compute capability of the NVIDIA GPUs this process may use, read through NVML
(``libnvidia-ml.so.1``, by ``ctypes``) without initialising CUDA.

Why: ``torch.cuda.get_device_name`` / ``get_device_capability`` (and ``torch.cuda.is_available``
unless ``PYTORCH_NVML_BASED_CUDA_CHECK=1``) initialise the CUDA driver in the asking process
(``cuInit``), and the driver serialises that work between processes with the creation of every
other process's context. Under ``pytest -n 64`` on a 4-GPU host every xdist worker asked during
its collection (skip reasons, the kernel matrix's architecture check) while 64 early contexts
and the kernel broker's children were being made: the collections, ~5 CPU-seconds each, ended
together 15-16 s after the first worker started (4.5 s with 16 workers). NVML answers from the
driver's device list.

:func:`visible_gpu_facts` returns one :class:`GpuFact` per device ``CUDA_VISIBLE_DEVICES`` selects (all
devices when it is unset), in CUDA's numbering, or ``None`` where NVML cannot answer for certain:
no NVML library (a ROCm or CPU-only host), an NVML error, MIG instances, or integer indices on a
host whose GPUs differ while ``CUDA_DEVICE_ORDER`` is not ``PCI_BUS_ID`` (CUDA's default order,
fastest first, is not NVML's). Callers then ask torch, as before.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

__all__ = ["GpuFact", "visible_gpu_facts"]

_NAME_LEN = 96  # NVML_DEVICE_NAME_V2_BUFFER_SIZE; the UUID buffer (NVML_DEVICE_UUID_V2_BUFFER_SIZE) too


@dataclass(frozen=True)
class GpuFact:
    """One NVIDIA GPU as NVML reports it: ``name`` (as ``torch.cuda.get_device_name``),
    ``capability`` ``(major, minor)``, ``uuid`` (``GPU-...``)."""

    name: str
    capability: tuple[int, int]
    uuid: str


def nvml_devices() -> list[GpuFact] | None:
    """Every NVIDIA device in NVML's (PCI bus) order, or None where NVML cannot be used (any
    failure: no library, an error code, an NVML too old for a call)."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            return None
    except Exception:  # noqa: BLE001 - no NVML: the caller asks torch
        return None
    try:
        n = ctypes.c_uint()
        if lib.nvmlDeviceGetCount_v2(ctypes.byref(n)) != 0:
            return None
        out = []
        for i in range(n.value):
            h = ctypes.c_void_p()
            name = ctypes.create_string_buffer(_NAME_LEN)
            uuid = ctypes.create_string_buffer(_NAME_LEN)
            major, minor = ctypes.c_int(), ctypes.c_int()
            if (lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h))
                    or lib.nvmlDeviceGetName(h, name, _NAME_LEN)
                    or lib.nvmlDeviceGetUUID(h, uuid, _NAME_LEN)
                    or lib.nvmlDeviceGetCudaComputeCapability(h, ctypes.byref(major), ctypes.byref(minor))):
                return None
            out.append(GpuFact(name.value.decode(errors="replace"), (major.value, minor.value),
                               uuid.value.decode(errors="replace")))
        return out
    except Exception:  # noqa: BLE001 - e.g. an NVML too old for one of the calls
        return None
    finally:
        try:
            lib.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def select(devices: list[GpuFact], visible: str | None, pci_order: bool) -> list[GpuFact] | None:
    """The devices a ``CUDA_VISIBLE_DEVICES`` value ``visible`` selects, in CUDA's numbering
    (module docstring); None where that is not certain. CUDA stops at the first entry that names
    no device."""
    homogeneous = len({(d.name, d.capability) for d in devices}) <= 1
    if visible is None:
        return list(devices) if (pci_order or homogeneous) else None
    out: list[GpuFact] = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.startswith("MIG-"):
            return None
        if entry.startswith("GPU-"):
            hits = [d for d in devices if d.uuid.startswith(entry)]
            if len(hits) != 1:
                break
            out.append(hits[0])
        elif entry.lstrip("-").isdigit():
            i = int(entry)
            if not 0 <= i < len(devices):
                break
            if not (pci_order or homogeneous):
                return None
            out.append(devices[i])
        else:
            break
    return out


FOUND_CACHE: dict[tuple, tuple[GpuFact, ...]] = {}  # answers per (CUDA_VISIBLE_DEVICES, PCI order); no failure kept


def visible_gpu_facts() -> list[GpuFact] | None:
    """The GPUs this process may use, device 0 first (module docstring); None: ask torch."""
    key = (os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID")
    if key not in FOUND_CACHE:
        devices = nvml_devices()
        got = None if devices is None else select(devices, *key)
        if got is None:
            return None
        FOUND_CACHE[key] = tuple(got)
    return list(FOUND_CACHE[key])
