"""Staging production kernels without their engines: vLLM's DeepSeek-V4 kernels out of its wheel
(``vllm``) and SGLang's kernel sources (``sglang``), each into one folder ``DSV4_STAGED`` points at."""
