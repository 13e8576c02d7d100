"""Adapters of SGLang's DeepSeek-V4 kernels: Triton (``triton``) and JIT-CUDA / TileLang (``jit``)."""
