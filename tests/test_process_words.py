"""The product speaks of itself and of its hardware ("one H200, 16 cores"), never of how the work on
it was organised: no stop numbers, no sessions of work, no numbers of an internal tracker's issues
or items, no names of a machine-lending service's kinds, no device-minute budgets, no engineers by
code name, no path into a folder the user does not have. This test greps the README, the docs, the
CI scripts and every Python file of the product and its tests for them."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()

PATTERNS = {
    "stop number": r"\b[Ss]top \d+\b",
    "session of work": r"\b(?:[Pp]revious|[Tt]his|[Nn]ext|[Ee]arlier|[Ll]ast|[Ww]ork) session\b|\bsessions? of work\b",
    "tracker issue number": r"\b[Ii]ssue #?\d+\b(?!-)",
    "tracker item number": r"\b[Ii]tem #?\d+\b",
    "machine kind of a lending service": r"\bnvidia-h\d+(?:-x\d+)?\b",
    "lending service": r"\blent (?:GPU )?machines?\b|\blending service\b",
    "device budget": r"\bdevice[- ](?:minutes?|budget|seconds)\b|\bbudget_left\b",
    "engineer by code name": r"\b[Ee]ngineer [A-Z]\d\b|\bE\d's\b",
    "path into a folder users do not have": r"\.\./shared\b",
}
_COMPILED = {k: re.compile(v) for k, v in PATTERNS.items()}
PYTHON_ROOTS = ("dsv4_numerics", "reference", "oracles", "kernels", "fixtures", "tests", "examples")


def product_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "conftest.py", REPO / "pyproject.toml", REPO / "mkdocs.yml"]
    files += sorted((REPO / "docs").rglob("*.md")) + sorted((REPO / "docs").rglob("*.py"))
    files += sorted(p for p in (REPO / ".ci").iterdir() if p.is_file())
    for root in PYTHON_ROOTS:
        files += sorted((REPO / root).rglob("*.py"))
    return [p for p in files if p.is_file() and p.resolve() != THIS and "__pycache__" not in p.parts]


def offences(text: str) -> list[tuple[int, str, str]]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, rx in _COMPILED.items():
            m = rx.search(line)
            if m:
                out.append((n, what, m.group(0)))
    return out


def test_the_patterns_catch_process_words_and_spare_the_product_words():
    caught = ["Stop 37. Where the time goes", "the previous session's ten runs", "(issue 23)",
              "issue 13 item 6", "an nvidia-h200-x2 machine", "45 device minutes", "engineer E2 derived",
              "E2's model", "the lent GPU machines", "see ../shared/spec"]
    spared = ["one H200, 16 cores", "2 H100 80GB", "Kernels that issue 128-bit loads", "items 0-263 of 2118",
              "in this pytest run", "a session's child", "flashinfer#4975", "the run stops at the first failure",
              "hazard H13", "WorkerSession", "the V4 layout (V4's page)", "C4's top-k"]
    for text in caught:
        assert offences(text), text
    for text in spared:
        assert not offences(text), (text, offences(text))


def test_no_process_words_in_the_product():
    hits = []
    for path in product_files():
        for n, what, word in offences(path.read_text(errors="replace")):
            hits.append(f"{path.relative_to(REPO)}:{n}: {what}: {word!r}")
    assert not hits, "\n".join(hits)
