"""Kernel entries are declared one way: each family module of ``registry.FAMILY_MODULES`` binds
``ENTRIES`` once, at module level, to a list literal of its entries -- no ``ENTRIES.append`` /
``+=`` later in the file, no module-level ``NAME = KernelEntry(...)`` collected afterwards -- so
a module's entries, in listing order, are the one list a reader finds at its end. Adapter modules
import the shared machinery (``kernels/convert.py``, ``probe.py``, ``vllm/writer_args.py``), not
another adapter's entries."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dsv4_numerics.kernels import registry

KERNELS = Path(registry.__file__).resolve().parent


def _module_path(name: str) -> Path:
    return KERNELS / (name.replace(".", "/") + ".py")


@pytest.mark.parametrize("family", registry.FAMILY_MODULES)
def test_entries_are_one_list_literal(family):
    path = _module_path(family)
    tree = ast.parse(path.read_text(), filename=str(path))
    binds, bad = [], []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        value = getattr(node, "value", None)
        for t in targets:
            if isinstance(t, ast.Name) and t.id == "ENTRIES":
                binds.append(node)
                if isinstance(node, ast.AugAssign) or not isinstance(value, ast.List):
                    bad.append(f"line {node.lineno}: ENTRIES must be bound to a list literal")
            elif isinstance(value, ast.Call) and getattr(value.func, "id", None) == "KernelEntry":
                bad.append(f"line {node.lineno}: {ast.unparse(t)} = KernelEntry(...) outside ENTRIES")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "ENTRIES":
            bad.append(f"line {node.lineno}: ENTRIES.{node.func.attr}(...)")
    assert len(binds) == 1, f"{path.name}: ENTRIES bound {len(binds)} times"
    assert not bad, f"{path.relative_to(KERNELS)}:\n" + "\n".join(bad)


def test_every_adapter_module_is_a_family_module_or_machinery():
    """A module under an engine folder either declares entries (listed in FAMILY_MODULES) or is
    that engine's shared machinery; nothing is silently left out of the listing."""
    machinery = {"vllm.writer_args"}
    found = {str(p.relative_to(KERNELS).with_suffix("")).replace("/", ".")
             for p in KERNELS.glob("*/*.py") if p.name != "__init__.py"}
    assert found - machinery == set(registry.FAMILY_MODULES)
