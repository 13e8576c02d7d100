"""Stand-in for sglang.srt.utils.custom_op: register_custom_op returns the function itself (an older release's dsv4 package imports it to wrap ops the staged kernels do not call as torch custom ops; the engine's utils are not staged)."""


def register_custom_op(fn=None, **options):
    """``@register_custom_op`` / ``@register_custom_op(name=..., mutates_args=...)``: the function
    unchanged (no ``torch.library`` registration)."""
    if fn is None:
        return lambda f: f
    return fn
