"""Stand-in for vllm.config: no engine configuration exists in a staged kernel folder."""
from vllm._staged_engine import engine_only

CacheConfig, VllmConfig = engine_only(__name__, 'CacheConfig', 'VllmConfig')

import enum


class CUDAGraphMode(enum.Enum):
    NONE = 0
    PIECEWISE = 1
    FULL = 2


def get_current_vllm_config():
    raise RuntimeError("no vLLM engine configuration in a staged kernel folder")
