"""Stand-in for sglang/__init__.py: a bare namespace (the real one imports the frontend language and engine)."""
__version__ = "0.5.23"
