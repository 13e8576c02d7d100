"""Kernel entries contributed from outside this package.

Two sources, judged by ``dsv4-numerics check`` with the built-in registry and listed by
``dsv4-numerics kernels`` with the package that provided them:

* **Installed packages**, through the entry-point group ``dsv4_numerics.kernels``. In the
  providing project's ``pyproject.toml``::

      [project.entry-points."dsv4_numerics.kernels"]
      my_kernels = "my_pkg.dsv4_entries:ENTRIES"

  The object an entry point names is a :class:`~dsv4_numerics.kernels.registry.KernelEntry`, a
  list/tuple of them, or a zero-argument callable returning either.
* **A one-off file or module** (``check --entries-from FILE_OR_MODULE``): a ``.py`` path or an
  importable module name exposing ``ENTRIES`` (a list/tuple) or ``entries()`` (a zero-argument
  callable returning one).

Nothing here crashes the caller: an entry point that fails to import, an object of the wrong
type, an entry whose declaration ``kernels.registry.validate_entry`` rejects, or a name that
clashes with a built-in (or an earlier external) entry becomes a :class:`Problem` naming the
entry point (or entry) and the package; ``check`` shows each as an ``error`` row. Only a
``--entries-from`` argument that names no file and no importable module is an input error.

The crash-isolated kernel worker resolves an external entry by the worker spec
``dsv4_numerics.api.external:<entry name>`` (:func:`worker_spec`; module ``__getattr__`` below),
looking in the installed entry points and in the sources listed in ``DSV4_ENTRIES_FROM``
(``os.pathsep``-separated, set by ``check`` for its child processes).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable, NamedTuple

from dsv4_numerics.reference.errors import InputError

GROUP = "dsv4_numerics.kernels"
BUILTIN_PACKAGE = "dsv4-numerics"
ENV_ENTRIES_FROM = "DSV4_ENTRIES_FROM"
_SHAPE_RULE = "a KernelEntry, a list/tuple of KernelEntry, or a zero-argument callable returning either"


@dataclass(frozen=True)
class Provided:
    """An external entry that passed validation: the entry, the package (distribution name, or
    the ``--entries-from`` argument) and where it came from (entry point or file)."""

    entry: Any  # kernels.registry.KernelEntry
    package: str
    origin: str


class Problem(NamedTuple):
    """``(name, package, message)``: ``name`` is the entry point's name (or the entry's own name
    once it is known), ``package`` the distribution (or ``--entries-from`` argument)."""

    name: str
    package: str
    message: str


def _expand(obj: Any, what: str) -> tuple[list[Any], str | None]:
    """The entries ``obj`` stands for, or ``([], problem message)``."""
    from dsv4_numerics.kernels.registry import KernelEntry

    if callable(obj) and not isinstance(obj, (KernelEntry, list, tuple, type)):
        try:
            obj = obj()
        except Exception as e:  # noqa: BLE001 - a broken provider is a problem row
            return [], f"{what}: calling it raised {type(e).__name__}: {e}"
    if isinstance(obj, KernelEntry):
        return [obj], None
    if isinstance(obj, (list, tuple)):
        bad = [type(x).__name__ for x in obj if not isinstance(x, KernelEntry)]
        if bad:
            return [], f"{what} must be {_SHAPE_RULE} (the list holds {', '.join(sorted(set(bad)))})"
        return list(obj), None
    return [], f"{what} must be {_SHAPE_RULE} (got {type(obj).__name__})"


def _admit(entries: list[Any], label: str, package: str, origin: str, taken: dict[str, str],
           out: list[Provided], problems: list[Problem]) -> None:
    from dsv4_numerics.kernels.registry import validate_entry

    for e in entries:
        name = getattr(e, "name", None)
        shown = name if isinstance(name, str) and name else label
        bad = validate_entry(e)
        if bad:
            problems.append(Problem(shown, package, f"invalid entry declaration ({origin}): " + "; ".join(bad)))
            continue
        if name in taken:
            problems.append(Problem(name, package, f"entry name {name!r} ({origin}) clashes with an entry of "
                                                   f"{taken[name]}; external entries need names of their own"))
            continue
        taken[name] = package
        out.append(Provided(e, package, origin))


def _entry_points() -> list[Any]:
    return list(metadata.entry_points(group=GROUP))


def installed(taken: dict[str, str]) -> tuple[list[Provided], list[Problem]]:
    """Entries of installed packages (group ``dsv4_numerics.kernels``). ``taken`` maps names
    already in use to their package and is extended with the admitted ones."""
    out: list[Provided] = []
    problems: list[Problem] = []
    for ep in sorted(_entry_points(), key=lambda p: (getattr(p.dist, "name", "") or "", p.name)):
        dist = getattr(getattr(ep, "dist", None), "name", None) or "unknown package"
        origin = f"entry point {ep.name} = {ep.value}"
        try:
            obj = ep.load()
        except Exception as e:  # noqa: BLE001 - includes ImportError, SyntaxError, AttributeError
            problems.append(Problem(ep.name, dist, f"cannot load {origin}: {type(e).__name__}: {e}"))
            continue
        entries, msg = _expand(obj, origin)
        if msg:
            problems.append(Problem(ep.name, dist, msg))
            continue
        _admit(entries, ep.name, dist, origin, taken, out, problems)
    return out, problems


def _load_source_module(spec: str) -> Any:
    """Import ``spec`` (a .py path or a module name); InputError if it names neither."""
    p = Path(spec)
    if spec.endswith(".py") or p.is_file():
        if not p.is_file():
            raise InputError(f"--entries-from {spec}: no such file")
        path = p.resolve()
        mod_name = "dsv4_entries_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
        if mod_name in sys.modules:
            return sys.modules[mod_name]
        s = importlib.util.spec_from_file_location(mod_name, path)
        mod = importlib.util.module_from_spec(s)
        sys.modules[mod_name] = mod
        try:
            s.loader.exec_module(mod)
        except BaseException:
            sys.modules.pop(mod_name, None)
            raise
        return mod
    try:
        found = importlib.util.find_spec(spec)
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise InputError(f"--entries-from {spec}: no such file, and no importable module of that name")
    return importlib.import_module(spec)


def from_source(spec: str, taken: dict[str, str]) -> tuple[list[Provided], list[Problem]]:
    """Entries of one ``--entries-from`` source (see module docstring)."""
    if not isinstance(spec, str) or not spec:
        raise InputError(f"--entries-from: must be a .py path or a module name (got {spec!r})")
    out: list[Provided] = []
    problems: list[Problem] = []
    try:
        mod = _load_source_module(spec)
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 - the file exists but is broken: a problem row
        return out, [Problem(Path(spec).name, spec, f"importing it raised {type(e).__name__}: {e}")]
    if hasattr(mod, "ENTRIES"):
        obj, what = mod.ENTRIES, f"{spec}: ENTRIES"
    elif hasattr(mod, "entries"):
        obj, what = mod.entries, f"{spec}: entries()"
    else:
        return out, [Problem(Path(spec).name, spec, "defines neither ENTRIES nor entries()")]
    entries, msg = _expand(obj, what)
    if msg:
        return out, [Problem(Path(spec).name, spec, msg)]
    _admit(entries, Path(spec).name, spec, spec, taken, out, problems)
    return out, problems


def collect(sources: Iterable[str] = (), *, include_installed: bool = True,
            builtin_names: Iterable[str] | None = None) -> tuple[list[Provided], list[Problem]]:
    """Installed entries (unless ``include_installed`` is False) then those of ``sources``, each
    name unique across the built-in registry (``builtin_names``, default: the registry's) and
    each other. Never raises for a broken entry; raises InputError for a source that does not
    exist."""
    if builtin_names is None:
        from dsv4_numerics.kernels import registry

        builtin_names = registry.names()
    taken = {n: f"{BUILTIN_PACKAGE} (built-in)" for n in builtin_names}
    out: list[Provided] = []
    problems: list[Problem] = []
    if include_installed:
        o, p = installed(taken)
        out += o
        problems += p
    for spec in sources:
        o, p = from_source(spec, taken)
        out += o
        problems += p
    return out, problems


def source_paths(sources: Iterable[str]) -> list[str]:
    """``sources`` with file paths made absolute (for a child process with another cwd)."""
    return [str(Path(s).resolve()) if (s.endswith(".py") or Path(s).is_file()) else s for s in sources]


def worker_spec(name: str) -> str:
    """The kernel child's ENTRY argument (``worker_child``) that resolves the external entry ``name``."""
    return f"{__name__}:{name}"


def find(name: str) -> Any:
    """The external entry called ``name`` (installed, or from ``DSV4_ENTRIES_FROM``); KeyError."""
    sources = [s for s in os.environ.get(ENV_ENTRIES_FROM, "").split(os.pathsep) if s]
    provided, _ = collect(sources)
    for p in provided:
        if p.entry.name == name:
            return p.entry
    raise KeyError(f"no external kernel entry named {name!r} (installed or in ${ENV_ENTRIES_FROM})")


def __getattr__(name: str):  # PEP 562: ``dsv4_numerics.api.external:<entry name>`` for the worker
    if name.startswith("_"):  # dunders and private probes by tools: never an entry lookup
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return find(name)
    except KeyError as e:
        raise AttributeError(str(e)) from None
