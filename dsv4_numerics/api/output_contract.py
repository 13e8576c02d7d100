"""The output contract of a stage: which canonical outputs a kernel returns, with which dtypes and
shapes -- checked on a plain callable's outputs *before* they are judged, so that a wrong key,
dtype or shape gets one clear message instead of a comparator failure (used by
:mod:`dsv4_numerics.api.testing`).

What is expected comes from the reference itself: the outputs of ``StageSpec.expected`` for the
case (keys starting with ``_`` are judge data, never outputs). The rules mirror the judges of
``oracles/stages/`` (the package docstring's table of canonical outputs):

* required keys: every reference output except the optional ones of :data:`OPTIONAL`
  (attention may omit ``lse`` / ``max_logits`` / ``lse_with_sink`` for kernels without them, the
  output epilogue may omit ``deq``); the compressor returns ``normed`` and/or ``cache``;
* no other keys (a misspelt ``"lse"`` would otherwise be silently unjudged);
* dtypes: bytes and index stages keep the reference's integer dtype (index outputs int32 or
  int64, values compared as int64; a plain FP8 cache may be returned as ``float8_e4m3fn`` or its
  ``uint8`` bytes; ``exponents`` any integer dtype); floating outputs of numeric stages may be
  any floating dtype (a bf16 kernel returns bf16; it is judged in the ulps of its own format);
  the gather output is bf16, the RoPE output fp32 or bf16;
* shapes: equal to the reference's, except a 584-byte cache, which may be returned in any
  accepted form of the same geometry (``[num_blocks, page_stride]``, ``[num_blocks, bs, 584]``
  or ``[num_blocks, bs, 1, 584]`` with the page stride kept), and the gather output, whose row
  dimension may be wider than the longest gather (a kernel workspace).
"""

from __future__ import annotations

from typing import Any

import torch

from dsv4_numerics.oracles.bytes_diff import model1_flat_bytes

# outputs a kernel may omit (the judges of oracles/stages/ judge them only when returned)
OPTIONAL: dict[str, frozenset[str]] = {
    "decode": frozenset({"lse", "max_logits", "lse_with_sink"}),
    "prefill": frozenset({"lse", "max_logits", "lse_with_sink"}),
    "v32_decode": frozenset({"lse"}),
    "dense_mla_decode": frozenset({"lse"}),
    "dense_mla_prefill": frozenset({"lse"}),
    "inv_rope_fp8": frozenset({"deq"}),
    "compressor": frozenset({"normed", "cache"}),  # at least one of the two (AT_LEAST_ONE)
}
AT_LEAST_ONE: dict[str, frozenset[str]] = {"compressor": frozenset({"normed", "cache"})}
# stages whose ``cache`` output is a 584-byte paged cache (any accepted form of its geometry)
MODEL1_CACHE_STAGES = frozenset({"swa_write", "compressed_write", "compressor"})
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class OutputContractError(ValueError):
    """A callable's outputs break the stage's output contract; the message names the output and
    what was expected."""


def _desc(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
    return type(t).__name__


def _block_size(inputs: dict) -> int | None:
    """Entries per page of the case's output cache: ``kv_block_size`` where a case has one (the
    compressor: its ``block_size`` counts the state cache's entries), else ``block_size``."""
    for k in ("kv_block_size", "block_size"):
        if isinstance(inputs.get(k), int):
            return inputs[k]
    return None


def _dtype_ok(stage: str, kind: str, name: str, exp: torch.Tensor, got: torch.Tensor) -> str:
    """'' if ``got``'s dtype is acceptable for output ``name``, else what was expected."""
    e, g = exp.dtype, got.dtype
    if name == "exponents":
        return "" if not g.is_floating_point and g != torch.bool else "an integer dtype (UE8M0 byte - 127)"
    if stage == "rope":
        return "" if g in (torch.float32, torch.bfloat16) else "float32 or bfloat16"
    if stage == "plain_write" and name == "cache":
        ok = {e, torch.uint8, torch.float8_e4m3fn} if e in (torch.uint8, torch.float8_e4m3fn) else {e}
        return "" if g in ok else " or ".join(sorted(str(d).replace("torch.", "") for d in ok))
    if kind == "index" or (not e.is_floating_point and e not in (torch.uint8, torch.bool)):
        return "" if g in (torch.int32, torch.int64) else "int32 or int64"
    if e.is_floating_point and (kind == "numeric" or name == "deq") and name != "cache":
        return "" if g in FLOAT_DTYPES else "a floating dtype (float16, bfloat16, float32 or float64)"
    return "" if g == e else str(e).replace("torch.", "")


def _shape_problem(stage: str, name: str, exp: torch.Tensor, got: torch.Tensor, inputs: dict) -> str:
    """'' if ``got``'s shape is acceptable, else the expected shape in words."""
    if name == "cache" and stage in MODEL1_CACHE_STAGES:
        bs = _block_size(inputs)
        try:
            fe, se = model1_flat_bytes(exp, bs)
            fg, sg = model1_flat_bytes(got, bs)
        except (ValueError, TypeError) as e:
            return f"a 584-byte paged cache of the input's geometry {list(exp.shape)} (got an unusable geometry: {e})"
        if fe.numel() == fg.numel() and se == sg:
            return ""
        return (f"the input cache's geometry: {list(exp.shape)} (page stride {se} bytes, {fe.numel()} bytes; "
                f"got page stride {sg}, {fg.numel()} bytes)")
    if stage == "gather" and name == "out" and got.dim() == 3 and exp.dim() == 3:
        if got.shape[0] == exp.shape[0] and got.shape[2] == exp.shape[2] and got.shape[1] >= exp.shape[1]:
            return ""
        return f"[{exp.shape[0]}, >= {exp.shape[1]}, {exp.shape[2]}]"
    return "" if tuple(got.shape) == tuple(exp.shape) else str(list(exp.shape))


def check_outputs(stage: str, kind: str, case_name: str, inputs: dict, expected: dict, got: Any) -> None:
    """Raise :class:`OutputContractError` (one message listing every problem) if ``got`` -- a
    callable's outputs on one case -- breaks the output contract of ``stage`` (module docstring).
    ``expected``: the reference outputs of the case (``StageSpec.expected``); ``inputs``: the
    case's canonical inputs."""
    where = f"stage '{stage}', case '{case_name}'"
    ref = {k: v for k, v in expected.items() if not k.startswith("_")}
    want = ", ".join(f"'{k}': {_desc(v)}" for k, v in ref.items())
    if not isinstance(got, dict):
        raise OutputContractError(f"{where}: the callable returned {type(got).__name__}; expected a dict of "
                                  f"outputs {{{want}}}")
    optional = OPTIONAL.get(stage, frozenset())
    problems: list[str] = []
    unknown = [k for k in got if k not in ref]
    for k in unknown:
        problems.append(f"unexpected output '{k}' (the outputs of {stage} are {sorted(ref)})")
    missing = [k for k in ref if k not in got and k not in optional]
    for k in missing:
        problems.append(f"missing output '{k}' (expected {_desc(ref[k])})")
    need = AT_LEAST_ONE.get(stage)
    if need and not (need & set(got)):
        problems.append(f"returns none of {sorted(need & set(ref))}: at least one is required")
    for k, g in got.items():
        if k not in ref:
            continue
        e = ref[k]
        if not isinstance(g, torch.Tensor):
            problems.append(f"output '{k}' is a {type(g).__name__}, expected a tensor {_desc(e)}")
            continue
        why = _dtype_ok(stage, kind, k, e, g)
        if why:
            problems.append(f"output '{k}' has dtype {str(g.dtype).replace('torch.', '')}, expected {why}")
        shape = _shape_problem(stage, k, e, g, inputs)
        if shape:
            problems.append(f"output '{k}' has shape {list(g.shape)}, expected {shape}")
    if problems:
        raise OutputContractError(f"{where}: " + "; ".join(problems) + f" -- the reference returns {{{want}}}"
                                  + (f" ({', '.join(sorted(optional))} optional)" if optional else ""))


__all__ = ["AT_LEAST_ONE", "MODEL1_CACHE_STAGES", "OPTIONAL", "OutputContractError", "check_outputs"]
