"""Stand-in for transformers (used only when it is not installed): the config class sparse_swa.py names."""


class DeepseekV4Config:
    """Placeholder: only isinstance() checks in the engine's metadata builder name it."""
