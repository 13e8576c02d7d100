"""Stand-in for sglang.utils: only is_in_ci() (the JIT test-range helper asks it)."""


def is_in_ci() -> bool:
    return False
