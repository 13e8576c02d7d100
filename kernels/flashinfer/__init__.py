"""Adapters of FlashInfer's DeepSeek-V4 sparse MLA decode and index builders (``mla``)."""
