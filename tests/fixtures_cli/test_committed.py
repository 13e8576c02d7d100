"""The committed fixture set (fixtures/manifest.json + fixtures/data/) against the current
reference: what `dsv4-numerics check` does on CPU CI. A failure here means the reference (or a
default case) changed the pinned bytes: run `dsv4-numerics fixtures regen` to see what changed,
then `--accept` if the change is intended."""

from __future__ import annotations

import pytest

from dsv4_numerics.fixtures import catalog, golden, store


@pytest.fixture(scope="module")
def manifest():
    m = store.load_manifest(store.PACKAGE_ROOT)
    if not m["fixtures"]:
        pytest.skip("no committed fixtures in this checkout (run `dsv4-numerics fixtures regen`)")
    return m


def test_committed_set_is_small(manifest):
    total = golden.total_bytes(manifest)
    assert total <= catalog.MAX_TOTAL_BYTES
    for name, e in manifest["fixtures"].items():
        assert sum(f["bytes"] for f in e["files"].values()) <= catalog.MAX_FIXTURE_BYTES, name


def test_every_committed_fixture_verifies(manifest):
    checks = golden.verify(store.PACKAGE_ROOT, catalog.default_catalog())
    bad = [c.line() for c in checks if not c.ok]
    assert not bad, "\n".join(bad)
    kinds = {c.kind for c in checks}
    assert "reference" in kinds
