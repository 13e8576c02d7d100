"""Write a reproducer folder from one op call: ``repro.py``, ``inputs.safetensors``,
``geometry.json`` (and ``ISSUE.md``, ``report.json``, written by ``dsv4_numerics.repro``).

``write_files(out, call, expected, masks, checks)``:

* every tensor argument of ``call`` (``kernels.op_call.OpCall``) is saved as the flat span of
  storage it covers (``arg.<i>``, ``kwarg.<name>``, ``arg.<i>.<key>`` inside a dict argument) and
  rebuilt by ``torch.as_strided`` with its exact sizes and strides (``geometry.json``), so a
  page-strided cache view reaches the op as the adapter passed it; an argument passed twice (the
  same tensor object) is saved once and aliases in the script too;
* ``expected.<label>`` / ``mask.<label>``: the oracle's outputs in the op's own form and the
  elements the judge compares;
* ``repro.py`` is the template ``templates/repro_op.py`` with its call block (between the
  ``# --- the call`` and ``# --- end of the call`` lines) replaced by this call's literal values.

Tensors are saved on the CPU; the script moves them to the op's device (``DEVICE``).
"""

from __future__ import annotations

import json
import pprint
from importlib import resources
from pathlib import Path
from typing import Any

import torch

TEMPLATE = "repro_op.py"
BEGIN = "# --- the call"
END = "# --- end of the call"
MAX_INPUT_BYTES = 1 << 20  # what a bug report can attach: 1 MiB of tensors


class Ref:
    """A saved tensor in the generated script (printed as ``T('name')``)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"T({self.name!r})"


def template_text(name: str = TEMPLATE) -> str:
    return resources.files("dsv4_numerics.repro").joinpath("templates", name).read_text()


def _span(t: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The storage span ``t`` covers, as a contiguous 1-D CPU tensor, and its geometry."""
    t = t.detach()
    if t.numel() == 0:
        return torch.empty(0, dtype=t.dtype), {"size": list(t.shape), "stride": list(t.stride())}
    n = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    flat = torch.as_strided(t, (n,), (1,), t.storage_offset()).cpu().clone()
    return flat, {"size": list(t.shape), "stride": list(t.stride())}


class Saver:
    """Collects the tensors of an op call under stable names, one entry per tensor object."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.geometry: dict[str, dict] = {}
        self._by_id: dict[int, str] = {}

    def value(self, v: Any, name: str) -> Any:
        if isinstance(v, torch.Tensor):
            if id(v) in self._by_id:
                return Ref(self._by_id[id(v)])
            flat, geo = _span(v)
            self.tensors[name], self.geometry[name] = flat, geo
            self._by_id[id(v)] = name
            return Ref(name)
        if isinstance(v, dict):
            return {k: self.value(x, f"{name}.{k}") for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(self.value(x, f"{name}.{i}") for i, x in enumerate(v))
        if isinstance(v, torch.dtype):
            raise TypeError(f"{name}: a torch.dtype argument is not supported by the reproducer writer")
        return v

    def input_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def render(call: Any, saver: Saver, checks: dict, device: str) -> str:
    """``repro.py``'s text for ``call`` (module docstring)."""
    args = [saver.value(a, f"arg.{i}") for i, a in enumerate(call.args)]
    kwargs = {k: saver.value(v, f"kwarg.{k}") for k, v in call.kwargs.items()}
    fmt = lambda v: pprint.pformat(v, width=110, sort_dicts=False)  # noqa: E731
    block = "\n".join([
        f"{BEGIN} (written for this finding) " + "-" * 46,
        f"OP = {call.op!r}",
        f"LOADER = {fmt(call.loader)}",
        f"DEVICE = {device!r}",
        f"ARGS = {fmt(args)}",
        f"KWARGS = {fmt(kwargs)}",
        f"OUTPUTS = {fmt(call.outputs)}",
        f"CHECKS = {fmt(checks)}",
        END + " " + "-" * 75,
    ])
    text = template_text()
    start, stop = text.index(BEGIN), text.index(END)
    stop = text.index("\n", stop) + 1
    return text[:start] + block + "\n" + text[stop:]


def write_files(out: Path, call: Any, expected: dict, masks: dict, checks: dict, device: str) -> dict:
    """Write ``repro.py``, ``inputs.safetensors`` and ``geometry.json`` into ``out``; returns
    ``{"lines": lines of repro.py, "input_bytes": bytes of the saved tensors, "file_bytes": size
    of inputs.safetensors}``. ``expected`` / ``masks``: ``{label: tensor}`` in the op's form."""
    from safetensors.torch import save_file

    saver = Saver()
    text = render(call, saver, checks, device)
    tensors = dict(saver.tensors)
    for label, t in expected.items():
        tensors[f"expected.{label}"] = t.detach().cpu().contiguous()
    for label, m in (masks or {}).items():
        tensors[f"mask.{label}"] = m.detach().cpu().to(torch.uint8).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    (out / "repro.py").write_text(text)
    save_file(tensors, str(out / "inputs.safetensors"))
    (out / "geometry.json").write_text(json.dumps(saver.geometry, indent=1, sort_keys=True) + "\n")
    return {"lines": text.count("\n"), "input_bytes": saver.input_bytes(),
            "file_bytes": (out / "inputs.safetensors").stat().st_size}


__all__ = ["MAX_INPUT_BYTES", "Ref", "Saver", "TEMPLATE", "render", "template_text", "write_files"]
