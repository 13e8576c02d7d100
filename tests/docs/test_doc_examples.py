"""Every Python example of README.md and docs/ runs here, in the order of its page (Sybil parses
the pages; the examples of one page share one namespace, as a reader running them in turn would).

An example that needs hardware or an optional package is preceded by a Sybil skip directive,
``<!-- skip: next if(not CUDA, reason="...") -->``, whose condition names one of the flags that
:func:`_setup` puts in every page's namespace; on a machine without it the example is reported
as skipped with that reason. Shell examples are not executed; ``test_shell_examples_name_real_commands``
checks that every ``dsv4-numerics`` command line in them names a real command and real options.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path
from unittest import SkipTest

import pytest

sybil = pytest.importorskip("sybil", reason="Sybil is not installed (pip install -e '.[test]')")
from sybil import Sybil  # noqa: E402
from sybil.evaluators.skip import Skipper  # noqa: E402
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").rglob("*.md") if "_hooks" not in p.parts)]


def _setup(namespace: dict) -> None:
    import torch

    namespace.update(
        CUDA=torch.cuda.is_available(),
        EXAMPLE_KERNELS=importlib.util.find_spec("dsv4_example_kernels") is not None,
    )


_SYBIL = Sybil(parsers=[PythonCodeBlockParser(), SkipParser()], setup=_setup)


def _rel(p: Path) -> str:
    return str(p.relative_to(REPO))


class _Page:
    """One parsed page, its examples evaluated lazily and in order, each outcome kept."""

    def __init__(self, path: Path):
        self.document = _SYBIL.parse(path)
        self.examples = list(self.document)
        self.outcomes: list[BaseException | None] = []
        _setup(self.document.namespace)

    def run_upto(self, index: int) -> BaseException | None:
        while len(self.outcomes) <= index:
            example = self.examples[len(self.outcomes)]
            try:
                example.evaluate()
                outcome = None
            except (Exception, SkipTest) as e:  # noqa: BLE001 - recorded and re-raised by the test
                outcome = e
            self.outcomes.append(outcome)
        return self.outcomes[index]


_PAGES: dict[Path, _Page] = {}


def _page(path: Path) -> _Page:
    if path not in _PAGES:
        _PAGES[path] = _Page(path)
    return _PAGES[path]


def _code_examples() -> list:
    params = []
    for path in PAGES:
        doc = _SYBIL.parse(path)
        for i, ex in enumerate(doc):
            if isinstance(ex.region.evaluator, Skipper):
                continue
            params.append(pytest.param(path, i, id=f"{_rel(path)}:{ex.line}",
                                       marks=[pytest.mark.xdist_group(name=f"docs-{_rel(path)}"),
                                              pytest.mark.dsv4_unreported]))
    return params


CODE_EXAMPLES = _code_examples()


def test_the_pages_hold_examples():
    assert len(CODE_EXAMPLES) >= 15, [p.id for p in CODE_EXAMPLES]
    assert any(p.id.startswith("README.md:") for p in CODE_EXAMPLES)


@pytest.mark.parametrize(("path", "index"), CODE_EXAMPLES)
def test_example(path: Path, index: int):
    outcome = _page(path).run_upto(index)
    if isinstance(outcome, SkipTest):
        pytest.skip(str(outcome))
    if outcome is not None:
        raise outcome


# --------------------------------------------------------------------------- shell examples

_FENCE = re.compile(r"^```(bash|sh|shell)\n(.*?)^```", re.S | re.M)


def _shell_commands(text: str) -> list[list[str]]:
    """``dsv4-numerics ...`` command lines of the page's shell blocks (continuations joined,
    comments dropped), as argument lists starting after ``dsv4-numerics``."""
    out = []
    for m in _FENCE.finditer(text):
        body = re.sub(r"\\\n", " ", m.group(2))
        for line in body.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith("#") or "dsv4-numerics " not in line:
                continue
            for part in re.split(r"&&|\|\||\||;", line):
                part = part.strip()
                idx = part.find("dsv4-numerics ")
                if idx < 0 or part[idx - 1:idx] not in ("", " ", "="):
                    continue
                try:
                    words = shlex.split(part[idx:])
                except ValueError:
                    words = part[idx:].split()
                out.append(words[1:])
    return out


def _subparsers(parser):
    import argparse

    for a in parser._actions:  # noqa: SLF001
        if isinstance(a, argparse._SubParsersAction):  # noqa: SLF001
            return a.choices
    return {}


def _options(parser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}  # noqa: SLF001


@pytest.mark.parametrize("path", PAGES, ids=_rel)
def test_shell_examples_name_real_commands(path: Path):
    from dsv4_numerics.cli import build_parser

    root = build_parser()
    problems = []
    for words in _shell_commands(path.read_text()):
        parser, used = root, ["dsv4-numerics"]
        for w in words:
            subs = _subparsers(parser)
            if subs and not w.startswith("-"):
                if w not in subs:
                    if w.isupper() or w.startswith(("[", "<")):  # a placeholder such as COMMAND
                        break
                    problems.append(f"{' '.join(used)}: no command {w!r}")
                    break
                parser, used = subs[w], [*used, w]
                continue
            if w.startswith("--"):
                opt = w.split("=", 1)[0]
                if opt not in _options(parser):
                    problems.append(f"{' '.join(used)}: no option {opt}")
    assert not problems, problems
