"""Case files: a stage's default cases built once, saved with ``torch.save`` and handed to
every kernel child (``python -m dsv4_numerics.runner.child --cases FILE``), so no child rebuilds
them.

:func:`stage_cases_file` builds ``default_cases(stage)`` at most once per process and, with the
persistent cache, once per machine: the file's name carries a key (:func:`cases_key`) over the
package version, the torch version, the stage and the bytes of the ``reference`` sources that
build the cases; a file that fails to load is rebuilt; files of older keys are pruned once an
hour old. Beside each file, written after it, a small JSON sidecar holds its case names and byte
count (:func:`case_names`: what pytest's collection needs in every xdist worker, without loading
every stage's tensors; a file whose size matches its sidecar is taken as complete). The cache is
shared by concurrent processes (xdist workers, ``check``): files are written atomically.

Environment: ``DSV4_CASES_CACHE`` (folder of the case cache; default
``$XDG_CACHE_HOME/dsv4-numerics/cases`` or ``~/.cache/dsv4-numerics/cases``; ``off`` keeps the
files in a temporary folder of this process only).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

ENV_CASES_CACHE = "DSV4_CASES_CACHE"
# Which case set the matrix runs: "default" (CPU-sized) or "full" (reference.cases.CASE_SIZES; the
# GPU runner's sweep over every dimension the production kernels' own tests vary). Read by
# stage_cases_file (the pytest matrix, check's children) and check's in-process entries;
# `dsv4-numerics check --cases full` sets it for its run.
ENV_CASES = "DSV4_CASES"


def selected_case_size() -> str:
    """The case-set size ``DSV4_CASES`` selects (default ``"default"``); an unknown value is an
    ``InputError`` naming the variable and the known sizes."""
    from dsv4_numerics.reference.cases import CASE_SIZES
    from dsv4_numerics.reference.errors import InputError

    v = os.environ.get(ENV_CASES, "").strip().lower() or "default"
    if v not in CASE_SIZES:
        raise InputError(f"environment variable {ENV_CASES}={v!r}: must be one of {list(CASE_SIZES)}")
    return v


CASES_FILES: dict[tuple[str, str, str], str] = {}
_CASES_LOCK = threading.Lock()
_SESSION_DIR: list[str] = []
_KEY_LEN = 20


@contextlib.contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    """Run the body with ``n`` torch intra-op threads (restored after). Case building is many
    small tensor operations: on a loaded host, OpenMP threads spinning against other processes
    made ``default_cases("decode")`` 25x slower with 2 threads than with 1 (15.7 s vs 0.62 s)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


SOURCES_MEMO: dict[Path, bytes] = {}  # _sources_digest's memo, per reference tree


def _sources_digest(root: Path) -> bytes:
    """SHA-256 over the relative path and bytes of every ``*.py`` under ``root``, once per process
    (the cases this process builds come from the modules it imported: their sources as read then)."""
    hit = SOURCES_MEMO.get(root)
    if hit is None:
        h = hashlib.sha256()
        for f in sorted(root.rglob("*.py"), key=lambda f: f.relative_to(root).as_posix()):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
        hit = SOURCES_MEMO[root] = h.digest()
    return hit


def cases_key(stage: str, size: str = "default") -> str:
    """Hash of everything ``stage_cases(stage, size)`` depends on: the package and torch versions,
    the stage, the size and the source bytes of every module of the ``reference`` package, its
    subpackages included (the case builders, ``reference/cases/``, and all they call live there,
    and it imports nothing of this project outside it)."""
    import torch

    from dsv4_numerics import reference
    from dsv4_numerics.fixtures.store import package_version

    h = hashlib.sha256()
    for part in (package_version("dsv4-numerics"), torch.__version__, stage) + ((size,) if size != "default" else ()):
        h.update(part.encode() + b"\0")
    h.update(_sources_digest(Path(reference.__file__).resolve().parent))
    return h.hexdigest()[:_KEY_LEN]


def cases_cache_dir() -> Path | None:
    """The persistent case cache folder, or None when ``DSV4_CASES_CACHE=off``."""
    v = os.environ.get(ENV_CASES_CACHE)
    if v is not None and v.strip().lower() in ("", "0", "off", "no", "false"):
        return None
    if v:
        return Path(v).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsv4-numerics" / "cases"


def _session_dir() -> Path:
    with _CASES_LOCK:
        if not _SESSION_DIR:
            _SESSION_DIR.append(tempfile.mkdtemp(prefix="dsv4-cases-"))
        return Path(_SESSION_DIR[0])


def _atomic_write(path: Path, write) -> None:
    """``write(f)`` into a temporary file in ``path``'s folder, then ``os.replace`` it to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def names_path(path: Path) -> Path:
    """The sidecar of case file ``NAME.pt``: ``NAME.names.json``."""
    return path.with_name(path.name.removesuffix(".pt") + ".names.json")


def _write_names(path: Path, cases: list) -> None:
    """The sidecar of ``path`` (written after it): its cases' names and its byte count."""
    doc = {"names": [c.name for c in cases], "bytes": path.stat().st_size}
    _atomic_write(names_path(path), lambda f: f.write(json.dumps(doc).encode()))


def _read_names(path: Path) -> list[str] | None:
    """The case names of ``path`` from its sidecar, or None: no sidecar, an unreadable one, or
    one whose byte count is not the file's (a file changed or cut after it was written)."""
    try:
        doc = json.loads(names_path(path).read_text())
        if doc["bytes"] == path.stat().st_size and all(isinstance(n, str) for n in doc["names"]):
            return list(doc["names"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def build_cases_file(stage: str, path: str | Path, size: str = "default") -> list:
    """Build ``stage_cases(stage, size)`` (one torch thread) and ``torch.save`` the list to
    ``path`` atomically (a temporary file in the same folder, then ``os.replace``), then its
    names sidecar; returns the cases."""
    import torch

    from dsv4_numerics.reference.cases import stage_cases

    with _torch_threads(1):
        cases = stage_cases(stage, size)
    path = Path(path)
    _atomic_write(path, lambda f: torch.save(cases, f))
    _write_names(path, cases)
    return cases


def _valid(path: Path) -> bool:
    """Whether ``path`` is a complete case file: its sidecar's byte count matches, or (no valid
    sidecar: an older file, or one cut short) it loads as a list, and then gets its sidecar."""
    if not path.is_file():
        return False
    if _read_names(path) is not None:
        return True
    import torch

    try:
        cases = torch.load(path, weights_only=False)
    except Exception:  # noqa: BLE001 - a truncated or foreign file: rebuild it
        return False
    if not isinstance(cases, list):
        return False
    with contextlib.suppress(OSError, AttributeError):
        _write_names(path, cases)
    return True


_PRUNE_AFTER_S = 3600.0


def _prune(cache: Path, stem: str, keep: Path) -> None:
    """Remove the files of other keys of the same stage (older sources or versions) once they
    are an hour old (a concurrent run of another checkout may still be handing one out)."""
    now = time.time()
    for f in cache.glob(f"{stem}-{'?' * _KEY_LEN}.pt"):
        with contextlib.suppress(OSError):
            if f != keep and now - f.stat().st_mtime > _PRUNE_AFTER_S:
                f.unlink()
                names_path(f).unlink(missing_ok=True)


def stage_cases_file(stage: str, size: str | None = None) -> str:
    """Path of a ``torch.save``-d ``stage_cases(stage, size)`` for ``worker_child --cases``
    (``size`` None: :func:`selected_case_size`, i.e. ``DSV4_CASES``, default ``"default"``).

    Built at most once per process and, with the persistent cache (:func:`cases_cache_dir`),
    once per machine for a given key (:func:`cases_key`): a file that fails to load is rebuilt.
    An unwritable cache folder falls back to a temporary folder of this process. Raises
    ``KeyError`` for a stage without default cases (as ``default_cases`` does)."""
    size = selected_case_size() if size is None else size
    cache = cases_cache_dir()
    key = cases_key(stage, size)
    memo = (stage, key, str(cache))
    if memo in CASES_FILES and Path(CASES_FILES[memo]).is_file():
        return CASES_FILES[memo]
    stem = "".join(ch if ch.isalnum() or ch in "_-" else "_" for ch in stage) + ("" if size == "default" else f"_{size}")
    name = f"{stem}-{key}.pt"
    path = None
    if cache is not None:
        path = cache / name
        if not _valid(path):
            try:
                build_cases_file(stage, path, size)
            except OSError:  # read-only home, full disk, ...: this process only
                path = None
            else:
                _prune(cache, name.rsplit("-", 1)[0], keep=path)
    if path is None:
        path = _session_dir() / name
        if not path.is_file():
            build_cases_file(stage, path, size)
    CASES_FILES[memo] = str(path)
    return str(path)


def load_cases(path: str | Path) -> list:
    """The list of ``Case`` saved in ``path`` (:func:`stage_cases_file`)."""
    import torch

    return list(torch.load(path, weights_only=False))


def case_names(stage: str, size: str | None = None) -> list[str]:
    """The names of ``stage``'s cases, in order, as :func:`stage_cases_file` holds them (``size``
    as there): read from the file's sidecar, so pytest's collection in every xdist worker loads no
    tensors; a file without a valid sidecar is loaded."""
    path = stage_cases_file(stage, size)
    names = _read_names(Path(path))
    return names if names is not None else [c.name for c in load_cases(path)]


def grouped_stage(stage: str) -> bool:
    """Whether :func:`case_groups` splits ``stage``'s cases (the attention stages)."""
    from dsv4_numerics.oracles.stages import FAST_ORACLE_STAGES

    return stage in FAST_ORACLE_STAGES


def case_groups(stage: str, names: list[str], size: int) -> list[list[str]]:
    """``names`` (a stage's cases, in order) cut into runs of at most ``size`` cases for the
    attention stages (``oracles.stages.FAST_ORACLE_STAGES``: the slowest to judge, and kernels
    that autotune per shape), each run one isolated job, so one slow entry spreads over several
    children or workers (the pytest matrix, ``check``). Other stages, or ``size < 1``: one run."""
    if not grouped_stage(stage) or size < 1:
        return [list(names)]
    return [list(names[i:i + size]) for i in range(0, len(names), size)] or [[]]
