"""Every ``StageSpec`` is declared by keyword: seven positional arguments read as a row of values
whose meaning depends on their order (``expected`` and ``judge`` are both callables, ``outputs`` and
``defaults`` both containers), so a swap would still import."""

from __future__ import annotations

import ast
from pathlib import Path

from dsv4_numerics.oracles import stages as st

ROOT = Path(__file__).resolve().parents[2]


def _stage_spec_calls(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if getattr(f, "id", None) == "StageSpec" or getattr(f, "attr", None) == "StageSpec":
                yield node


def test_every_stage_spec_is_declared_by_keyword():
    bad, seen = [], 0
    for folder in ("oracles", "tests", "dsv4_numerics", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for call in _stage_spec_calls(path):
                seen += 1
                if call.args:
                    bad.append(f"{path.relative_to(ROOT)}:{call.lineno} passes {len(call.args)} positional arguments")
    assert seen >= 20, f"found only {seen} StageSpec declarations: the search no longer sees them"
    assert not bad, "declare StageSpec(name=..., kind=..., ...) by keyword:\n" + "\n".join(bad)


def test_the_registry_keeps_its_order():
    """The stage families register on import in a fixed order (the registry order reports use)."""
    names = list(st.STAGES)
    assert names[:5] == ["swa_write", "compressed_write", "v41_write", "plain_write", "gather"]
    assert names.index("decode") < names.index("prefill") < names.index("rope") < names.index("v41_gather")
    assert names[-1] == "kv_norm_rope_store"
