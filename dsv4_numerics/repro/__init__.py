"""Minimal, standalone reproducers of a kernel's divergence from the reference.

``dsv4-numerics repro ENTRY [--case NAME] [--contract [KEYS]] --out DIR [--force]``, the Python
call ``dsv4_numerics.repro(kernel, stage, case=..., out=...)`` and the pytest option
``--dsv4-repro DIR`` write one folder per failing case:

``repro.py``            imports torch and the production package (or loads its library with
                        ``torch.ops.load_library``, as the package itself does) and nothing of this
                        suite; calls the op with the exact arguments the adapter passes; compares
                        with the oracle's outputs under the judge's tolerance (bit for bit for
                        bytes and indices); prints each differing element decoded; exits 1 while
                        the divergence is present, 0 when it is not (3: the op cannot be loaded)
``inputs.safetensors``  the op's arguments, the expected outputs in the op's own form, the masks of
                        the elements the judge compares (``geometry.json``: sizes and strides)
``ISSUE.md``            the bug report (``issue``); ``report.json`` the figures below

Before writing, the failing case is shrunk (``shrink``) while the same output still fails by the
same rule -- and, for a contract reproducer, still passes under the kernel's declared policies,
so the reduced case shows that one departure. The sizes before and after are reported.

The op is called through the adapter's own boundary (``kernels.op_call``: ``OP_CALLS`` of the
adapter module), the same code the judge calls, so the two cannot drift apart.

Modules: ``judge`` (one case under one policy set; the contract policy sets), ``shrink``,
``write`` (the files; the script is ``templates/repro_op.py`` with its call block filled in),
``issue`` (ISSUE.md), ``job`` (the job: ``make``).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from .job import NothingToReproduce, Reproducer, Unavailable, make


def repro(kernel: Any, stage: str, *, case: Any = None, out: Any = None, contract: str | None = None,
          force: bool = False, device: str | None = None, run: bool = True) -> Reproducer:
    """Write a reproducer of ``kernel``'s failure on ``stage`` into ``out``.

    kernel:   a plain callable ``fn(inputs) -> dict`` importable by its dotted path (the script
              imports it), or a registry ``KernelEntry``
    case:     a case name of the stage (default or full set) or a ``Case``; default: the first
              default case that fails
    contract: None (the kernel's declared policies), ``"all"`` (every declared departure reset to
              the stage default) or ``"KEY[=VALUE],..."``
    force:    replace ``out`` when it exists (else ``InputError``)
    run:      run the written script here and keep its output in ISSUE.md
    Raises ``NothingToReproduce`` (an ``InputError``) when the case passes.
    """
    return make(kernel, stage, case=case, out=out, contract=contract, force=force, device=device, run=run)


def repro_entry(name: str, *, case: Any = None, out: Any = None, contract: str | None = None, force: bool = False,
                device: str | None = None, run: bool = True, log=lambda s: None) -> Reproducer:
    """``repro`` for the registry entry called ``name`` (close matches named when unknown;
    ``Unavailable`` with the probe's reason when it cannot run here)."""
    from dsv4_numerics.kernels import registry

    entry = registry.get(name)
    return make(entry, entry.stage, case=case, out=out, contract=contract, force=force, device=device, run=run,
                log=log)


class _CallableModule(types.ModuleType):
    """``dsv4_numerics.repro`` is both this package and the function: once the package is
    imported it is the attribute ``repro`` of ``dsv4_numerics``, so ``dn.repro(kernel, stage, ...)``
    calls :func:`repro` through the module object."""

    def __call__(self, *args: Any, **kwargs: Any) -> Reproducer:
        return repro(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["NothingToReproduce", "Reproducer", "Unavailable", "repro", "repro_entry"]
