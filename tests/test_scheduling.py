"""The suite's scheduling order (root conftest ``longest_first``) and the durations it reads
(``dsv4_numerics.runner.timeline.unit_durations``, ``tests/durations.json``)."""

import json

import pytest

import conftest as root
from dsv4_numerics.runner import timeline


class _Mark:
    def __init__(self, name, *args, **kwargs):
        self.name, self.args, self.kwargs = name, args, kwargs


class _Item:
    def __init__(self, nodeid, *marks):
        self.nodeid, self._marks = nodeid, {m.name: m for m in marks}

    def get_closest_marker(self, name):
        return self._marks.get(name)


def _grouped(nodeid, group):
    return _Item(nodeid, _Mark("xdist_group", group))


def test_longest_units_first_groups_as_one_unit_and_skips_count_zero():
    items = [
        _Item("t.py::short"),
        _grouped("m.py::case[a]", "e#0"), _grouped("m.py::case[b]", "e#0"),
        _Item("t.py::long"),
        _Item("t.py::skipped_long", _Mark("skip")),
        _Item("t.py::unknown_slow", _Mark("slow")),
        _grouped("m.py::case[c]", "new"),
        _Item("t.py::unknown"),
    ]
    durations = {"t.py::short": 0.5, "@e#0": 4.0, "t.py::long": 12.0, "t.py::skipped_long": 30.0}
    root.longest_first(items, durations)
    # short (under LPT_MIN_S) keeps its collected place among the units that count 0
    assert [it.nodeid for it in items] == [
        "t.py::long", "t.py::unknown_slow", "m.py::case[a]", "m.py::case[b]",
        "m.py::case[c]", "t.py::short", "t.py::skipped_long", "t.py::unknown"]


def test_unit_durations_sum_a_group_and_average_runs(tmp_path):
    def junit(path, a, b, c):
        path.write_text(
            '<testsuites><testsuite name="pytest">'
            f'<testcase classname="tests.kernels.test_matrix" name="test_kernel_case[x-1]@x#0" time="{a}"/>'
            f'<testcase classname="tests.kernels.test_matrix" name="test_kernel_case[x-2]@x#0" time="{b}"/>'
            f'<testcase classname="tests.test_cli.TestCheck" name="test_json" time="{c}"/>'
            '<testcase classname="tests.test_cli" name="test_fast" time="0.01"/>'
            '</testsuite></testsuites>')
        return path

    d = timeline.unit_durations([junit(tmp_path / "a.xml", 1.0, 2.0, 4.0), junit(tmp_path / "b.xml", 2.0, 1.0, 6.0)])
    assert d == {"@x#0": 3.0, "tests/test_cli.py::TestCheck::test_json": 5.0}
    assert timeline.main(["--durations"]) == 2


def test_shipped_durations_name_units_of_this_suite(request):
    """tests/durations.json is measured, not written by hand: its keys are the units the suite
    collects (a renamed test leaves a stale key; refresh it from a GPU run's junit.xml)."""
    data = json.loads(root.DURATIONS_FILE.read_text())
    assert data and all(isinstance(v, (int, float)) and v >= 0.3 for v in data.values())
    collected = {timeline.unit_key(it.nodeid, root.xdist_group_name(it)) for it in request.session.items}
    if len(collected) < 1000:
        pytest.skip("a partial collection (-k / a path): the suite's units are not all here")
    stale = sorted(set(data) - collected)
    assert len(stale) <= len(data) // 10, f"{len(stale)} stale keys in {root.DURATIONS_FILE.name}: {stale[:5]}"
