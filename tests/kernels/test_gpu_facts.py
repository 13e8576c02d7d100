"""``kernels.gpu_facts``: the visible NVIDIA GPUs' name and capability from NVML, without
initialising CUDA, and ``probe.gpu_info`` built on it."""

from __future__ import annotations

import pytest
import torch

from dsv4_numerics.kernels import gpu_facts, probe
from dsv4_numerics.kernels.gpu_facts import GpuFact, select

H200 = GpuFact("NVIDIA H200", (9, 0), "GPU-aaaa-1111")
H200B = GpuFact("NVIDIA H200", (9, 0), "GPU-bbbb-2222")
B200 = GpuFact("NVIDIA B200", (10, 0), "GPU-cccc-3333")


def test_select_follows_cuda_visible_devices():
    same = [H200, H200B]
    assert select(same, None, False) == same
    assert select(same, "1", False) == [H200B]
    assert select(same, "1,0", False) == [H200B, H200]
    assert select(same, "", False) == [] and select(same, "-1", False) == []
    assert select(same, "0,7,1", False) == [H200]  # CUDA stops at the first entry naming no device
    assert select(same, "GPU-bbbb", False) == [H200B]  # a unique UUID prefix
    assert select(same, "GPU-", False) == []  # ambiguous prefix: no device
    assert select(same, "MIG-x", False) is None  # MIG instances: ask torch


def test_select_refuses_integer_indices_on_mixed_gpus_unless_pci_order():
    mixed = [B200, H200]
    assert select(mixed, None, False) is None and select(mixed, "1", False) is None
    assert select(mixed, None, True) == mixed and select(mixed, "1", True) == [H200]
    assert select(mixed, "GPU-aaaa", False) == [H200]  # a UUID is certain in any order


def test_gpu_info_uses_the_nvml_facts_on_a_cuda_build(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(gpu_facts, "visible_gpu_facts", lambda: [B200, H200])
    for name in ("get_device_name", "get_device_capability", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name: pytest.fail(f"torch.cuda.{_n} asked"))
    probe.gpu_info.cache_clear()
    try:
        info = probe.gpu_info()
        assert (info.present, info.vendor, info.name, info.capability, info.arch) == (
            True, "cuda", "NVIDIA B200", (10, 0), "sm100")
        assert probe.arch_reason(["sm90"]) is not None and probe.arch_reason(["sm100"]) is None
        monkeypatch.setattr(gpu_facts, "visible_gpu_facts", lambda: [])
        probe.gpu_info.cache_clear()
        none = probe.gpu_info()
        assert not none.present and "CUDA_VISIBLE_DEVICES" in none.why
    finally:
        probe.gpu_info.cache_clear()


@pytest.mark.skipif(gpu_facts.visible_gpu_facts() is None or torch.version.cuda is None,
                    reason="needs an NVIDIA GPU with NVML and a CUDA build of torch")
def test_nvml_facts_are_what_torch_reports():
    facts = gpu_facts.visible_gpu_facts()
    assert len(facts) == torch.cuda.device_count()
    for i, f in enumerate(facts):
        assert (f.name, f.capability) == (torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))


def test_no_nvml_or_a_failing_one_means_ask_torch_and_is_not_remembered(monkeypatch):
    import ctypes
    import types

    def broken(name):
        raise RuntimeError("anything")

    # gpu_facts' own ctypes name only: torch's NVML check and other threads keep the real one
    shim = types.SimpleNamespace(**{k: getattr(ctypes, k) for k in dir(ctypes) if not k.startswith("__")})
    shim.CDLL = broken
    monkeypatch.setattr(gpu_facts, "ctypes", shim)
    monkeypatch.setattr(gpu_facts, "FOUND_CACHE", {})
    assert gpu_facts.nvml_devices() is None and gpu_facts.visible_gpu_facts() is None
    assert gpu_facts.FOUND_CACHE == {}
    monkeypatch.setattr(gpu_facts, "nvml_devices", lambda: [H200, H200B])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gpu_facts.visible_gpu_facts() == [H200B] and len(gpu_facts.FOUND_CACHE) == 1
