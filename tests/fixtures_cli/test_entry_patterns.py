"""One vocabulary for the options that name kernel entries (``check --entry / --require``, pytest
``--dsv4-require``, ``fixtures regen / verify`` names, ``--record-kernel``, ``check --case``): a
name or an ``fnmatch`` glob, matched by ``kernels.registry.match_patterns`` alone; a pattern that
matches nothing is a usage error naming the option."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dsv4_numerics.cli import EXIT_USAGE, main
from dsv4_numerics.fixtures import golden
from dsv4_numerics.kernels import registry
from dsv4_numerics.plugin.hooks import evaluate_requirements
from dsv4_numerics.reference.errors import InputError
from dsv4_numerics.runner.check import select

from .fakes import toy_catalog

REPO = Path(__file__).resolve().parents[2]


def test_the_matcher_takes_names_and_globs_case_sensitively():
    names = ["cutedsl.compressor", "cutedsl.dequant_gather", "vllm_cpu.sparse_decode", "CUTEDSL.x"]
    got = registry.match_patterns(["cutedsl.*", "vllm_cpu.sparse_decode", "*[!_]gather", "none.*"], names)
    assert got == {"cutedsl.*": ["cutedsl.compressor", "cutedsl.dequant_gather"],
                   "vllm_cpu.sparse_decode": ["vllm_cpu.sparse_decode"],
                   "*[!_]gather": [], "none.*": []}
    with pytest.raises(InputError, match=r"^--entry 'none\.\*' matches no kernel entry \(4 known"):
        registry.expand_patterns(["cutedsl.*", "none.*"], names, "--entry")


def test_check_entry_takes_the_globs_require_takes():
    want = [n for n in registry.names() if n.startswith("cutedsl.")]
    assert want, "no cutedsl entries registered"
    by_entry = select(["cutedsl.*"], include_installed=False)
    by_require = select(["cutedsl.*"], require=["cutedsl.*"], include_installed=False)
    assert [c.entry.name for c in by_entry.candidates] == want
    assert [c.entry.name for c in by_require.candidates] == want
    assert [n for _, n in by_require.required] == want


@pytest.mark.parametrize("argv, option", [
    (["check", "--no-fixtures", "--no-external", "--entry", "nosuch.*"], "--entry"),
    (["check", "--no-fixtures", "--no-external", "--require", "nosuch.*"], "--require"),
    (["fixtures", "regen", "--record-kernel", "nosuch.*", "--out-dir", "{tmp}"], "--record-kernel"),
])
def test_a_pattern_matching_nothing_is_a_usage_error_naming_the_option(argv, option, tmp_path, capsys):
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"{option} 'nosuch.*' matches no kernel entry" in err and "\n" not in err.strip()


def test_record_kernel_takes_a_pattern_for_one_entry_only(tmp_path, capsys):
    assert main(["fixtures", "regen", "--record-kernel", "cutedsl.*", "--out-dir", str(tmp_path)]) == EXIT_USAGE
    assert "--record-kernel 'cutedsl.*' matches 2 kernel entries" in capsys.readouterr().err


def test_fixture_selections_take_globs(tmp_path):
    cat = toy_catalog()
    assert [s.name for s in golden.select_specs(cat, ["toy_bytes.tiny.*"])] == [
        "toy_bytes.tiny.amax_clamp", "toy_bytes.tiny.scale_clamp"]
    with pytest.raises(InputError, match=r"fixtures regen: NAME 'toy_nope\.\*' matches no fixture name"):
        golden.select_specs(cat, ["toy_nope.*"])
    golden.regen(tmp_path, cat)
    checks = golden.verify(tmp_path, cat, ["*.scale_clamp"])
    assert sorted(c.name for c in checks) == ["toy_bytes.inf-param.scale_clamp", "toy_bytes.tiny.scale_clamp"]
    with pytest.raises(InputError, match=r"fixtures verify: NAME 'x\*' matches no committed fixture"):
        golden.verify(tmp_path, cat, ["x*"])


def test_dsv4_require_names_its_option_for_a_pattern_matching_nothing():
    _, failures = evaluate_requirements([], [], ["nosuch.*"], False)
    assert failures == ["--dsv4-require: required 'nosuch.*' matches no kernel entry (none registered, installed "
                        "or reported by a test)"]


def test_one_definition_of_pattern_matching():
    # every option that names entries or cases matches through registry.match_patterns; fnmatch
    # itself appears there only (oracles/tolerances.py matches tolerance records, not options)
    uses = re.compile(r"^\s*(import fnmatch|from fnmatch import)|\bfnmatch\.\w+\(", re.M)
    users = sorted(str(f.relative_to(REPO)) for d in ("dsv4_numerics", "kernels", "fixtures")
                   for f in (REPO / d).rglob("*.py") if uses.search(f.read_text(encoding="utf-8")))
    assert users == ["kernels/registry.py"]
