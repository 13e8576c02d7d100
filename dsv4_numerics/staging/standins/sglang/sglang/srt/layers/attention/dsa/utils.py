"""Stand-in: the two DSA indexer names dsv4/compress.py imports (aiter preshuffle is ROCm-only: False)."""
INDEXER_K_CACHE_PRESHUFFLE_TILE = 16


def aiter_can_use_preshuffle_paged_mqa() -> bool:
    return False
