"""Stand-in: KV-cache specs of the engine's cache manager."""
from vllm._staged_engine import engine_only

KVCacheSpec, MLAAttentionSpec, SlidingWindowMLASpec, get_kv_quant_mode = engine_only(__name__, 'KVCacheSpec', 'MLAAttentionSpec', 'SlidingWindowMLASpec', 'get_kv_quant_mode')
