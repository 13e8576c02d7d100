"""Stand-in for sglang.kernels.ops.attention: a bare namespace (the real one registers every attention backend)."""
