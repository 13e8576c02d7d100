"""The dependency direction of docs/architecture.md (the layers), checked on the source: each layer imports only the
layers above it, and importing a lower layer does not drag the application in.

Layers (top = imported by everything below it):
  reference -> oracles -> kernels -> fixtures -> dsv4_numerics (the top-level package)

Inside the application package, each folder (api/, strategies/, runner/, plugin/, report/,
staging/, inspect/, bench/, cli/) imports only what its row of APP_ALLOWED names: nothing imports
the CLI or the plugin, the runner never imports either, the API reaches the runner only through
its public entry points, strategies/ import the reference alone.
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


def _statements(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, imported names) of every absolute import in ``path`` (``import x`` gives
    ``(line, "x", [])``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every absolute import of ``dsv4_numerics.*`` in ``path``."""
    out = []
    for line, module, names in _statements(path):
        out.append((line, module))
        if module == "dsv4_numerics":  # from dsv4_numerics import oracles
            out += [(line, f"dsv4_numerics.{n}") for n in names]
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


# ----------------------------------------------------------------------------- the application's folders
# Which other parts each folder of the application package (dsv4_numerics/<folder>/) may import:
# the layers (by folder) and the application's own folders (by folder, module or name: an import
# must be one of them or inside one). Derived from the imports as they are, and strict: a new
# dependency between folders is a decision, made by editing this table.
APP = ("api", "strategies", "runner", "plugin", "report", "repro", "staging", "inspect", "bench", "cli")
ALL_LAYERS = set(LAYERS)
APP_ALLOWED = {
    # the public API: the layers, and the runner's public entry points only
    "api": ({"reference", "oracles", "kernels"},
            {"runner.pool.run_isolated", "runner.child.resolve_entry", "runner.case_files.save_cases",
             "runner.case_files.stage_cases_file", "runner.case_files.CASES_SUFFIX"}),
    # hypothesis strategies: the reference only
    "strategies": ({"reference"}, set()),
    # the runner: never the CLI or the plugin; external entries and the run metadata
    "runner": (ALL_LAYERS, {"api.external", "report.run_meta"}),
    # the pytest plugin: the public API (isolation included), the run metadata, the host's GPUs, the
    # requirement rule and the reproducer writer (--dsv4-repro)
    "plugin": ({"reference", "oracles", "kernels"},
               {"api.external", "api.isolation", "api.result_sink", "api.testing.cases", "report.run_meta",
                "runner.host_gpus", "runner.requirements", "repro.job.make"}),
    # reports: the check report's schema and row rule, and the public explain -- no runner internals
    "report": (ALL_LAYERS, {"runner.check.SCHEMA", "runner.check.aggregate", "runner.check.release_label",
                                "api.testing.explain_result"}),
    # reproducers: judge a case through the public API and the runner's entry points, write the script
    "repro": (ALL_LAYERS, {"api.callable_entry"}),
    "staging": ({"kernels"}, set()),
    "inspect": ({"reference", "oracles", "fixtures"}, set()),
    "bench": ({"reference", "kernels"}, {"runner.host_cpus"}),
    # the command line sits on top: it may use any folder but the plugin
    "cli": (ALL_LAYERS, {"api", "inspect", "report", "repro", "runner", "staging", "bench"}),
}


def _app_imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted path below ``dsv4_numerics``) of every absolute import of the package in
    ``path``; ``from X import name`` gives ``X.name`` (a module or a name in it)."""
    out = []
    for line, module, names in _statements(path):
        out += [(line, f"{module}.{n}") for n in names] if names else [(line, module)]
    return [(ln, m.split(".", 1)[1]) for ln, m in out if m.startswith("dsv4_numerics.")]


def _app_files(folder: str) -> list[Path]:
    # staging/standins/ holds the stand-ins staging writes: package data, not modules of the package
    return [p for p in sorted((ROOT / "dsv4_numerics" / folder).rglob("*.py")) if "standins" not in p.parts]


def test_every_application_folder_has_a_row():
    folders = {p.name for p in (ROOT / "dsv4_numerics").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(APP) == set(APP_ALLOWED), (
        f"dsv4_numerics/ folders {sorted(folders)} and tests/test_layers.py APP_ALLOWED {sorted(APP_ALLOWED)} differ: "
        "give a new folder its row")


@pytest.mark.parametrize("folder", APP)
def test_application_folder_imports_only_what_its_row_allows(folder):
    layers, parts = APP_ALLOWED[folder]
    bad = []
    for path in _app_files(folder):
        for line, dotted in _app_imports(path):
            top = dotted.split(".")[0]
            if top == folder or top in layers:
                continue
            if any(dotted == p or dotted.startswith(p + ".") for p in parts):
                continue
            what = "layer" if top in LAYERS else "folder"
            bad.append(f"  {path.relative_to(ROOT)}:{line} imports dsv4_numerics.{dotted} ({what} {top})")
    assert not bad, (f"dsv4_numerics/{folder}/ may import the layers {sorted(layers)} and of the application only "
                     f"{sorted(parts) or 'nothing'} (tests/test_layers.py APP_ALLOWED); these imports are outside "
                     "it -- move the code, use a public entry point, or change the table on purpose:\n" + "\n".join(bad))


def test_nothing_imports_the_cli_or_the_plugin():
    # (implied by the table; stated because it is the rule that keeps the command line and the
    # pytest plugin at the top: no job depends on how it is invoked)
    for folder, (_, parts) in APP_ALLOWED.items():
        assert not any(p.split(".")[0] == "cli" for p in parts if folder != "cli"), folder
        assert not any(p.split(".")[0] == "plugin" for p in parts if folder != "plugin"), folder


def test_the_top_level_package_imports_no_folder_at_import_time():
    bad = [f"dsv4_numerics/__init__.py:{ln} imports dsv4_numerics.{d}"
           for ln, d in _app_imports(ROOT / "dsv4_numerics" / "__init__.py")]
    assert not bad, "the top-level package resolves its exports lazily (_LAZY):\n" + "\n".join(bad)
