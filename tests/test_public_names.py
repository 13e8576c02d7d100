"""A name another module uses is public: no module of the project (tests included) reaches for an
underscore name of ANOTHER module of the project -- by ``from X import _name``, by importing a module
whose name starts with ``_``, by ``X._name`` on an imported project module, or by
``setattr``/``getattr``/``monkeypatch.setattr(X, "_name", ...)``. A helper two modules share is part
of its module's interface (documented, named without the underscore), or it moves to its one user.
Dunder names (``__version__``, ``__all__``) are not private.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("reference", "oracles", "kernels", "fixtures")  # installed as dsv4_numerics.<layer>
ROOTS = ("dsv4_numerics", "tests", "conftest", "dsv4_example_kernels")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(rel: Path) -> str:
    """The dotted import name of the project file ``rel`` (relative to the repository root)."""
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if parts and parts[0] in LAYERS:
        parts = ["dsv4_numerics"] + parts
    if parts[:2] == ["examples", "dsv4-example-kernels"]:
        parts = parts[2:]
    return ".".join(parts)


def _project_files() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if any(p.startswith(".") for p in rel.parts) or "site-packages" in rel.parts:
            continue
        out[_module_name(rel)] = path
    return out


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a (possibly relative) ``from ... import`` in ``module`` names."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_project(module: str) -> bool:
    return module.split(".")[0] in ROOTS


def _dotted(node: ast.AST, bound: dict[str, str]) -> str | None:
    """The project module an expression like ``m`` or ``pkg.sub`` names, if it names one."""
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in bound:
        return ".".join([bound[node.id]] + chain[::-1])
    return None


def private_uses() -> list[str]:
    """``file:line what`` for every reach into another project module's underscore names."""
    files = _project_files()
    bad = []
    for module, path in files.items():
        rel = path.relative_to(ROOT)
        tree = ast.parse(path.read_text(), filename=str(path))
        bound: dict[str, str] = {}  # local name -> the project module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if not _is_project(a.name):
                        continue
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                    if any(_private(p) for p in a.name.split(".")):
                        bad.append(f"{rel}:{node.lineno} imports the private module {a.name}")
            elif isinstance(node, ast.ImportFrom):
                src = _absolute(module, path, node)
                if not _is_project(src):
                    continue
                if any(_private(p) for p in src.split(".")):
                    bad.append(f"{rel}:{node.lineno} imports from the private module {src}")
                for a in node.names:
                    if f"{src}.{a.name}" in files:
                        bound[a.asname or a.name] = f"{src}.{a.name}"
                    if _private(a.name) and src != module:
                        bad.append(f"{rel}:{node.lineno} imports {a.name} from {src}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                owner = _dotted(node.value, bound)
                if owner and owner != module:
                    bad.append(f"{rel}:{node.lineno} uses {owner}.{node.attr}")
            elif isinstance(node, ast.Call) and len(node.args) >= 2:
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                attr = node.args[1]
                if name in ("setattr", "getattr", "delattr", "hasattr") and isinstance(attr, ast.Constant) \
                        and isinstance(attr.value, str) and _private(attr.value):
                    owner = _dotted(node.args[0], bound)
                    if owner and owner != module:
                        bad.append(f"{rel}:{node.lineno} {name}s {owner}.{attr.value}")
    return bad


def test_no_module_uses_another_modules_private_names():
    bad = private_uses()
    assert not bad, ("a name another module uses is public (drop the underscore, or move the code to its "
                     "one user):\n" + "\n".join(bad))


def test_the_check_sees_each_form_of_reach(tmp_path, monkeypatch):
    """The checker flags each of the four forms (a check that cannot fail guards nothing)."""
    pkg = tmp_path / "tests"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("_x = 1\n")
    (pkg / "_hidden.py").write_text("")
    (pkg / "b.py").write_text(
        "from tests.a import _x\n"
        "from . import _hidden\n"
        "import tests.a as a\n"
        "y = a._x\n"
        "def t(monkeypatch):\n"
        "    monkeypatch.setattr(a, '_x', 2)\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    got = private_uses()
    assert any("imports _x from tests.a" in g for g in got), got
    assert any("imports _hidden from tests" in g for g in got), got
    assert any("uses tests.a._x" in g for g in got), got
    assert any("setattrs tests.a._x" in g for g in got), got
