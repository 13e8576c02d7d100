"""Stand-in for vllm.v1.attention.backend: engine base classes as placeholders; the real CG-support enum."""
from vllm._staged_engine import engine_only

AttentionBackend, AttentionImpl, AttentionMetadataBuilder, CommonAttentionMetadata, MultipleOf, max_decode_query_len = engine_only(__name__, 'AttentionBackend', 'AttentionImpl', 'AttentionMetadataBuilder', 'CommonAttentionMetadata', 'MultipleOf', 'max_decode_query_len')

import enum


class AttentionCGSupport(enum.Enum):
    ALWAYS = 3
    UNIFORM_BATCH = 2
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    NEVER = 0
