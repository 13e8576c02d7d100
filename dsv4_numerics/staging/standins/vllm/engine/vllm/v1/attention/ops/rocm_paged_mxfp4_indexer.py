"""Stand-in: the ROCm MXFP4 indexer ops (called by the ROCm indexer layer only)."""
from vllm._staged_engine import engine_only

rocm_mxfp4_indexer_k_store, rocm_mxfp4_indexer_q_quant = engine_only(__name__, 'rocm_mxfp4_indexer_k_store', 'rocm_mxfp4_indexer_q_quant')
