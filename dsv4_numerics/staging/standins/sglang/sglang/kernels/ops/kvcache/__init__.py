"""Stand-in for sglang.kernels.ops.kvcache: a bare namespace (the real one registers every KV-cache kernel)."""
