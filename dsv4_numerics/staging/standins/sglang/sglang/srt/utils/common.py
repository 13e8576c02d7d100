"""Stand-in for sglang.srt.utils.common (177 kB, imports the engine): NVIDIA CUDA platform predicates only."""
import torch

__all__ = ["ceil_align", "ceil_div", "is_hip", "is_xpu", "is_cuda", "is_npu", "is_gfx95_supported",
           "is_gfx942_supported", "is_gfx1250_supported", "get_cuda_version", "async_h2d"]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def ceil_align(x: int, alignment: int) -> int:
    return ceil_div(x, alignment) * alignment


def is_hip() -> bool:
    return torch.version.hip is not None


def is_cuda() -> bool:
    return torch.version.cuda is not None


def is_xpu() -> bool:
    return False


def is_npu() -> bool:
    return False


def is_gfx95_supported() -> bool:
    return False


def is_gfx942_supported() -> bool:
    return False


def is_gfx1250_supported() -> bool:
    return False


def get_cuda_version():
    v = torch.version.cuda or "0.0"
    return tuple(int(x) for x in v.split(".")[:2])


def async_h2d(*args, **kwargs):
    raise RuntimeError("sglang.srt.utils.common.async_h2d is SGLang engine machinery: "
                       "not available in a staged kernel folder")
