"""Adapters of FlashMLA as vLLM ships it: the MODEL1 sparse attention (``sparse``), the
DeepSeek-V4.1 attention paths (``v41``) and the rest of the MLA family (``mla_family``)."""
