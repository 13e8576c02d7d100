"""Stand-in for sglang.kernels.ops: a bare namespace (the real one imports all 20 operator groups)."""
