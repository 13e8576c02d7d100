"""Stand-in: the ROCm MXFP4 indexer backend."""
from vllm._staged_engine import engine_only

DeepseekV4RocmMxfp4IndexerBackend, = engine_only(__name__, 'DeepseekV4RocmMxfp4IndexerBackend')
