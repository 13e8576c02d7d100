"""Stand-in: identity decorator (no CUDA-graph capture outside the engine)."""


def eager_break_during_capture(fn):
    return fn
