"""Stand-in: DSv4 attention model layers (bases of the ROCm layers in amd/rocm.py)."""
from vllm._staged_engine import engine_only

DeepseekV4Attention, DeepseekV4Indexer, DeepseekV4IndexerCache = engine_only(__name__, 'DeepseekV4Attention', 'DeepseekV4Indexer', 'DeepseekV4IndexerCache')
