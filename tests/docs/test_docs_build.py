"""The documentation builds with ``mkdocs build --strict`` (the ``docs`` extra), and a broken link,
a broken anchor or an API reference that does not resolve fails the build. The README's links
into docs/ resolve to built pages and anchors.

Each build runs on a copy of mkdocs.yml and docs/ whose package folders are links to this
checkout, so a test never writes into the checkout and builds do not race each other.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="MkDocs is not installed (pip install -e '.[docs]')")
pytest.importorskip("mkdocstrings_handlers.python", reason="mkdocstrings[python] is not installed (pip install -e '.[docs]')")

REPO = Path(__file__).resolve().parents[2]
PACKAGE_FOLDERS = ("dsv4_numerics", "reference", "oracles", "kernels", "fixtures")


def _project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(REPO / "mkdocs.yml", root / "mkdocs.yml")
    shutil.copytree(REPO / "docs", root / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    for name in PACKAGE_FOLDERS:
        (root / name).symlink_to(REPO / name)
    return root


def _build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"),
                           "-d", str(site)], cwd=root, capture_output=True, text=True, timeout=600)


# the tests that read one built site run on one xdist worker, which builds it once; each build
# takes several seconds, so they are scheduled first (root conftest: ``slow``)
ON_ONE_SITE = pytest.mark.xdist_group(name="docs-site")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("docs")
    out = tmp / "site"
    r = _build(_project(tmp), out)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def _text(site: Path, page: str) -> str:
    return (site / page / "index.html").read_text()


@ON_ONE_SITE
def test_strict_build_passes(site: Path):
    assert (site / "index.html").is_file()
    for page in ("judge", "plugin", "check", "runners", "fixtures", "inspect", "policies", "divergences",
                 "performance", "cli", "architecture", "api"):
        assert (site / page / "index.html").is_file(), page


@ON_ONE_SITE
def test_cli_reference_is_generated_from_the_parser(site: Path):
    from dsv4_numerics.cli import build_parser

    html = _text(site, "cli")
    parser = build_parser()
    commands = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"][0].choices  # noqa: SLF001
    for name, sub in commands.items():
        assert f'id="dsv4-numerics-{name}"' in html, name
        for action in sub._actions:  # noqa: SLF001
            for opt in action.option_strings:
                if opt not in ("-h", "--help"):
                    assert opt in html, (name, opt)


@ON_ONE_SITE
def test_policy_catalogue_lists_every_value(site: Path):
    from dsv4_numerics.kernels.registry import POLICY_ENUMS

    html = _text(site, "policies")
    for key, enum in POLICY_ENUMS.items():
        assert f'id="{key}"' in html, key
        for member in enum:
            assert f"{key}={member.value}" in html, (key, member.value)


@ON_ONE_SITE
def test_readme_links_resolve_to_built_pages(site: Path):
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert links
    for target, anchor in links:
        path = REPO / target
        assert path.exists(), target
        if path.suffix != ".md":
            continue
        page = path.stem
        html = (site / "index.html").read_text() if page == "index" else _text(site, page)
        if anchor:
            assert f'id="{anchor}"' in html, f"README links to {target}#{anchor}: no such anchor"


@pytest.mark.parametrize(("page", "breakage", "expected"), [
    ("judge.md", "\nSee [a page that does not exist](no-such-page.md).\n", "no-such-page.md"),
    ("judge.md", "\nSee [a section that does not exist](policies.md#no-such-policy).\n", "no-such-policy"),
    ("api.md", "\n::: dsv4_numerics.api.no_such_module\n", "no_such_module"),
], ids=["link", "anchor", "api-reference"])
def test_a_broken_reference_fails_the_strict_build(tmp_path: Path, page: str, breakage: str, expected: str):
    root = _project(tmp_path)
    with open(root / "docs" / page, "a") as f:
        f.write(breakage)
    r = _build(root, tmp_path / "site")
    assert r.returncode != 0, f"the strict build passed with {breakage.strip()!r} in {page}"
    assert expected in r.stdout + r.stderr, r.stdout + r.stderr
