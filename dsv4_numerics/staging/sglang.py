"""``dsv4-numerics stage-sglang``: stage SGLang 0.5.23's DeepSeek-V4 kernel sources into ONE
folder, out of the user's own SGLang wheel, without installing SGLang.

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
    wheel_identity,
    write_copy,
    write_package_markers,
    write_standins,
)

VERSION = "0.5.23"
PART = "sglang"
DSV4 = "sglang/kernels/ops/attention/dsv4/"
JIT = "sglang/kernels/jit/"

# Files an entry needs: staging fails (one line) if the wheel lacks one.
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


_PKG = '"""Stand-in package marker (the real package imports the SGLang engine)."""'

STANDINS = {
    "sglang/__init__.py": '''
        """Stand-in for sglang/__init__.py: a bare namespace (the real one imports the frontend language and engine)."""
        __version__ = "0.5.23"
    ''',
    "sglang/kernels/__init__.py": '''
        """Stand-in for sglang.kernels: a bare namespace (the real one imports every operator group)."""
    ''',
    "sglang/kernels/ops/__init__.py": '''
        """Stand-in for sglang.kernels.ops: a bare namespace (the real one imports all 20 operator groups)."""
    ''',
    "sglang/kernels/ops/attention/__init__.py": '''
        """Stand-in for sglang.kernels.ops.attention: a bare namespace (the real one registers every attention backend)."""
    ''',
    "sglang/kernels/ops/attention/dsa/__init__.py": '''
        """Stand-in for sglang.kernels.ops.attention.dsa: a bare namespace (the real one imports the DSA indexer's
        paged-MQA-logits kernels, DeepGEMM and CuTe-DSL); only tilelang_kernel.py is staged from it."""
    ''',
    "sglang/kernels/ops/kvcache/__init__.py": '''
        """Stand-in for sglang.kernels.ops.kvcache: a bare namespace (the real one registers every KV-cache kernel)."""
    ''',
    "sglang/kernels/ops/quantization/__init__.py": _PKG,
    "sglang/kernels/ops/quantization/fp8_kernel.py": '''
        """Stand-in: is_fp8_fnuz() is False (NVIDIA, OCP E4M3FN), as the real one answers off gfx942."""
        import torch


        def is_fp8_fnuz() -> bool:
            return False


        fp8_dtype = torch.float8_e4m3fn
    ''',
    "sglang/srt/__init__.py": _PKG,
    "sglang/srt/utils/__init__.py": '''
        """Stand-in for sglang.srt.utils: the platform predicates the staged kernels import (NVIDIA CUDA)."""
        from sglang.srt.utils.common import *  # noqa: F401,F403
        from sglang.srt.utils.common import __all__  # noqa: F401
    ''',
    "sglang/srt/utils/common.py": '''
        """Stand-in for sglang.srt.utils.common (177 kB, imports the engine): NVIDIA CUDA platform predicates only."""
        import torch

        __all__ = ["ceil_align", "ceil_div", "is_hip", "is_xpu", "is_cuda", "is_npu", "is_gfx95_supported",
                   "is_gfx942_supported", "is_gfx1250_supported", "get_cuda_version", "async_h2d"]


        def ceil_div(a: int, b: int) -> int:
            return -(-a // b)


        def ceil_align(x: int, alignment: int) -> int:
            return ceil_div(x, alignment) * alignment


        def is_hip() -> bool:
            return torch.version.hip is not None


        def is_cuda() -> bool:
            return torch.version.cuda is not None


        def is_xpu() -> bool:
            return False


        def is_npu() -> bool:
            return False


        def is_gfx95_supported() -> bool:
            return False


        def is_gfx942_supported() -> bool:
            return False


        def is_gfx1250_supported() -> bool:
            return False


        def get_cuda_version():
            v = torch.version.cuda or "0.0"
            return tuple(int(x) for x in v.split(".")[:2])


        def async_h2d(*args, **kwargs):
            raise RuntimeError("sglang.srt.utils.common.async_h2d is SGLang engine machinery: "
                               "not available in a staged kernel folder")
    ''',
    "sglang/srt/layers/__init__.py": _PKG,
    "sglang/srt/layers/attention/__init__.py": _PKG,
    "sglang/srt/layers/attention/dsa/__init__.py": _PKG,
    "sglang/srt/layers/attention/dsa/utils.py": '''
        """Stand-in: the two DSA indexer names dsv4/compress.py imports (aiter preshuffle is ROCm-only: False)."""
        INDEXER_K_CACHE_PRESHUFFLE_TILE = 16


        def aiter_can_use_preshuffle_paged_mqa() -> bool:
            return False
    ''',
    "fallback/msgspec/__init__.py": '''
        """Stand-in for msgspec, used only where msgspec is not installed (DIR/fallback comes last on sys.path): Struct, json, DecodeError."""
        import json as _json
        import types as _types


        class DecodeError(ValueError):
            pass


        def _fields(cls):
            ann = {}
            for c in reversed(cls.__mro__):
                ann.update(vars(c).get("__annotations__", {}))
            return tuple(k for k, v in ann.items() if not str(v).startswith(("ClassVar", "typing.ClassVar")))


        class Struct:
            """Record class: fields from annotations (ClassVar excluded), class attributes as defaults,
            positional or keyword construction, frozen=True forbids assignment, array_like=True
            encodes as a JSON list."""

            __struct_fields__ = ()

            def __init_subclass__(cls, frozen=False, array_like=False, **options):
                super().__init_subclass__()
                cls.__struct_fields__ = _fields(cls)
                cls.__struct_frozen__ = frozen
                cls.__struct_array_like__ = array_like
                cls.__struct_defaults__ = {k: vars(c)[k] for c in reversed(cls.__mro__) for k in cls.__struct_fields__
                                          if k in vars(c)}

            def __init__(self, *args, **kwargs):
                names = self.__struct_fields__
                if len(args) > len(names):
                    raise TypeError(f"{type(self).__name__} takes at most {len(names)} positional arguments")
                vals = dict(self.__struct_defaults__)
                vals.update(zip(names, args))
                vals.update(kwargs)
                missing = [n for n in names if n not in vals]
                if missing:
                    raise TypeError(f"{type(self).__name__} missing required argument(s) {missing}")
                for n in names:
                    object.__setattr__(self, n, vals[n])

            def __setattr__(self, name, value):
                if getattr(type(self), "__struct_frozen__", False):
                    raise AttributeError(f"immutable type: {type(self).__name__}")
                object.__setattr__(self, name, value)

            def _astuple(self):
                return tuple(getattr(self, n) for n in self.__struct_fields__)

            def __eq__(self, other):
                return type(self) is type(other) and self._astuple() == other._astuple()

            def __hash__(self):
                return hash((type(self), self._astuple()))

            def __repr__(self):
                return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n in self.__struct_fields__)})"


        def _plain(obj):
            if isinstance(obj, Struct):
                if obj.__struct_array_like__:
                    return [_plain(v) for v in obj._astuple()]
                return {n: _plain(getattr(obj, n)) for n in obj.__struct_fields__}
            if isinstance(obj, (list, tuple)):
                return [_plain(v) for v in obj]
            return obj


        def _build(tp, data):
            args = getattr(tp, "__args__", None)
            if args and isinstance(data, list):
                return [_build(args[0], d) for d in data]
            if isinstance(tp, type) and issubclass(tp, Struct):
                return tp(*data) if isinstance(data, list) else tp(**data)
            return data


        def _encode(obj):
            return _json.dumps(_plain(obj), separators=(",", ":")).encode()


        def _decode(raw, type=None):
            try:
                data = _json.loads(raw)
                return data if type is None else _build(type, data)
            except (ValueError, TypeError) as e:
                raise DecodeError(str(e)) from None


        json = _types.SimpleNamespace(encode=_encode, decode=_decode)
    ''',
    "sglang/utils.py": '''
        """Stand-in for sglang.utils: only is_in_ci() (the JIT test-range helper asks it)."""


        def is_in_ci() -> bool:
            return False
    ''',
}


def check_wheel(wheel: Path) -> str:
    """The wheel's version after checking it is an ``sglang`` VERSION wheel."""
    dist, version = wheel_identity(wheel)
    if dist != "sglang":
        raise StagingError(f"--wheel {Path(wheel).name}: not an SGLang wheel (stage-sglang takes sglang-{VERSION}-*.whl)")
    if version != VERSION:
        raise StagingError(f"--wheel {Path(wheel).name}: SGLang {version}; the sglang entries are written for "
                           f"SGLang {VERSION}")
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
    manifest = open_manifest(dest, "sglang_version", VERSION, "SGLang")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        have = set(names)
        missing = [r for r in REQUIRED if r not in have]
        if missing:
            raise StagingError(f"{missing[0]} is not in {wheel.name} (is it SGLang {VERSION}?)"
                               + (f"; {len(missing) - 1} more missing" if len(missing) > 1 else ""))
        dest.mkdir(parents=True, exist_ok=True)
        files = manifest["files"]
        for rel in sorted(n for n in names if is_copied(n)):
            write_copy(dest, rel, zf.read(rel), PART, files)
    write_standins(dest, PART, STANDINS, files)
    write_package_markers(dest, "sglang", files, "stage-sglang")
    manifest["sglang_version"] = version
    manifest.setdefault("part_versions", {})[PART] = f"sglang {version}"
    finish_manifest(dest, manifest, [PART], wheel, log)
    return manifest


def add_arguments(p) -> None:
    """The ``stage-sglang`` sub-command's arguments (called by ``cli.stage.add_parser``)."""
    p.add_argument("dest", metavar="DEST", help="folder to stage into (created; may already hold stage-vllm parts)")
    p.add_argument("--wheel", metavar="PATH", required=True, help=f"a local sglang-{VERSION} wheel")


def run(args, log=print) -> int:
    """Carry out a parsed ``stage-sglang`` request; raises StagingError for bad input."""
    stage(Path(args.dest), Path(args.wheel), log=log)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m dsv4_numerics.staging.sglang`` (the same as ``dsv4-numerics stage-sglang``)."""
    return command_main("stage-sglang", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
