"""``.ci/fuzz-breakdown`` on a machine without a GPU: every function it times as a step still exists
under the name it looks up (a renamed helper used to surface only on the GPU runner, as an
AttributeError before the first example), and its options parse."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "fuzz-breakdown"


def _load():
    loader = importlib.machinery.SourceFileLoader("fuzz_breakdown", str(SCRIPT))
    spec = importlib.util.spec_from_loader("fuzz_breakdown", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_every_timed_step_resolves():
    mod = _load()
    steps = mod.timed_steps()
    assert [s for _, _, s in steps] == [s for _, _, s in mod.TIMED_STEPS]
    for owner, attr, _ in steps:
        assert callable(getattr(owner, attr))


def test_help_lists_the_options(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        _load().main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--entry", "--builder", "--judge", "--profile", "--top-ops", "--batch", "--passes"):
        assert opt in out
