"""Stand-in: only the names the staged ops import (the indexer backend is engine code)."""


class DeepseekV32IndexerMetadata:
    pass


def dsa_indexer_uses_fp4(vllm_config) -> bool:
    return False
