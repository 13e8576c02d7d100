"""Stand-in for vllm.triton_utils: the real Triton (the real module probes GPU drivers)."""
import triton
import triton.language as tl
import triton.language.extra.libdevice as tldevice

HAS_TRITON = True
LOG2E = 1.4426950408889634
LOGE2 = 0.6931471805599453


def use_tensor_descriptor(override=None) -> bool:
    return bool(override)
