"""dsv4_numerics.timeline: the wall-time breakdown of a run from the per-worker timelines."""

from dsv4_numerics import timeline


def _write(folder, worker, rows):
    (folder / f"{worker}.tsv").write_text("".join(f"{a}\t{b}\t{w}\t{n}\n" for a, b, w, n in rows))


def test_breakdown_splits_startup_collection_busy_and_idle(tmp_path):
    _write(tmp_path, "gw0", [(100, 100, "sessionstart", "-"), (101, 103, "collection", "-"),
                             (103, 110, "test", "a"), (110, 111, "test", "b")])
    _write(tmp_path, "gw1", [(100.5, 100.5, "sessionstart", "-"), (101, 104, "collection", "-"),
                             (104, 120, "test", "c")])
    text = timeline.breakdown(tmp_path)
    assert "wall 20.0 s" in text
    gw0 = next(line for line in text.splitlines() if line.strip().startswith("gw0")).split()
    assert gw0[1:] == ["1.0", "2.0", "2", "8.0", "9.0", "11.0"]  # idle: 17 s from its first test to the end, 8 busy
    assert "tail: the last worker finished" in text and text.splitlines()[-3].strip().startswith("16.0 s  c")


def test_main_usage_and_empty_folder(tmp_path, capsys):
    assert timeline.main([]) == 2
    assert timeline.main([str(tmp_path)]) == 0
    assert "no *.tsv" in capsys.readouterr().out
