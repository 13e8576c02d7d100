"""The README's CPU-runner recipe is what CI runs: every command of it appears in ``.ci/run``, in
the same order (``--quiet`` and the ``--json`` path aside)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _commands(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if not line or line.startswith("#"):
            continue
        line = line.replace("--quiet ", "")
        line = re.sub(r"--json \S+", "--json PATH", line)
        out.append(" ".join(line.split()))
    return out


def _readme_cpu_recipe() -> list[str]:
    readme = (REPO / "README.md").read_text()
    m = re.search(r"\*\*A CPU runner\*\*.*?```bash\n(.*?)```", readme, re.S)
    assert m, "README.md has no CPU-runner recipe"
    return _commands(m.group(1))


def test_readme_cpu_recipe_is_what_ci_runs():
    recipe = _readme_cpu_recipe()
    ci = _commands((REPO / ".ci" / "run").read_text())
    assert "python3 -m pytest -n 2 -q --dsv4-require 'vllm_cpu.*'" in recipe
    pos = 0
    for cmd in recipe:
        assert cmd in ci[pos:], f"README's CPU recipe runs {cmd!r}; .ci/run does not (after {ci[pos - 1]!r})" \
            if pos else f"README's CPU recipe runs {cmd!r}; .ci/run does not"
        pos = ci.index(cmd, pos) + 1
