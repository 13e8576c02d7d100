"""The CPU ceiling of a share of the host (``dsv4_numerics.cpu_ceiling``), which ``.ci/gpu-scaling``
prints next to each run: a record with the set's throughput, argument errors that name the
argument, and the command line's JSON."""
from __future__ import annotations

import json

import pytest

from dsv4_numerics import cpu_ceiling


def test_measure_returns_the_sets_throughput():
    r = cpu_ceiling.measure(procs=2, units=2)
    assert r["procs"] == 2 and r["units"] == 2 and r["wall_s"] > 0
    assert r["units_per_s"] == pytest.approx(4 / r["wall_s"], rel=0.02)


@pytest.mark.parametrize("kw,name", [({"procs": 0}, "procs"), ({"procs": True}, "procs"), ({"units": 0}, "units"),
                                     ({"units": 1.5}, "units")])
def test_bad_arguments_name_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        cpu_ceiling.measure(**kw)


def test_command_line_prints_the_record(capsys):
    assert cpu_ceiling.main(["--procs", "1", "--units", "1"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["procs"] == 1 and rec["units_per_s"] > 0
    with pytest.raises(SystemExit):
        cpu_ceiling.main(["--procs", "0"])
