"""Case files: a stage's cases built once, saved as one safetensors file (tensors) with a JSON
skeleton (everything else), and handed to every kernel child
(``python -m dsv4_numerics.runner.child --cases FILE``), so no child rebuilds them.

:func:`stage_cases_file` builds ``stage_cases(stage, size)`` at most once per process and, with the
persistent cache, once per machine: the file's name carries a key (:func:`cases_key`) over the
package version, the torch version, the stage and the bytes of the ``reference`` sources that
build the cases; a file that does not load is rebuilt; files of older keys are pruned once an
hour old. Beside each file, written after it, a small JSON sidecar holds its case names and byte
count (:func:`case_names`: what pytest's collection needs in every xdist worker, without loading
every stage's tensors; a file whose size matches its sidecar and whose header is a case file's is
taken as complete). The cache is shared by concurrent processes (xdist workers, ``check``): files
are written atomically.

Nothing read back is unpickled: the cache folder may be restored from a cache shared between
branches or machines, so a file there is data to parse (``fixtures.store.decode_value``: a strict
safetensors parser and ``json``), never code to run. A file that is not a case file of this
format is rebuilt (the cache) or refused with an ``InputError`` naming it (:func:`load_cases`).
The kernel children's outputs (``raw`` mode, :func:`write_outputs` / :func:`load_outputs`) use
the same format.

Format: ``fixtures.store.encode_value`` of ``[{"name", "stage", "inputs", "params"}, ...]`` (one
dict a case), ``__metadata__["format"]`` = :data:`CASES_FORMAT`. What a case may hold: tensors
(any dtype of ``fixtures.store``; a non-contiguous one keeps its size and stride), ints, floats
(non-finite included), strings, ``None``, lists, tuples, str-keyed dicts, torch dtypes; anything
else is an ``InputError`` naming the case and the path of the value. Two inputs that share
storage are stored, and read back, as two tensors (as ``Case.to(device)`` makes them on a GPU).

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
    small tensor operations: on a loaded host, OpenMP threads spin against other processes, so
    one thread builds them faster than several."""
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


CASES_SUFFIX = ".safetensors"
CASES_FORMAT = "dsv4-numerics-cases"
OUTPUTS_FORMAT = "dsv4-numerics-outputs"
FORMAT_VERSION = "1"
_CASE_FIELDS = ("name", "stage", "inputs", "params")


def names_path(path: Path) -> Path:
    """The sidecar of case file ``NAME.safetensors``: ``NAME.names.json``."""
    return path.with_name(path.name.removesuffix(CASES_SUFFIX) + ".names.json")


def _write_names(path: Path, cases: list) -> None:
    """The sidecar of ``path`` (written after it): its cases' names and its byte count."""
    doc = {"names": [c.name for c in cases], "bytes": path.stat().st_size}
    from dsv4_numerics.fixtures.store import atomic_write_bytes

    atomic_write_bytes(names_path(path), json.dumps(doc).encode())


def read_names(path: Path) -> list[str] | None:
    """The case names of ``path`` from its sidecar, or None: no sidecar, an unreadable one, or
    one whose byte count is not the file's (a file changed or cut after it was written)."""
    try:
        doc = json.loads(names_path(path).read_text())
        if doc["bytes"] == path.stat().st_size and all(isinstance(n, str) for n in doc["names"]):
            return list(doc["names"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _encode(value, fmt: str, what: str) -> bytes:
    from dsv4_numerics.fixtures.store import encode_value
    from dsv4_numerics.reference.errors import InputError

    try:
        return encode_value(value, {"format": fmt, "version": FORMAT_VERSION})
    except InputError as e:
        raise InputError(f"{what}: {e}") from None


def _decode(path: str | Path, fmt: str):
    """The value of file ``path`` of format ``fmt``; InputError naming the file for anything else."""
    from dsv4_numerics.fixtures.store import decode_value, read_bytes
    from dsv4_numerics.reference.errors import InputError

    source = f"{fmt} file {path}"
    try:
        value, meta = decode_value(read_bytes(path, f"{fmt} file"), source)
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 - a malformed skeleton: a clear error, never a traceback
        raise InputError(f"{source}: not a readable {fmt} file ({type(e).__name__}: {e})") from None
    if meta.get("format") != fmt or meta.get("version") != FORMAT_VERSION:
        raise InputError(f"{source}: format {meta.get('format')!r} version {meta.get('version')!r}, "
                         f"expected {fmt!r} version {FORMAT_VERSION!r}")
    return value


def encode_cases(cases: list) -> bytes:
    """The case-file bytes of ``cases`` (a list of ``reference.cases.Case``; module docstring).
    Raises InputError naming the case and the path of a value the format cannot hold."""
    from dsv4_numerics.fixtures.store import flatten_value
    from dsv4_numerics.reference.errors import InputError

    parts = []
    for c in cases:
        part = {"name": c.name, "stage": c.stage, "inputs": c.inputs, "params": c.params}
        try:  # each case on its own first (no copy), so an error names the case
            flatten_value(part)
        except InputError as e:
            raise InputError(f"case {c.name!r} of stage {c.stage!r}: {e}") from None
        parts.append(part)
    return _encode(parts, CASES_FORMAT, "case file")


def save_cases(cases: list, path: str | Path) -> None:
    """Write the list of ``Case`` to ``path`` atomically (:func:`encode_cases`; a temporary file in
    the same folder, then ``os.replace``), then its names sidecar: the file :func:`load_cases`
    reads and a kernel child takes as ``--cases``."""
    from dsv4_numerics.fixtures.store import atomic_write_bytes

    path = Path(path)
    atomic_write_bytes(path, encode_cases(cases))
    _write_names(path, cases)


def load_cases(path: str | Path) -> list:
    """The list of ``Case`` in case file ``path`` (:func:`save_cases`, :func:`stage_cases_file`).
    Raises InputError naming the file when it is not one (never unpickles anything)."""
    from dsv4_numerics.reference.cases import Case
    from dsv4_numerics.reference.errors import InputError

    value = _decode(path, CASES_FORMAT)
    ok = isinstance(value, list) and all(
        isinstance(d, dict) and set(d) == set(_CASE_FIELDS) and isinstance(d["name"], str)
        and isinstance(d["stage"], str) and isinstance(d["inputs"], dict) and isinstance(d["params"], dict)
        for d in value)
    if not ok:
        raise InputError(f"{CASES_FORMAT} file {path}: not a list of cases ({', '.join(_CASE_FIELDS)})")
    return [Case(d["name"], d["stage"], d["inputs"], d["params"]) for d in value]


def write_outputs(path: str | Path, outputs: dict) -> None:
    """Write a kernel child's outputs (``{name: tensor or plain value}``, CPU) to ``path``
    atomically, in the case files' format (:data:`OUTPUTS_FORMAT`)."""
    from dsv4_numerics.fixtures.store import atomic_write_bytes

    atomic_write_bytes(path, _encode(dict(outputs), OUTPUTS_FORMAT, f"outputs file {path}"))


def load_outputs(path: str | Path) -> dict:
    """The outputs dict :func:`write_outputs` wrote to ``path``; InputError naming the file for
    anything else."""
    from dsv4_numerics.reference.errors import InputError

    value = _decode(path, OUTPUTS_FORMAT)
    if not isinstance(value, dict):
        raise InputError(f"{OUTPUTS_FORMAT} file {path}: not a dict of outputs")
    return value


def build_cases_file(stage: str, path: str | Path, size: str = "default") -> list:
    """Build ``stage_cases(stage, size)`` (one torch thread) and write it to ``path``
    (:func:`save_cases`); returns the cases."""
    from dsv4_numerics.reference.cases import stage_cases

    with _torch_threads(1):
        cases = stage_cases(stage, size)
    save_cases(cases, path)
    return cases


def _is_case_file(path: Path) -> bool:
    """Whether ``path``'s header (read alone, no tensors) is a case file's of this format and the
    file is as long as the header says (not cut short)."""
    from dsv4_numerics.fixtures.store import read_header

    try:
        header, base = read_header(path)
        meta = header.get("__metadata__") or {}
        end = max([int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"], default=0)
        return (meta.get("format") == CASES_FORMAT and meta.get("version") == FORMAT_VERSION
                and path.stat().st_size == base + end)
    except Exception:  # noqa: BLE001 - anything unreadable is not a case file
        return False


def _valid(path: Path) -> bool:
    """Whether ``path`` is a complete case file: its header is a case file's and its sidecar's
    byte count matches, or (no valid sidecar: one cut short or lost) it loads, and then gets its
    sidecar. Anything else (a foreign or planted file) is not valid: the caller rebuilds it."""
    from dsv4_numerics.reference.errors import InputError

    if not path.is_file():
        return False
    if read_names(path) is not None and _is_case_file(path):
        return True
    try:
        cases = load_cases(path)
    except InputError:  # a truncated or foreign file: rebuild it
        return False
    with contextlib.suppress(OSError):
        _write_names(path, cases)
    return True


_PRUNE_AFTER_S = 3600.0


def _prune(cache: Path, stem: str, keep: Path) -> None:
    """Remove the files of other keys of the same stage (older sources or versions) once they
    are an hour old (a concurrent run of another checkout may still be handing one out)."""
    now = time.time()
    # ".pt": the files of an older release, never read (they were pickles)
    for f in [*cache.glob(f"{stem}-{'?' * _KEY_LEN}{CASES_SUFFIX}"), *cache.glob(f"{stem}-{'?' * _KEY_LEN}.pt")]:
        with contextlib.suppress(OSError):
            if f != keep and now - f.stat().st_mtime > _PRUNE_AFTER_S:
                f.unlink()
                f.with_name(f.name.removesuffix(f.suffix) + ".names.json").unlink(missing_ok=True)


def stage_cases_file(stage: str, size: str | None = None) -> str:
    """Path of a case file (:func:`save_cases`) of ``stage_cases(stage, size)`` for ``worker_child --cases``
    (``size`` None: :func:`selected_case_size`, i.e. ``DSV4_CASES``, default ``"default"``).

    Built at most once per process and, with the persistent cache (:func:`cases_cache_dir`),
    once per machine for a given key (:func:`cases_key`): a file that is not a complete case file
    (cut short, foreign, planted) is rebuilt, never executed.
    An unwritable cache folder falls back to a temporary folder of this process. Raises
    ``KeyError`` for a stage without default cases (as ``default_cases`` does)."""
    size = selected_case_size() if size is None else size
    cache = cases_cache_dir()
    key = cases_key(stage, size)
    memo = (stage, key, str(cache))
    if memo in CASES_FILES and Path(CASES_FILES[memo]).is_file():
        return CASES_FILES[memo]
    stem = "".join(ch if ch.isalnum() or ch in "_-" else "_" for ch in stage) + ("" if size == "default" else f"_{size}")
    name = f"{stem}-{key}{CASES_SUFFIX}"
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


def case_names(stage: str, size: str | None = None) -> list[str]:
    """The names of ``stage``'s cases, in order, as :func:`stage_cases_file` holds them (``size``
    as there): read from the file's sidecar, so pytest's collection in every xdist worker loads no
    tensors; a file without a valid sidecar is loaded."""
    path = stage_cases_file(stage, size)
    names = read_names(Path(path))
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
