"""The dependency direction of docs/architecture.md (the layers), checked on the source: each layer imports only the
layers above it, and importing a lower layer does not drag the application in.

Layers (top = imported by everything below it):
  reference -> oracles -> kernels -> fixtures -> dsv4_numerics (the top-level package)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# directory -> the dsv4_numerics sub-packages its modules may import
ALLOWED = {
    "reference": {"reference"},
    "oracles": {"reference", "oracles"},
    "kernels": {"reference", "kernels"},
    "fixtures": {"reference", "oracles", "kernels", "fixtures"},
}
LAYERS = ("reference", "oracles", "kernels", "fixtures")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every absolute import of ``dsv4_numerics.*`` in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            if node.module == "dsv4_numerics":  # from dsv4_numerics import oracles
                out += [(node.lineno, f"dsv4_numerics.{a.name}") for a in node.names]
    return [(ln, m) for ln, m in out if m == "dsv4_numerics" or m.startswith("dsv4_numerics.")]


def _target(module: str) -> str:
    """The layer (or ``app`` for the top-level package) a dotted import lands in."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS:
        return parts[1]
    return "app"


def test_no_module_imports_a_layer_folder_by_its_bare_name():
    """``from reference import x`` (the folder on ``sys.path``, e.g. pytest's rootdir) loads a SECOND
    copy of the module beside ``dsv4_numerics.reference.x``: its classes are other classes, so an
    ``InputError`` raised by one is not caught as the other's. Everything imports the installed names."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0].startswith(".") or "site-packages" in rel.parts:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            bad += [f"{rel}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in LAYERS]
    assert not bad, "import the layers as dsv4_numerics.<layer>, never by the folder's name:\n" + "\n".join(bad)


@pytest.mark.parametrize("layer", LAYERS)
def test_layer_imports_only_the_layers_above(layer):
    bad = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        for line, mod in _imports(path):
            if _target(mod) not in ALLOWED[layer]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {mod}")
    assert not bad, f"{layer}/ may import only {sorted(ALLOWED[layer])}:\n" + "\n".join(bad)


def test_oracles_and_kernels_are_independent_of_each_other():
    # (covered by ALLOWED; stated separately because it is the rule most easily broken)
    assert "kernels" not in ALLOWED["oracles"] and "oracles" not in ALLOWED["kernels"]


def test_importing_the_reference_stays_light():
    code = (
        "import sys, dsv4_numerics.reference.attention.ordered, dsv4_numerics.reference.caches.model1\n"
        "heavy = sorted(m for m in sys.modules if m.startswith('dsv4_numerics.') and\n"
        "               not m.startswith('dsv4_numerics.reference'))\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing the reference imported {out.stdout.strip()}"


def test_top_level_reexports_resolve_lazily():
    code = (
        "import sys, dsv4_numerics as dn\n"
        "assert 'dsv4_numerics.oracles.matrix' not in sys.modules\n"
        "missing = [n for n in dn.__all__ if not hasattr(dn, n)]\n"
        "print(','.join(missing))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"re-exported names that do not resolve: {out.stdout.strip()}"
