"""Standalone reproducer: calls one production op on the inputs saved beside this file and compares
what it produces with the expected outputs saved beside it.

Needs torch, safetensors and the production package (or its library); nothing else. Exit status:
0 the op's outputs match, 1 the divergence is present, 3 the op could not be loaded here.

    python repro.py [--library PATH] [--path DIR] [--max-lines N]

--library PATH  the shared library that registers the op (torch.ops.load_library, as the package
                itself does), when the package is not installed
--path DIR      a folder to put first on sys.path (an unpacked package, or the folder of a
                kernel imported by its dotted path) for a Python op; repeatable
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import site
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent


class T:
    """A tensor saved in inputs.safetensors (rebuilt with its exact sizes, strides and offset)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"T({self.name!r})"


# --- the call (written for this finding) ------------------------------------------------------
OP = "torch.ops.namespace.op_name"
LOADER = {"kind": "torch_library", "dist": "", "file": "", "namespace": "", "name": ""}
DEVICE = "cpu"
ARGS: list = []
KWARGS: dict = {}
OUTPUTS: dict = {}
CHECKS: dict = {}
# --- end of the call ---------------------------------------------------------------------------


def load_tensors() -> dict:
    return load_file(str(HERE / "inputs.safetensors"))


def _geometry() -> dict:
    return json.loads((HERE / "geometry.json").read_text())


def build(saved: dict, geometry: dict, device: str):
    """``ARGS`` / ``KWARGS`` with every ``T(name)`` replaced by its tensor on ``device`` (one tensor
    object per name, so arguments that alias in the original call alias here too)."""
    made: dict = {}

    def tensor(ref: T):
        if ref.name not in made:
            flat = saved[ref.name].to(device)
            g = geometry.get(ref.name)
            made[ref.name] = torch.as_strided(flat, g["size"], g["stride"], 0) if g else flat
        return made[ref.name]

    def conv(v):
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(conv(x) for x in v)
        return tensor(v) if isinstance(v, T) else v

    return [conv(a) for a in ARGS], {k: conv(v) for k, v in KWARGS.items()}


def load_op(library: str | None, path: list | None):
    """The production op, or raise RuntimeError saying why it is not available here."""
    if LOADER["kind"] == "torch_library":
        ns, name = LOADER["namespace"], LOADER["name"]
        lib = library
        if lib is None:
            top = LOADER["file"].split("/")[0]
            spec = importlib.util.find_spec(top)
            for d in (spec.submodule_search_locations or []) if spec else []:
                cand = Path(d) / Path(LOADER["file"]).relative_to(top)
                if cand.is_file():
                    lib = str(cand)
        if lib is None:
            raise RuntimeError(f"{LOADER['file']} of {LOADER['dist']} not found: install {LOADER['dist']} or pass "
                               "--library PATH")
        torch.ops.load_library(lib)
        return getattr(getattr(torch.ops, ns), name)
    for p in reversed(path or []):
        sys.path.insert(0, p)
        site.addsitedir(p)  # its .pth files too (packages installed into that folder)
    mod = importlib.import_module(LOADER["module"])
    return getattr(mod, LOADER["attr"])


def produced(args: list, kwargs: dict, ret) -> dict:
    out = {}
    for label, (kind, where) in OUTPUTS.items():
        if kind == "arg":
            out[label] = args[where]
        elif kind == "kwarg":
            out[label] = kwargs[where]
        else:
            out[label] = ret if where is None else ret[where]
    return out


# --------------------------------------------------------------------------- explaining bytes

E4M3 = torch.float8_e4m3fn


def _fp8(code: int) -> float:
    return float(torch.tensor([code], dtype=torch.uint8).view(E4M3).float())


def _bf16(lo: int, hi: int) -> float:
    return float(torch.tensor([lo | (hi << 8)], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float())


def _ue8m0(byte: int) -> str:
    return f"byte {byte} (NaN in UE8M0)" if byte == 255 else f"byte {byte} = 2**{byte - 127}"


def explain_model1(buf: torch.Tensor, index: tuple, check: dict) -> str:
    """What byte ``index`` of a 584-byte-record page buffer ``[num_blocks, page_stride]`` means,
    read from ``buf``: data rows (448 FP8 codes, 64 bf16) then scale rows (7 UE8M0 bytes + pad)."""
    bs, data, rec = check["block_size"], check["data_row_bytes"], check["record_bytes"]
    nope, tile = check["nope_dim"], check["tile"]
    page, off = index
    row = buf[page]
    if off < bs * data:
        e, b = divmod(off, data)
        slot = page * bs + e
        if b < nope:
            code = int(row[off])
            sbyte = int(row[bs * data + e * (rec - data) + b // tile])
            scale = math.nan if sbyte == 255 else 2.0 ** (sbyte - 127)
            return (f"slot {slot} dim {b} (tile {b // tile}) code 0x{code:02x} x scale {_ue8m0(sbyte)} "
                    f"= {_fp8(code) * scale:.6g}")
        j = (b - nope) // 2
        base = e * data + nope + 2 * j
        return f"slot {slot} dim {nope + j} (bf16 RoPE) = {_bf16(int(row[base]), int(row[base + 1])):.6g}"
    if off < bs * rec:
        e, t = divmod(off - bs * data, rec - data)
        sbyte = int(row[off])
        what = "pad byte" if t == rec - data - 1 else f"tile {t} scale {_ue8m0(sbyte)}"
        return f"slot {page * bs + e} {what}"
    return f"page {page} tail byte {off}"


def compare_bytes(label: str, got: torch.Tensor, exp: torch.Tensor, mask, check: dict, max_lines: int) -> int:
    g = got.detach().cpu().contiguous().view(torch.uint8).reshape(exp.shape)
    diff = g != exp
    if mask is not None:
        diff &= mask.bool()
    idx = diff.nonzero().tolist()
    compared = int(mask.sum()) if mask is not None else exp.numel()
    print(f"{label}: {len(idx)} of {compared} compared bytes differ (bit for bit)")
    for i in idx[:max_lines]:
        t = tuple(i)
        if check.get("layout") == "model1_584":
            print(f"  {t}: expected {explain_model1(exp, t, check)}")
            print(f"  {' ' * len(str(t))}  got      {explain_model1(g, t, check)}")
        else:
            print(f"  {t}: expected 0x{int(exp[t]):02x} got 0x{int(g[t]):02x}")
    if len(idx) > max_lines:
        print(f"  ... {len(idx) - max_lines} more")
    return len(idx)


def compare_numeric(label: str, got: torch.Tensor, exp: torch.Tensor, check: dict, max_lines: int) -> int:
    """FlashMLA kernelkit's rule set: the same NaN/+inf/-inf positions; then element i passes iff
    |a-r| <= atol or |a-r| / (|r| + 1e-6) <= rtol; then 1 - 2*sum(a*r)/sum(a*a + r*r) <= cos_tol."""
    a, r = got.detach().cpu().to(torch.float64), exp.to(torch.float64)
    atol, rtol, cos_tol = check["atol"], check["rtol"], check["cos_tol"]
    bad = 0
    for what, fa, fr in (("NaN", a.isnan(), r.isnan()), ("+inf", a == math.inf, r == math.inf),
                         ("-inf", a == -math.inf, r == -math.inf)):
        n = int((fa != fr).sum())
        if n:
            print(f"{label}: {n} element(s) {what} on one side only")
            bad += n
    fin = ~(a.isnan() | r.isnan() | a.isinf() | r.isinf())
    a0, r0 = torch.where(fin, a, 0.0), torch.where(fin, r, 0.0)
    err = (a0 - r0).abs()
    fails = (err > atol) & (err / (r0.abs() + 1e-6) > rtol)
    n = int(fails.sum())
    print(f"{label}: {n} of {a.numel()} elements exceed both atol={atol:.6g} and rtol={rtol:.6g}")
    order = torch.argsort(torch.where(fails, err, -1.0).flatten(), descending=True)[:min(n, max_lines)]
    for flat in order.tolist():
        i = tuple(int(x) for x in torch.unravel_index(torch.tensor(flat), a.shape))
        print(f"  {i}: expected {float(r[i]):.8g} got {float(a[i]):.8g} |diff| {float(err[i]):.3g}")
        explain_sources(i, check)
    if n > max_lines:
        print(f"  ... {n - max_lines} more")
    den = float((a0 * a0 + r0 * r0).sum())
    cos = 0.0 if den == 0 else 1 - 2 * float((a0 * r0).sum()) / den
    if cos > cos_tol:
        print(f"{label}: cosine distance {cos:.6g} > {cos_tol:.6g}")
        bad += 1
    return bad + n


SOURCES: dict = {}  # arg index -> the argument, set by main() for explain_sources


def explain_sources(index: tuple, check: dict) -> None:
    """For an attention output element ``(t, h, d)``: the record bytes at dim ``d`` of every cache
    row token ``t`` reads (``check["sources"]``: cache argument, slots argument, block size)."""
    if len(index) != 3 or not check.get("sources"):
        return
    t, _, d = index
    for src in check["sources"]:
        cache, slots, bs = SOURCES.get(src["cache"]), SOURCES.get(src["slots"]), src["block_size"]
        if cache is None or slots is None or slots.dim() != 2:
            continue
        for s in slots[t].tolist():
            if s < 0:
                continue
            page, e = divmod(int(s), bs)
            c = dict(check, block_size=bs)
            off = e * check["data_row_bytes"] + (d if d < check["nope_dim"] else
                                                 check["nope_dim"] + 2 * (d - check["nope_dim"]))
            print(f"      reads {explain_model1(cache.cpu(), (page, off), c)}")


BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def compare_exact(label: str, got: torch.Tensor, exp: torch.Tensor, max_lines: int) -> int:
    """Bit for bit: equal values, and for floats equal bit patterns (so -0.0 is not 0.0 and a
    NaN's payload counts)."""
    g = got.detach().cpu()
    if g.dtype != exp.dtype or tuple(g.shape) != tuple(exp.shape):
        print(f"{label}: got {g.dtype} {tuple(g.shape)}, expected {exp.dtype} {tuple(exp.shape)}")
        return 1
    bits = BITS[exp.element_size()]
    diff = g.contiguous().view(bits) != exp.contiguous().view(bits)
    idx = diff.nonzero().tolist()
    print(f"{label}: {len(idx)} of {exp.numel()} elements differ (bit for bit)")
    for i in idx[:max_lines]:
        t = tuple(i)
        gb, eb = int(g.contiguous().view(bits)[t]), int(exp.contiguous().view(bits)[t])
        w = 2 * exp.element_size()
        print(f"  {t}: expected {exp[t].item()!r} (0x{eb & (2 ** (8 * exp.element_size()) - 1):0{w}x}) "
              f"got {g[t].item()!r} (0x{gb & (2 ** (8 * exp.element_size()) - 1):0{w}x})")
    if len(idx) > max_lines:
        print(f"  ... {len(idx) - max_lines} more")
    return len(idx)


def main(argv: list | None = None, op=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--library")
    ap.add_argument("--path", action="append", default=[])
    ap.add_argument("--max-lines", type=int, default=12)
    a = ap.parse_args(argv)
    if op is None:
        try:
            op = load_op(a.library, a.path)
        except Exception as e:  # noqa: BLE001 - say why, distinctly from a pass or a failure
            print(f"cannot load {OP}: {type(e).__name__}: {e}")
            return 3
    saved = load_tensors()
    args, kwargs = build(saved, _geometry(), DEVICE)
    SOURCES.update({i: a.clone() for i, a in enumerate(args) if isinstance(a, torch.Tensor)})
    print(f"calling {OP} on {DEVICE}")
    ret = op(*args, **kwargs)
    if DEVICE != "cpu":
        torch.cuda.synchronize()
    got = produced(args, kwargs, ret)
    bad = 0
    for label, check in CHECKS.items():
        exp = saved[f"expected.{label}"]
        if check["kind"] == "bytes":
            bad += compare_bytes(label, got[label], exp, saved.get(f"mask.{label}"), check, a.max_lines)
        elif check["kind"] == "numeric":
            bad += compare_numeric(label, got[label], exp, check, a.max_lines)
        else:
            bad += compare_exact(label, got[label], exp, a.max_lines)
    print("DIVERGENCE PRESENT" if bad else "outputs match the expected ones")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
