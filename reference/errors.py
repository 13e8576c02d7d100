"""Input validation with errors that name the argument and the rule it breaks.

Every public reference function validates its arguments with these helpers before any
arithmetic, so that bad input gives ``InputError: <function>: argument 'k' must be ...`` rather
than a silent wrong answer or a traceback from deep inside.
"""

from __future__ import annotations

from enum import Enum
from typing import Iterable, TypeVar

import torch

E = TypeVar("E", bound=Enum)


class InputError(ValueError):
    """Raised for malformed input. The message names the argument and the rule it breaks."""


def fail(fn: str, arg: str, rule: str, got: object | None = None) -> "NoReturn":  # noqa: F821
    msg = f"{fn}: argument '{arg}' {rule}"
    if got is not None:
        msg += f" (got {got})"
    raise InputError(msg)


def check_enum(fn: str, arg: str, cls: type[E], value: object, context: str = "") -> E:
    """``cls(value)`` for a string enum (the named policies of ``reference.policies``); otherwise
    an InputError naming ``arg`` and every known value (``context`` follows the list)."""
    try:
        return cls(value)
    except ValueError:
        fail(fn, arg, f"must be one of {[m.value for m in cls]}{context}", value)


def check_tensor(fn: str, arg: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        fail(fn, arg, "must be a torch.Tensor", type(t).__name__)
    return t


def check_dtype(fn: str, arg: str, t: torch.Tensor, dtypes: Iterable[torch.dtype]) -> None:
    check_tensor(fn, arg, t)
    dtypes = tuple(dtypes)
    if t.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        fail(fn, arg, f"must have dtype {names}", str(t.dtype).replace("torch.", ""))


def check_rank(fn: str, arg: str, t: torch.Tensor, rank: int | tuple[int, ...]) -> None:
    check_tensor(fn, arg, t)
    ranks = (rank,) if isinstance(rank, int) else tuple(rank)
    if t.dim() not in ranks:
        fail(fn, arg, f"must have rank {' or '.join(map(str, ranks))}", f"shape {tuple(t.shape)}")


def check_last_dim(fn: str, arg: str, t: torch.Tensor, width: int) -> None:
    check_tensor(fn, arg, t)
    if t.dim() == 0 or t.shape[-1] != width:
        fail(fn, arg, f"must have last dimension {width}", f"shape {tuple(t.shape)}")


def check_shape(fn: str, arg: str, t: torch.Tensor, shape: tuple) -> None:
    """``shape`` entries may be ``None`` for 'any size'."""
    check_tensor(fn, arg, t)
    ok = t.dim() == len(shape) and all(s is None or s == n for s, n in zip(shape, t.shape))
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        fail(fn, arg, f"must have shape {want}", f"shape {tuple(t.shape)}")


def check_same_device(fn: str, **tensors: torch.Tensor) -> None:
    devs = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devs.values())) > 1:
        fail(fn, ",".join(devs), "must all be on one device", {k: str(v) for k, v in devs.items()})


def check_int(fn: str, arg: str, v: object, minimum: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        fail(fn, arg, "must be an int", type(v).__name__)
    if minimum is not None and v < minimum:
        fail(fn, arg, f"must be >= {minimum}", v)
    return v


INDEX_DTYPES = (torch.int32, torch.int64)


class UnsupportedCase(Exception):
    """A kernel adapter's signal that a canonical case lies outside the kernel's documented
    contract (e.g. more query heads than the kernel supports, an SWA width other than the fixed
    128 of FlashInfer trtllm-gen). Runners report it as a skip carrying this message -- never as a
    pass, never as a failure of the kernel. Raise it before launching anything on the device."""
