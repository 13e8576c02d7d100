"""Stand-in: the sparse-attention indexer layer (a model layer, not a staged kernel)."""
from vllm._staged_engine import engine_only

SparseAttnIndexer, = engine_only(__name__, 'SparseAttnIndexer')
