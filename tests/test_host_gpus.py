"""``host_gpus.visible_gpu_ids`` (without and with ``torch_fallback``): GPUs found without asking torch
(which initialises the CUDA driver in the asking process: the xdist controller, before it starts
its first worker)."""

import os
import subprocess

from dsv4_numerics.runner import host_gpus


def _no_torch_count(monkeypatch) -> list:
    """Counts ``torch.cuda.device_count()`` calls (still answered: under
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, the root conftest's, ``torch.cuda.is_available()`` asks it
    too, e.g. in this test's teardown); the test asserts none came from the code under test."""
    import torch

    calls: list = []
    real = torch.cuda.device_count
    monkeypatch.setattr(torch.cuda, "device_count", lambda *a: calls.append(a) or real(*a))
    return calls


def test_the_inherited_list_comes_first_stripped(monkeypatch):
    asked = _no_torch_count(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", " 3, 1,,")
    assert host_gpus.visible_gpu_ids() == ["3", "1"] and host_gpus.visible_gpu_ids(torch_fallback=True) == ["3", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # hidden on purpose: none, and torch is not asked
    assert host_gpus.visible_gpu_ids() == [] and host_gpus.visible_gpu_ids(torch_fallback=True) == []
    assert not asked


def test_device_nodes_then_nvidia_smi_without_torch(monkeypatch):
    asked = _no_torch_count(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    real = os.listdir
    nodes = ["nvidiactl", "nvidia1", "nvidia0", "nvidia-uvm"]
    monkeypatch.setattr(os, "listdir", lambda p: nodes if p == "/dev" else real(p))
    assert host_gpus.visible_gpu_ids() == ["0", "1"] and host_gpus.visible_gpu_ids(torch_fallback=True) == ["0", "1"]
    monkeypatch.setattr(os, "listdir", lambda p: [] if p == "/dev" else real(p))
    lines = "GPU 0: NVIDIA H200 (UUID: x)\nGPU 1: NVIDIA H200 (UUID: y)\n"
    smi = subprocess.CompletedProcess(["nvidia-smi", "-L"], 0, lines, "")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: smi)
    assert host_gpus.visible_gpu_ids() == ["0", "1"]
    assert not asked


def test_nothing_found_falls_back_to_torch_in_the_pool_only(monkeypatch):
    """A host without NVIDIA device nodes or nvidia-smi (a ROCm host): the plugin pins nothing, the
    pools ask torch."""
    import torch

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: [] if p == "/dev" else real(p))

    def no_smi(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", no_smi)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert host_gpus.visible_gpu_ids() == []
    assert host_gpus.visible_gpu_ids(torch_fallback=True) == ["0", "1"]


def test_the_plugin_keeps_its_name_for_it():
    from dsv4_numerics.plugin import hooks as pytest_plugin

    assert pytest_plugin.visible_gpu_ids is host_gpus.visible_gpu_ids
