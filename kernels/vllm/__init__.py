"""Adapters of vLLM's DeepSeek-V4 kernels: CUDA cache writers (``cuda``), Triton ops (``triton``),
the ROCm Triton attention and index builders (``rocm_triton``), CuTe-DSL (``cutedsl``), the
DeepSeek-V4.1 Triton ops (``v41``) and the CPU backend (``cpu``)."""
