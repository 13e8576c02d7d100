"""The staging stand-ins are real source files shipped as package data: each one compiles, has a
docstring whose first line is its manifest reason, none is imported by the package, and the
built distribution lists them."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from dsv4_numerics.staging import sglang, vllm

FILES = sorted(vllm.STANDINS_ROOT.rglob("*.py"))


def test_there_are_standins_for_both_engines():
    assert {f.relative_to(vllm.STANDINS_ROOT).parts[0] for f in FILES} == {"vllm", "sglang", "sglang_releases"}
    assert sum(len(v) for v in vllm.STANDINS.values()) + len(sglang.STANDINS) + len(vllm.RELEASE_STANDINS) \
        + len(sglang.RELEASE_STANDINS) == len(FILES)


@pytest.mark.parametrize("path", FILES, ids=[f.relative_to(vllm.STANDINS_ROOT).as_posix() for f in FILES])
def test_standin_compiles_and_states_its_reason(path):
    text = path.read_text()
    compile(text, str(path), "exec")  # a SyntaxError names the file and line
    doc = ast.get_docstring(ast.parse(text))
    assert doc and "stand-in" in doc.lower(), f"{path}: the first docstring line is the manifest reason"
    assert text.endswith("\n") and not text.endswith("\n\n"), f"{path}: written as it is, one final newline"


def test_standins_are_data_not_modules_of_the_package():
    code = ("import sys, dsv4_numerics.staging.vllm, dsv4_numerics.staging.sglang\n"
            "print(','.join(m for m in sys.modules if '.standins' in m or m.split('.')[0] in ('vllm', 'sglang')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"staging imported stand-ins as modules: {out.stdout.strip()}"
    assert not (vllm.STANDINS_ROOT / "__init__.py").exists()


def test_pyproject_ships_them_as_package_data():
    tomllib = pytest.importorskip("tomllib")

    root = vllm.STANDINS_ROOT.parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "standins/**/*.py" in data["package-data"]["dsv4_numerics.staging"]
    assert not any("standins" in p for p in data["packages"])
