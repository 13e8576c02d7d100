"""Stand-in: the ROCm MXFP4 indexer layer (a model layer, not a staged kernel)."""
from vllm._staged_engine import engine_only

RocmSparseAttnIndexer, = engine_only(__name__, 'RocmSparseAttnIndexer')
