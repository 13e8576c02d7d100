"""Stand-in for sglang.kernels.ops.attention.dsa: a bare namespace (the real one imports the DSA indexer's
paged-MQA-logits kernels, DeepGEMM and CuTe-DSL); only tilelang_kernel.py is staged from it."""
