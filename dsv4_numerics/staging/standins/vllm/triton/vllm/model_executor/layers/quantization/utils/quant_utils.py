"""Stand-in: FP8 range as the real get_fp8_min_max computes it."""
import torch

from vllm.platforms import current_platform


def get_fp8_min_max() -> tuple[float, float]:
    if current_platform.is_fp8_fnuz():
        return -224.0, 224.0
    finfo = torch.finfo(current_platform.fp8_dtype())
    return finfo.min, finfo.max


# The V4.1 query quantiser tags its output with this key (identity is all it needs).
kMxfp8Dynamic = "mxfp8_dynamic_group32"
