"""Stand-in for vllm/__init__.py: a bare namespace (the real one configures torch and the engine)."""
__version__ = "0.33.0"
