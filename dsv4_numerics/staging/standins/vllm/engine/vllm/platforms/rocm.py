"""Stand-in for vllm.platforms.rocm: the staged platform is NVIDIA, so no gfx942/gfx950/gfx1250 flags are set."""
_ON_GFX942 = False
_ON_GFX950 = False


def on_gfx1250() -> bool:
    return False
