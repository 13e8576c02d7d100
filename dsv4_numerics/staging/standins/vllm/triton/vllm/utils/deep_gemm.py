"""Stand-in: MX scale packing follows the SM100 rule of the real module."""
import torch


def mqa_logits_use_mx_scales() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


def _align(x: int, y: int) -> int:
    return (x + y - 1) // y * y


def get_tma_aligned_size(x: int, element_size: int) -> int:
    return _align(x, 16 // element_size)
