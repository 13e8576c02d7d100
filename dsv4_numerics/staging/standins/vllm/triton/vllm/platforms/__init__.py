"""Stand-in for vllm.platforms: an NVIDIA GPU, OCP FP8, no programmatic dependent launch."""
from typing import NamedTuple

import torch


class DeviceCapability(NamedTuple):
    major: int
    minor: int

    def to_int(self) -> int:
        return self.major * 10 + self.minor


def _cap():
    if torch.cuda.is_available():
        return DeviceCapability(*torch.cuda.get_device_capability())
    return DeviceCapability(9, 0)


class _Platform:
    device_type = "cuda"
    device_name = "cuda"
    dispatch_key = "CUDA"
    simple_compile_backend = "inductor"

    def is_cuda(self): return True
    def is_cuda_alike(self): return True
    def is_rocm(self): return False
    def is_xpu(self): return False
    def is_cpu(self): return False
    def is_fp8_fnuz(self): return False
    def fp8_dtype(self): return torch.float8_e4m3fn
    def get_device_capability(self, device_id: int = 0): return _cap()
    def has_device_capability(self, cap, device_id: int = 0):
        c = cap if isinstance(cap, int) else cap[0] * 10 + cap[1]
        return _cap().to_int() >= c
    def is_device_capability(self, cap, device_id: int = 0):
        c = cap if isinstance(cap, int) else cap[0] * 10 + cap[1]
        return _cap().to_int() == c
    def is_device_capability_family(self, cap, device_id: int = 0):
        return _cap().to_int() // 10 == cap // 10
    def is_arch_support_pdl(self): return False
    def is_pin_memory_available(self): return True


current_platform = _Platform()


def vllm_version_matches_substr(substr: str) -> bool:
    return False
