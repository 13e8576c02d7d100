"""dsv4-numerics: a reference-first numerics and correctness suite for DeepSeek-V4 sparse attention.

Start here. This top-level package is the front door: the public API and the command line.

For kernel authors (judge your own kernel, from your own repository and CI)::

    import dsv4_numerics as dn

    dn.cases("swa_write")                          # the canonical cases of a stage
    dn.judge(my_writer, "swa_write")               # -> list[Result], same runner as the matrix
    dn.assert_matches_reference(my_writer, "swa_write")   # AssertionError explaining the diff
    dn.explain(my_writer, "swa_write")             # which declared policy set the kernel matches
    dn.compare_writers(my_writer, "vllm_cuda.swa_quant_insert")   # byte diffs against another engine's writer
    dn.read_foreign(my_writer, "flashmla.sparse_decode.sm90")     # a reader judged on my writer's caches

The public API lives in :mod:`dsv4_numerics.api.testing` (re-exported here, imported lazily so that
``import dsv4_numerics.reference`` stays light); hypothesis strategies in
:mod:`dsv4_numerics.strategies`; the pytest plugin (registered through ``pytest11``) in
:mod:`dsv4_numerics.plugin.hooks`; the ``dsv4-numerics`` command in :mod:`dsv4_numerics.cli`.

The layers, each importing only the ones above it:

==========================  =====================================================================
``dsv4_numerics.reference`` the bit-exact model: codecs, cache layouts, index plumbing, fp64 attention
``dsv4_numerics.oracles``   how a kernel is judged: decoded diffs, comparators, tolerance records, runner
``dsv4_numerics.kernels``   one registry entry per production kernel: probe + canonical call
``dsv4_numerics.fixtures``  golden fixtures: manifest, deterministic safetensors store, regen/verify
``dsv4_numerics`` (this)    the application, one sub-package a job (below)
==========================  =====================================================================

The application's folders: ``api/`` (the public API), ``strategies/`` (hypothesis strategies),
``runner/`` (crash-isolated kernel children, their pool, ``check``), ``plugin/`` (pytest),
``report/`` (merge, diff, page), ``staging/`` (production kernels without their engines),
``inspect/`` (KV-cache dumps), ``bench/`` (benchmarks) and ``cli/`` (one module per command).
"""

from __future__ import annotations

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("dsv4-numerics")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
    __version__ = "0+unknown"

# name -> module that defines it; resolved on first attribute access (PEP 562)
_LAZY = {
    "cases": "dsv4_numerics.api.testing",
    "judge": "dsv4_numerics.api.testing",
    "assert_matches_reference": "dsv4_numerics.api.testing",
    "explain": "dsv4_numerics.api.testing",
    "compare_writers": "dsv4_numerics.api.cross_engine",
    "read_foreign": "dsv4_numerics.api.cross_engine",
    "stages": "dsv4_numerics.api.testing",
    "Result": "dsv4_numerics.oracles.report",
    "KernelEntry": "dsv4_numerics.kernels.registry",
    "Case": "dsv4_numerics.reference.cases",
    "repro": "dsv4_numerics.repro",  # the package (a callable module: dn.repro(kernel, stage, ...))
}

__all__ = ["__version__", *_LAZY]


# Module names of the public API before the application was split into sub-packages: importing
# one gives the module object of its new home (the same object, so monkeypatching either works).
_MODULE_ALIASES = {
    "dsv4_numerics.testing": "dsv4_numerics.api.testing",
    "dsv4_numerics.cross_engine_api": "dsv4_numerics.api.cross_engine",
    "dsv4_numerics.external": "dsv4_numerics.api.external",
    "dsv4_numerics.pytest_plugin": "dsv4_numerics.plugin.hooks",
    "dsv4_numerics.strategies_attention": "dsv4_numerics.strategies.attention",
    "dsv4_numerics.strategies_index": "dsv4_numerics.strategies.index",
    "dsv4_numerics.strategies_v41": "dsv4_numerics.strategies.v41",
}


class _AliasFinder:
    """A ``sys.meta_path`` finder that answers an old module name with its new module."""

    class _Loader:
        def __init__(self, target: str):
            self.target = target

        def create_module(self, spec):
            import importlib

            return importlib.import_module(self.target)

        def exec_module(self, module) -> None:  # the target module is already executed
            pass

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        new = _MODULE_ALIASES.get(fullname)
        if new is None:
            return None
        from importlib.machinery import ModuleSpec

        return ModuleSpec(fullname, cls._Loader(new))


import sys as _sys  # noqa: E402

if not any(getattr(f, "__name__", "") == "_AliasFinder" for f in _sys.meta_path):
    _sys.meta_path.append(_AliasFinder)


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'dsv4_numerics' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
