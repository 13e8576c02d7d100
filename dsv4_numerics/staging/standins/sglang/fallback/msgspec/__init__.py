"""Stand-in for msgspec, used only where msgspec is not installed (DIR/fallback comes last on sys.path): Struct, json, DecodeError."""
import json as _json
import types as _types


class DecodeError(ValueError):
    pass


def _fields(cls):
    ann = {}
    for c in reversed(cls.__mro__):
        ann.update(vars(c).get("__annotations__", {}))
    return tuple(k for k, v in ann.items() if not str(v).startswith(("ClassVar", "typing.ClassVar")))


class Struct:
    """Record class: fields from annotations (ClassVar excluded), class attributes as defaults,
    positional or keyword construction, frozen=True forbids assignment, array_like=True
    encodes as a JSON list."""

    __struct_fields__ = ()

    def __init_subclass__(cls, frozen=False, array_like=False, **options):
        super().__init_subclass__()
        cls.__struct_fields__ = _fields(cls)
        cls.__struct_frozen__ = frozen
        cls.__struct_array_like__ = array_like
        cls.__struct_defaults__ = {k: vars(c)[k] for c in reversed(cls.__mro__) for k in cls.__struct_fields__
                                  if k in vars(c)}

    def __init__(self, *args, **kwargs):
        names = self.__struct_fields__
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__} takes at most {len(names)} positional arguments")
        vals = dict(self.__struct_defaults__)
        vals.update(zip(names, args))
        vals.update(kwargs)
        missing = [n for n in names if n not in vals]
        if missing:
            raise TypeError(f"{type(self).__name__} missing required argument(s) {missing}")
        for n in names:
            object.__setattr__(self, n, vals[n])

    def __setattr__(self, name, value):
        if getattr(type(self), "__struct_frozen__", False):
            raise AttributeError(f"immutable type: {type(self).__name__}")
        object.__setattr__(self, name, value)

    def _astuple(self):
        return tuple(getattr(self, n) for n in self.__struct_fields__)

    def __eq__(self, other):
        return type(self) is type(other) and self._astuple() == other._astuple()

    def __hash__(self):
        return hash((type(self), self._astuple()))

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n in self.__struct_fields__)})"


def _plain(obj):
    if isinstance(obj, Struct):
        if obj.__struct_array_like__:
            return [_plain(v) for v in obj._astuple()]
        return {n: _plain(getattr(obj, n)) for n in obj.__struct_fields__}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _build(tp, data):
    args = getattr(tp, "__args__", None)
    if args and isinstance(data, list):
        return [_build(args[0], d) for d in data]
    if isinstance(tp, type) and issubclass(tp, Struct):
        return tp(*data) if isinstance(data, list) else tp(**data)
    return data


def _encode(obj):
    return _json.dumps(_plain(obj), separators=(",", ":")).encode()


def _decode(raw, type=None):
    try:
        data = _json.loads(raw)
        return data if type is None else _build(type, data)
    except (ValueError, TypeError) as e:
        raise DecodeError(str(e)) from None


json = _types.SimpleNamespace(encode=_encode, decode=_decode)
