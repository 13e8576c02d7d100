"""Stand-in: FlashMLA scheduler metadata (used by the engine's SWA metadata builder only)."""
from vllm._staged_engine import engine_only

FlashMLASchedMeta, get_mla_metadata = engine_only(__name__, 'FlashMLASchedMeta', 'get_mla_metadata')
