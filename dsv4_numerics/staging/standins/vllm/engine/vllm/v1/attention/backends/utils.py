"""Stand-in: the engine's batch-splitting helper (a metadata-builder dependency)."""
from vllm._staged_engine import engine_only

split_decodes_and_prefills, = engine_only(__name__, 'split_decodes_and_prefills')
