"""``dsv4-numerics stage-sglang``: stage SGLang's DeepSeek-V4 kernel sources (0.5.23's file layout;
any release, one per folder) into ONE folder, out of the user's own SGLang wheel, without
installing SGLang.

SGLang ships its DSv4 pipeline as plain sources: Triton kernels under
``sglang/kernels/ops/attention/dsv4/`` and ``sglang/kernels/ops/kvcache/dsv4_*.py``, and JIT-CUDA
kernels compiled on first use from ``sglang/kernels/jit/`` (Python loaders plus ``csrc/`` and
``include/`` sources). The wheel is tagged cp311 but none of these files is compiled, so they run
under the GPU machine's Python. This command copies them, unchanged, into ``DEST/sglang/...``
(wheel-relative paths) and writes small stand-ins for the heavy SGLang modules they import (the
package roots, which import the whole engine; ``sglang.srt.utils``; ``is_fp8_fnuz``; the DSA
indexer helpers). Stand-ins describe an NVIDIA GPU with OCP FP8 and raise if an engine-only name
is used. ``DEST/fallback/msgspec`` stands in for the ``msgspec`` dependency the JIT loaders import
(``Struct``, ``json``); activation puts ``fallback/`` last on ``sys.path``, so an installed
msgspec wins.

Staging is additive and shares ``DEST`` with ``stage-vllm``: the same ``MANIFEST.json`` gains
the part ``sglang``, ``sglang_version`` and ``part_versions["sglang"]``, so one ``DSV4_STAGED``
folder serves both engines (``kernels/staged.py`` activates it the same way).

What is copied (``COPY_RULES``): the whole ``dsv4/`` folder except the HIP code objects under
``dsv4/asm/`` (gfx950 binaries, useless on NVIDIA), the ``kvcache/dsv4_*.py`` stores, every
``*.py`` of ``sglang/kernels/jit/`` and all of its ``csrc/`` and ``include/`` trees, and the light
modules those import (``sglang/srt/environ.py``, standard library only; the ``sglang.kernels``
registry modules the JIT loaders import lazily).
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path

from dsv4_numerics.staging.vllm import (
    StagingError,
    command_main,
    finish_manifest,
    open_manifest,
    resolve_imports,
    standins,
    wheel_identity,
    write_copy,
    write_package_markers,
    write_standins,
)

VERSION = "0.5.23"
PART = "sglang"
DSV4 = "sglang/kernels/ops/attention/dsv4/"
JIT = "sglang/kernels/jit/"

# Files an entry needs: a release lacking one stages what it has and records it under ``missing``
# in MANIFEST.json (the entries calling it are unavailable with that reason).
REQUIRED = (
    DSV4 + "__init__.py",
    DSV4 + "kv_layout.py",
    DSV4 + "dequant_k_cache.py",
    DSV4 + "kv_norm_rope_store.py",
    DSV4 + "sparse_prefill_kernels.py",
    DSV4 + "unified_kv_kernels/paged_decode_indices.py",
    DSV4 + "unified_kv_kernels/paged_decode.py",
    DSV4 + "unified_kv_kernels/paged_prefill.py",
    DSV4 + "triton_sparse_decode/__init__.py",
    DSV4 + "triton_sparse_decode/triton_mla_kernels_decode_optimized.py",
    DSV4 + "triton_sparse_decode/triton_mla_kernels_decode_fused.py",
    "sglang/kernels/ops/kvcache/dsv4_main_kv_store.py",
    JIT + "utils/__init__.py",
    "sglang/srt/environ.py",
)

# Single light modules copied as they are (imported by the copies above).
EXTRA_COPIES = (
    "sglang/srt/environ.py",
    "sglang/kernels/spec.py",
    "sglang/kernels/registry.py",
    "sglang/kernels/selector.py",
    "sglang/kernels/kernel_api_logging.py",
    "sglang/kernels/fused_op.py",
    "sglang/kernels/ops/attention/dsa/tilelang_kernel.py",  # the TileLang decode's shared helpers
)

# Real __init__ files that would import the engine: replaced by stand-ins, never copied.
_REPLACED = {"sglang/__init__.py", "sglang/kernels/__init__.py", "sglang/kernels/ops/__init__.py",
             "sglang/kernels/ops/attention/__init__.py", "sglang/kernels/ops/kvcache/__init__.py",
             "sglang/kernels/ops/attention/dsa/__init__.py"}


def is_copied(rel: str) -> bool:
    """Whether the wheel member ``rel`` belongs to the staged SGLang part (see the module docstring)."""
    if rel.endswith("/") or rel in _REPLACED or "/__pycache__/" in rel:
        return False
    if rel.startswith(DSV4):
        return not rel.startswith(DSV4 + "asm/")
    if rel.startswith("sglang/kernels/ops/kvcache/"):
        name = rel.rsplit("/", 1)[1]
        return "/" not in rel[len("sglang/kernels/ops/kvcache/"):] and name.startswith("dsv4_") and name.endswith(".py")
    if rel.startswith(JIT):
        return rel.endswith(".py") or rel.startswith((JIT + "csrc/", JIT + "include/"))
    return rel in EXTRA_COPIES


# The stand-ins: real source files under staging/standins/sglang/ (package data, never imported).
STANDINS = standins("sglang")
# Stand-ins written only for a release whose files import the module at import time and whose own
# module would import the engine (staging/standins/sglang_releases/).
RELEASE_STANDINS = standins("sglang_releases")


def check_wheel(wheel: Path) -> str:
    """The wheel's version after checking it is an ``sglang`` wheel (any release: the sglang
    entries declare the releases they are written for)."""
    dist, version = wheel_identity(wheel)
    if dist != "sglang":
        raise StagingError(f"--wheel {Path(wheel).name}: not an SGLang wheel (stage-sglang takes sglang-X-*.whl)")
    return version


def stage(dest: Path, wheel: Path, log=print) -> dict:
    """Stage SGLang's DSv4 kernel sources from ``wheel`` into ``dest`` (additive, next to any
    vLLM parts) and return the manifest written."""
    dest = Path(dest)
    wheel = Path(wheel)
    if not wheel.is_file():
        raise StagingError(f"--wheel {wheel}: no such file")
    if not zipfile.is_zipfile(wheel):
        raise StagingError(f"--wheel {wheel}: not a wheel (not a zip archive)")
    version = check_wheel(wheel)
    manifest = open_manifest(dest, "sglang_version", version, "SGLang")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        have = set(names)
        missing = [r for r in REQUIRED if r not in have]
        if missing:  # an older layout: stage what it has; the entries calling a missing file are unavailable
            manifest.setdefault("missing", {}).update({r: f"sglang {version} does not ship {r}" for r in missing})
            log(f"sglang {version}: {len(missing)} of the files the sglang entries call are not in {wheel.name} "
                "(recorded under 'missing' in MANIFEST.json)")
        dest.mkdir(parents=True, exist_ok=True)
        files = manifest["files"]
        for rel in sorted(n for n in names if is_copied(n)):
            write_copy(dest, rel, zf.read(rel), PART, files)
    write_standins(dest, PART, STANDINS, files)
    with zipfile.ZipFile(wheel) as zf:  # an older release's files may import modules 0.5.23's do not
        resolve_imports(dest, zf, version, manifest, log, top="sglang", op_files=frozenset(REQUIRED),
                        release_standins=RELEASE_STANDINS, roots=list(REQUIRED))
    write_package_markers(dest, "sglang", files, "stage-sglang")
    manifest["sglang_version"] = version
    manifest.setdefault("part_versions", {})[PART] = f"sglang {version}"
    finish_manifest(dest, manifest, [PART], wheel, log)
    return manifest


def add_arguments(p) -> None:
    """The ``stage-sglang`` sub-command's arguments (called by ``cli.stage.add_parser``)."""
    p.add_argument("dest", metavar="DEST", help="folder to stage into (created; may already hold stage-vllm parts)")
    p.add_argument("--wheel", metavar="PATH", required=True, help=f"a local sglang-X wheel (any release, one per "
                                                                   f"DEST; the entries are written for {VERSION})")


def run(args, log=print) -> int:
    """Carry out a parsed ``stage-sglang`` request; raises StagingError for bad input."""
    stage(Path(args.dest), Path(args.wheel), log=log)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m dsv4_numerics.staging.sglang`` (the same as ``dsv4-numerics stage-sglang``)."""
    return command_main("stage-sglang", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
