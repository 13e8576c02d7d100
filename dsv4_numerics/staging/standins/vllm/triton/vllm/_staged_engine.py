"""Stand-in helper (no vLLM counterpart): placeholders for engine names that staged files import."""


def engine_only(module, *names):
    """One placeholder class per name: importable, subclassable, annotatable; creating or
    calling one raises, so an engine code path can never run silently on a stand-in."""
    out = []
    for name in names:
        def __init__(self, *args, _n=f"{module}.{name}", **kwargs):
            raise RuntimeError(f"{_n} is vLLM engine machinery: not available in a staged kernel folder")
        out.append(type(name, (), {"__init__": __init__, "__module__": module,
                                   "__class_getitem__": classmethod(lambda cls, item: cls)}))
    return tuple(out)
