"""Launching the fast oracle's Triton kernels at a fraction of ``JITFunction``'s host cost.

``kernel[grid](*args, **constexprs)`` binds every argument, computes its specialisation, hashes a
cache key, looks up the device and stream and builds launch metadata before the one C call that
launches: about 23-35 us of host time per launch on an H200's host, against about 7-9 us for a
small PyTorch operation. An eager fast-oracle call launches four to six of them, and at production
decode shapes its host work, not the GPU's, sets its time.

``launch(kernel, grid, *args, **kw)`` keeps, per (kernel, current CUDA device, specialisation key
of the arguments, keyword values), the ``CompiledKernel`` that ``JITFunction`` returned on the
first launch, and launches it again through its runner directly (``CompiledKernel.run``, the call
``JITFunction.run`` itself ends with). The key is a superset of what Triton specialises on, so
two launches with one key always select one compiled kernel: per tensor its dtype and whether its
address is 16-byte aligned; per integer whether it is 1, whether it is divisible by 16 and whether
it fits 32 bits (Triton specialises on the first two unless ``do_not_specialize``, and picks the
integer's type by the last); per float and bool its type and value. Keyword arguments (the
constexprs, ``num_warps``, ``enable_fp_fusion``) enter the key by value. Arguments are passed as
``JITFunction`` passes them: the positional ones, then every remaining parameter's keyword value or
default, in the kernel's parameter order.

Where ``JITFunction`` runs instead: under ``TRITON_INTERPRET=1``, where Triton's launch hooks are
set (a profiler that hooks launches sees every launch), for a keyword that names a parameter
before the last positional one, for an argument of another type, and everywhere when
``DSV4_TRITON_DIRECT=0``. ``stats()`` counts both kinds of launch.
"""
from __future__ import annotations

import os

import torch

__all__ = ["launch", "stats", "clear", "ENV"]

ENV = "DSV4_TRITON_DIRECT"  # "0": every launch through JITFunction
_CACHE: dict = {}
_CACHE_MAX = 512
_COUNTS = {"direct": 0, "jit": 0}
_I32 = (-2**31, 2**31)


def _enabled() -> bool:
    if os.environ.get(ENV, "1").strip() in ("0", "false", "no", "off"):
        return False
    return os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def _arg_key(a):
    """The part of an argument's specialisation key this module keys on (module docstring); None
    for a type it does not handle (the launch then goes through ``JITFunction``)."""
    t = type(a)
    if t is torch.Tensor or isinstance(a, torch.Tensor):
        return a.dtype, not a.data_ptr() & 15
    if t is bool:
        return "b", a
    if t is int:
        return "i", a == 1, not a & 15, _I32[0] <= a < _I32[1]
    if t is float:
        return "f", a
    return None


def _hooks_set() -> bool:
    """Whether a launch hook is installed: a plain callable, or a non-empty ``HookChain`` (Triton
    3.6 keeps an empty chain when none is)."""
    from triton import knobs

    for h in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if h is not None and getattr(h, "calls", True):
            return True
    return False


def _tail(fn, nargs: int, kw: dict):
    """The values of the kernel's parameters after the ``nargs`` positional ones, in order (keyword
    value, else default); None if a keyword names one of the positional parameters or a parameter
    has neither."""
    names = fn.arg_names
    if any(k in names[:nargs] for k in kw):
        return None
    tail = []
    for p in list(fn.signature.parameters.values())[nargs:]:
        if p.name in kw:
            tail.append(kw[p.name])
        elif p.default is not p.empty:
            tail.append(p.default)
        else:
            return None
    return tuple(tail)


def launch(fn, grid: tuple, *args, **kw) -> None:
    """``fn[grid](*args, **kw)`` (module docstring: when the compiled kernel is launched directly).
    ``grid``: a tuple of 1-3 ints."""
    if not _enabled():
        _COUNTS["jit"] += 1
        fn[grid](*args, **kw)
        return
    keys = tuple(map(_arg_key, args))
    dev = torch.cuda.current_device()
    key = (fn, dev, keys, tuple(kw.items()))
    hit = _CACHE.get(key) if None not in keys else None
    if hit is not None and not _hooks_set():
        k, tail = hit
        g = (*grid, 1, 1)
        k.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(dev), k.function, k.packed_metadata, None, None,
              None, *args, *tail)
        _COUNTS["direct"] += 1
        return
    _COUNTS["jit"] += 1
    k = fn[grid](*args, **kw)
    if None in keys or k is None or not hasattr(k, "packed_metadata"):
        return
    tail = _tail(fn, len(args), kw)
    if tail is None:
        return
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = (k, tail)


def stats() -> dict:
    """``{"direct": n, "jit": n}``: launches of a kept compiled kernel and through ``JITFunction``."""
    return dict(_COUNTS)


def clear() -> None:
    """Forget the kept compiled kernels (Triton's own cache is untouched) and the counts."""
    _CACHE.clear()
    _COUNTS.update(direct=0, jit=0)
