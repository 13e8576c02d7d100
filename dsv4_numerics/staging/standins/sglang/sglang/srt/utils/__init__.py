"""Stand-in for sglang.srt.utils: the platform predicates the staged kernels import (NVIDIA CUDA)."""
from sglang.srt.utils.common import *  # noqa: F401,F403
from sglang.srt.utils.common import __all__  # noqa: F401
