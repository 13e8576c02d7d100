"""The CPU ceiling of a share of the host (``dsv4_numerics.bench.cpu_ceiling``), which ``.ci/gpu-scaling``
prints next to each run: a record with the set's throughput, argument errors that name the
argument, and the command line's JSON."""
from __future__ import annotations

import json

import pytest

from dsv4_numerics.bench import cpu_ceiling


def test_measure_returns_the_sets_throughput():
    r = cpu_ceiling.measure(procs=2, units=2)
    assert r["kind"] == "mix" and r["procs"] == 2 and r["units"] == 2 and r["wall_s"] > 0
    assert r["units_per_s"] == pytest.approx(4 / r["wall_s"], rel=0.02)
    m = cpu_ceiling.measure(procs=1, units=1, kind="memory")
    moved = 2 * cpu_ceiling.MEM_PASSES * cpu_ceiling.MEM_ELEMS * 8  # bytes read and written in one unit
    assert m["kind"] == "memory" and m["gb_per_s"] == pytest.approx(moved / m["wall_s"] / 1e9, rel=0.02)
    c = cpu_ceiling.measure(procs=1, units=3, kind="compute")
    assert c["kind"] == "compute" and "gb_per_s" not in c and c["units_per_s"] == pytest.approx(3 / c["wall_s"], rel=0.02)


@pytest.mark.parametrize("kw,name", [({"procs": 0}, "procs"), ({"procs": True}, "procs"), ({"units": 0}, "units"),
                                     ({"units": 1.5}, "units"), ({"kind": "disk"}, "kind")])
def test_bad_arguments_name_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        cpu_ceiling.measure(**kw)


def test_command_line_prints_the_record(capsys):
    assert cpu_ceiling.main(["--procs", "1", "--units", "1"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert set(both) == {"mix", "memory"} and both["mix"]["procs"] == 1 and both["memory"]["gb_per_s"] > 0
    assert cpu_ceiling.main(["--procs", "1", "--units", "1", "--kind", "mix"]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "mix"
    with pytest.raises(SystemExit):
        cpu_ceiling.main(["--procs", "0"])
