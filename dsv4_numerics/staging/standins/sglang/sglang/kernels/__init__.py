"""Stand-in for sglang.kernels: a bare namespace (the real one imports every operator group)."""
