"""Numeric comparators: the kernelkit rule set and the three-output rule (attention.md 4.2, 7).

``compare(got, ref, atol=, rtol=, cos_tol=)`` paraphrases FlashMLA's
``tests/kernelkit/compare.py:31-92`` (``check_is_allclose``), in float64 throughout:

1. anomaly positions: the sets of NaN, +inf and -inf positions of ``got`` and ``ref`` must be
   identical; those entries are then set to 0 in both;
2. element rule: element ``i`` passes iff ``|a-r| <= atol`` or ``|a-r| / (|r| + 1e-6) <= rtol``
   (kernelkit uses strict ``<``; this suite uses ``<=`` as specified for the project -- the two
   differ only on a measure-zero set);
3. cosine rule: ``cos_diff = 1 - 2*sum(a*r) / sum(a^2 + r^2)`` in float64 must be ``<= cos_tol``.

Deliberate departures from kernelkit, because they hide real failures:

* kernelkit *skips* the cosine rule (returns 0) when ``sum(r^2) < 1e-12``; here a trivially small
  reference is a FAILURE (rule ``degenerate_reference``): the case cannot discriminate. "Small"
  is relative to the values' own scale (``ref_scale``: ``sum(r^2) < 1e-12 * ref_scale**2``; the
  attention judge passes the case's V RMS for ``out`` and its largest row logit bound for the
  softmax statistics), so a case at magnitude ``2**-40`` is judged as strictly as one at 1 --
  kernelkit's absolute floor (``ref_scale = 1``, the default) rejects every case below ~``2**-20``. A caller
  that expects exact zeros (lonely queries, sink = +inf) passes ``zero_ref="exact"`` and then the
  all-zero reference demands an all-zero output (rule ``exact_zero``). A reference with no finite
  element at all (``lse = -inf`` where every row attends to nothing) is not degenerate: it is
  matched exactly by the anomaly-position rule, and an output with the same NaN/+inf/-inf
  everywhere passes (rule ``all_non_finite``).
* a kernel output that is all zero where the reference is not fails (rule ``zero_output``) even
  before the cosine rule would.

A caller may also pass ``allow`` (per element, absolute, broadcastable to the values): an error
budget it derived for a term the scalar limits cannot express -- the attention judge's softmax
statistics carry the fp32 logit chain's error, which grows with each row's logit magnitude, not
with the statistic's value (``oracles.row_scale``). Both element rules then judge the error beyond
that budget, ``max(|a - r| - allow, 0)``; the reported ``max_abs`` / ulps stay the raw errors.

The three-output rule (``three_output``): with ``golden`` the fp64 oracle and ``same`` the
oracle in the kernel's own precision model (``AttentionMode.BF16_P``),
``err(got, golden) <= k * err(same, golden) + floor``, ``err`` = max abs error over finite
entries, ``floor`` = the output format's rounding floor (max half ulp at the golden values).

Errors are also reported in ulps of the output format at the reference value
(``ulp(r) = 2**(max(floor(log2|r|), emin) - mantissa_bits)``, computed exactly with ``frexp``):
``max_ulps`` over every element (huge where a reference is near zero), and
``max_ulps_rel_regime`` over the elements where the relative criterion governs
(``|r| >= atol / rtol``), the figure a kernel author reads as "worst ulps".
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dsv4_numerics.reference.detmath import fixed_sum
from dsv4_numerics.reference.errors import InputError, check_tensor, fail

# Format name -> (fraction bits, minimum normal exponent). Used for ulp arithmetic only.
FORMATS: dict[str, tuple[int, int]] = {
    "bf16": (7, -126),
    "fp16": (10, -14),
    "fp32": (23, -126),
    "fp64": (52, -1022),
    "e4m3": (3, -6),
    "e4m3fnuz": (3, -7),
}

# kernelkit's relative-error denominator guard (compare.py: ``|r| + 1e-6``).
REL_EPS = 1e-6
# kernelkit's "reference is trivially small" threshold on sum(r^2) (compare.py get_cos_diff).
TRIVIAL_SUMSQ = 1e-12

RULE_PASS = "pass"
RULE_SHAPE = "shape"
RULE_ANOMALY = "anomaly_positions"
RULE_DEGENERATE = "degenerate_reference"
RULE_ZERO_OUTPUT = "zero_output"
RULE_EXACT_ZERO = "exact_zero"
RULE_ALL_NON_FINITE = "all_non_finite"
RULE_ELEMENT = "elementwise_abs_or_rel"
RULE_COSINE = "cosine"
RULE_THREE_OUTPUT = "three_output"


def format_of(dtype: torch.dtype) -> str:
    """The ulp format name of a torch dtype (used when the caller does not name one)."""
    table = {
        torch.bfloat16: "bf16",
        torch.float16: "fp16",
        torch.float32: "fp32",
        torch.float64: "fp64",
    }
    return table.get(dtype, "fp32")


def _check_fmt(fn: str, fmt: str) -> tuple[int, int]:
    if fmt not in FORMATS:
        fail(fn, "fmt", f"must be one of {sorted(FORMATS)}", fmt)
    return FORMATS[fmt]


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """``2**k`` (float64) for int64 ``k`` in ``[-1074, 1023]``, from its bit fields: the biased
    exponent for normal powers, the one mantissa bit for subnormal ones (the same bits on every
    device)."""
    sub = torch.bitwise_left_shift(torch.ones_like(k), torch.clamp(k + 1074, 0, 62))
    return torch.where(k >= -1022, torch.bitwise_left_shift(k + 1023, 52), sub).view(torch.float64)


def ulp(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Unit in the last place of format ``fmt`` at each value of ``x`` (float64 tensor).

    ``ulp(r) = 2**(max(floor(log2|r|), emin) - p)``, p = fraction bits; ``ulp(0)`` is the
    smallest subnormal step ``2**(emin - p)``. Exact: the exponent comes from ``torch.frexp``
    on float64, no log2, and the power of two is assembled from its float64 bit fields (not
    ``ldexp``, which a GPU evaluates through ``pow``: a last-bit difference in the ulp figures of
    a comparison made there). Non-finite inputs give NaN.
    """
    check_tensor("ulp", "x", x)
    p, emin = _check_fmt("ulp", fmt)
    x64 = x.detach().to(torch.float64)
    _, e = torch.frexp(x64.abs())
    expo = torch.clamp(e.to(torch.int64) - 1, min=emin)
    expo = torch.where(x64 == 0, torch.full_like(expo, emin), expo)
    out = _pow2(expo - p)
    return torch.where(torch.isfinite(x64), out, torch.full_like(out, float("nan")))


def rounding_floor(golden: torch.Tensor, fmt: str) -> float:
    """Max over finite entries of half an ulp of ``fmt`` at the golden value: the smallest max-abs
    error a correctly rounded output in ``fmt`` can have."""
    check_tensor("rounding_floor", "golden", golden)
    _check_fmt("rounding_floor", fmt)
    g = golden.detach().to(torch.float64)
    fin = torch.isfinite(g)
    if not bool(fin.any()):
        return 0.0
    return float((0.5 * ulp(g[fin], fmt)).max())


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    idx = []
    for size in reversed(shape):
        idx.append(flat % size if size else 0)
        flat = flat // size if size else 0
    return tuple(reversed(idx))


@dataclass
class NumericReport:
    """Outcome of one comparison of a kernel tensor against a reference tensor.

    Errors are computed in float64 after anomaly positions have been matched and zeroed.
    ``headroom`` is ``min(tolerance / observed)`` over the rules applied (``inf`` if nothing was
    observed, ``< 1`` iff the comparison failed on an element or cosine rule).
    """

    name: str
    passed: bool
    rule: str  # deciding rule: the first failing rule, or the binding rule on a pass
    message: str
    fmt: str
    shape: tuple[int, ...] = ()
    numel: int = 0
    atol: float = 0.0
    rtol: float = 0.0
    cos_tol: float = 0.0
    max_abs: float = 0.0
    max_abs_index: tuple[int, ...] | None = None
    max_abs_values: tuple[float, float] | None = None  # (got, ref) at max_abs_index
    max_rel: float = 0.0
    max_rel_index: tuple[int, ...] | None = None
    max_ulps: float = 0.0
    max_ulps_index: tuple[int, ...] | None = None
    # ulps over the elements where the relative criterion governs (|r| >= atol/rtol): the figure
    # that stays meaningful when some references are near zero (cancellation)
    max_ulps_rel_regime: float = 0.0
    mismatch_count: int = 0
    mismatch_ratio: float = 0.0
    anomaly_mismatch: dict[str, int] = field(default_factory=dict)
    cos_diff: float = 0.0
    headroom: float = math.inf
    headroom_by_rule: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k, v in list(d.items()):
            if isinstance(v, float) and not math.isfinite(v):
                d[k] = repr(v)  # JSON has no inf/nan
            if isinstance(v, tuple):
                d[k] = list(v)
        d["headroom_by_rule"] = {
            k: (v if math.isfinite(v) else repr(v)) for k, v in self.headroom_by_rule.items()
        }
        return d

    def summary(self) -> str:
        s = "PASS" if self.passed else "FAIL"
        return (
            f"{self.name}: {s} [{self.rule}] max_abs={self.max_abs:.3g}@{self.max_abs_index} "
            f"max_rel={self.max_rel:.3g}@{self.max_rel_index} max_ulps({self.fmt})={self.max_ulps:.3g} "
            f"mismatch={self.mismatch_count}/{self.numel} cos_diff={self.cos_diff:.3g} "
            f"headroom={self.headroom:.3g}" + (f" -- {self.message}" if self.message else "")
        )


def _anomaly_masks(t: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"nan": torch.isnan(t), "+inf": torch.isposinf(t), "-inf": torch.isneginf(t)}


def cos_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``1 - 2*sum(a*r)/sum(a^2+r^2)`` in float64 (kernelkit's cosine diff, without its skip).

    In [0, 2]; 0 iff ``a == r``. Both all-zero (denominator 0) gives 0.0 -- callers decide
    separately whether an all-zero reference is acceptable (``compare``'s ``zero_ref``).
    """
    a = got.detach().to(torch.float64)
    r = ref.detach().to(torch.float64)
    den = float(fixed_sum(a * a) + fixed_sum(r * r))  # fixed order: same figure on every host
    if den == 0.0:
        return 0.0
    return 1.0 - 2.0 * float(fixed_sum(a * r)) / den


def compare(
    got: torch.Tensor,
    ref: torch.Tensor,
    *,
    atol: float,
    rtol: float,
    cos_tol: float,
    fmt: str | None = None,
    name: str = "out",
    zero_ref: str = "fail",
    ref_scale: float = 1.0,
    allow: torch.Tensor | None = None,
) -> NumericReport:
    """Judge ``got`` against ``ref`` with the kernelkit rules (module docstring).

    got, ref: tensors of equal shape (any float dtype; compared in float64, on their device).
    atol (absolute units of the tensor), rtol (relative, plain ratio), cos_tol (>= 0).
    fmt: ulp format for the ulp column (default: from ``got.dtype``).
    zero_ref: ``"fail"`` -- a trivially small reference (``sum r^2 < 1e-12``) fails as
        ``degenerate_reference``; ``"exact"`` -- an all-zero reference requires ``got`` to be
        exactly zero everywhere (lonely rows, sink = +inf); a nonzero trivially small reference
        still fails.
    ref_scale: the magnitude unit of the values (finite, > 0; module docstring): the degenerate
        test is ``sum r^2 < 1e-12 * ref_scale**2``.
    allow: float tensor broadcastable to ``ref``, finite and >= 0 (module docstring): the error
        budget subtracted before the element rules.
    A shape mismatch is a failure (rule ``shape``), not an exception: it is a kernel outcome.
    """
    fn = "compare"
    check_tensor(fn, "got", got)
    check_tensor(fn, "ref", ref)
    for arg, v in (("atol", atol), ("rtol", rtol), ("cos_tol", cos_tol)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0) or math.isinf(v):
            fail(fn, arg, "must be a finite number >= 0", v)
    if zero_ref not in ("fail", "exact"):
        fail(fn, "zero_ref", "must be 'fail' or 'exact'", zero_ref)
    if isinstance(ref_scale, bool) or not isinstance(ref_scale, (int, float)) or not (0 < ref_scale < math.inf):
        fail(fn, "ref_scale", "must be a finite number > 0", ref_scale)
    if allow is not None:
        check_tensor(fn, "allow", allow)
        if not allow.dtype.is_floating_point or not bool(torch.isfinite(allow).all()) or bool((allow < 0).any()):
            fail(fn, "allow", "must be a float tensor of finite values >= 0", allow.dtype)
        # broadcasting's rule, spelled out: ``torch.broadcast_shapes`` imports SymPy on its first
        # call (~2 s in each process that judges)
        if not all(a in (1, b) or b == 1 for a, b in zip(reversed(allow.shape), reversed(ref.shape))):
            fail(fn, "allow", f"must broadcast to the reference's shape {tuple(ref.shape)}", tuple(allow.shape))
    fmt = fmt if fmt is not None else format_of(got.dtype)
    _check_fmt(fn, fmt)
    rep = NumericReport(name=name, passed=False, rule=RULE_SHAPE, message="", fmt=fmt,
                        shape=tuple(ref.shape), numel=ref.numel(), atol=float(atol),
                        rtol=float(rtol), cos_tol=float(cos_tol))
    if tuple(got.shape) != tuple(ref.shape):
        rep.message = f"shape {tuple(got.shape)} != reference shape {tuple(ref.shape)}"
        rep.headroom = 0.0
        return rep
    a = got.detach().to(torch.float64).clone()
    r = ref.detach().to(ref.device if ref.device == got.device else got.device, torch.float64).clone()
    # 1. anomaly positions
    ma, mr = _anomaly_masks(a), _anomaly_masks(r)
    for kind in ma:
        diff = int((ma[kind] != mr[kind]).sum())
        if diff:
            rep.anomaly_mismatch[kind] = diff
        a[ma[kind]] = 0.0
        r[mr[kind]] = 0.0
    n_anom = sum(rep.anomaly_mismatch.values())
    # error figures (always computed, for the report)
    abs_err = (a - r).abs()
    rel_err = abs_err / (r.abs() + REL_EPS)
    ulps = abs_err / ulp(r, fmt)
    if allow is not None:  # the element rules judge the error beyond the caller's budget
        beyond = (abs_err - allow.to(abs_err.device, torch.float64)).clamp_(min=0.0)
        abs_j, rel_j = beyond, beyond / (r.abs() + REL_EPS)
    else:
        abs_j, rel_j = abs_err, rel_err
    elem_ok = (abs_j <= atol) | (rel_j <= rtol)
    if rep.numel:
        i = int(abs_err.reshape(-1).argmax())
        rep.max_abs, rep.max_abs_index = float(abs_err.reshape(-1)[i]), _unravel(i, rep.shape)
        rep.max_abs_values = (float(a.reshape(-1)[i]), float(r.reshape(-1)[i]))
        i = int(rel_err.reshape(-1).argmax())
        rep.max_rel, rep.max_rel_index = float(rel_err.reshape(-1)[i]), _unravel(i, rep.shape)
        i = int(ulps.reshape(-1).argmax())
        rep.max_ulps, rep.max_ulps_index = float(ulps.reshape(-1)[i]), _unravel(i, rep.shape)
        regime = r.abs() >= (atol / rtol if rtol > 0 else math.inf)
        rep.max_ulps_rel_regime = float(ulps[regime].max()) if bool(regime.any()) else 0.0
    anomaly_pos = torch.zeros_like(elem_ok)
    for kind in ma:
        anomaly_pos |= ma[kind] != mr[kind]
    rep.mismatch_count = int((~elem_ok | anomaly_pos).sum())
    rep.mismatch_ratio = rep.mismatch_count / rep.numel if rep.numel else 0.0
    rep.cos_diff = cos_diff(a, r)
    # element headroom: the better of the two tolerances, worst element
    with torch.no_grad():
        h_abs = torch.where(abs_j > 0, atol / abs_j, torch.full_like(abs_j, math.inf))
        h_rel = torch.where(rel_j > 0, rtol / rel_j, torch.full_like(rel_j, math.inf))
        h_elem = float(torch.maximum(h_abs, h_rel).min()) if rep.numel else math.inf
    h_cos = cos_tol / rep.cos_diff if rep.cos_diff > 0 else math.inf
    rep.headroom_by_rule = {RULE_ELEMENT: h_elem, RULE_COSINE: h_cos}
    rep.headroom = min(h_elem, h_cos)

    def done(passed: bool, rule: str, message: str) -> NumericReport:
        rep.passed, rep.rule, rep.message = passed, rule, message
        if not passed and rule in (RULE_ANOMALY, RULE_DEGENERATE, RULE_ZERO_OUTPUT, RULE_EXACT_ZERO):
            rep.headroom = 0.0
        return rep

    if n_anom:
        return done(False, RULE_ANOMALY,
                    "NaN/+inf/-inf positions differ: " + ", ".join(f"{k}: {v} positions" for k, v in rep.anomaly_mismatch.items()))
    if rep.numel and not bool(torch.isfinite(ref).any()):
        # nothing finite to compare, and every NaN/+inf/-inf of the output is where the
        # reference has the same one: an exact match (e.g. lse = -inf of a case whose every row
        # attends to nothing), not a case that cannot discriminate
        rep.headroom_by_rule = {RULE_ALL_NON_FINITE: math.inf}
        rep.headroom = math.inf
        return done(True, RULE_ALL_NON_FINITE, "every reference element is NaN/+inf/-inf; the output has the same ones")
    ref_sumsq = float((r * r).sum())
    got_sumsq = float((a * a).sum())
    trivial = TRIVIAL_SUMSQ * float(ref_scale) ** 2
    if ref_sumsq < trivial:
        all_zero_ref = not bool((r != 0).any())
        if zero_ref == "exact" and all_zero_ref:
            if bool((a != 0).any()):
                nz = int((a != 0).sum())
                return done(False, RULE_EXACT_ZERO, f"reference is exactly zero, output has {nz} nonzero entries (max |a| {rep.max_abs:.3g})")
            rep.headroom_by_rule = {RULE_EXACT_ZERO: math.inf}
            rep.headroom = math.inf
            return done(True, RULE_EXACT_ZERO, "reference and output are exactly zero")
        return done(False, RULE_DEGENERATE,
                    f"reference is trivially small (sum r^2 = {ref_sumsq:.3g} < {TRIVIAL_SUMSQ:g} * ref_scale^2 = {trivial:.3g}); "
                    "the case cannot discriminate")
    if got_sumsq == 0.0:
        return done(False, RULE_ZERO_OUTPUT, "output is all zero where the reference is not")
    if rep.mismatch_count:
        return done(False, RULE_ELEMENT,
                    f"{rep.mismatch_count}/{rep.numel} elements exceed both atol={atol:g} and rtol={rtol:g}")
    if rep.cos_diff > cos_tol:
        return done(False, RULE_COSINE, f"cos_diff {rep.cos_diff:.3g} > cos_tol {cos_tol:g}")
    binding = RULE_ELEMENT if h_elem <= h_cos else RULE_COSINE
    return done(True, binding, "")


def exact_equal(got: torch.Tensor, ref: torch.Tensor, *, name: str = "out") -> NumericReport:
    """Bitwise equality of two tensors (same dtype, shape, and bits; NaN payloads compared as
    bits). Used where the contract is bit-exact (RoPE with FMA emulation, bf16 rows)."""
    check_tensor("exact_equal", "got", got)
    check_tensor("exact_equal", "ref", ref)
    fmt = format_of(ref.dtype)
    rep = NumericReport(name=name, passed=False, rule=RULE_SHAPE, message="", fmt=fmt,
                        shape=tuple(ref.shape), numel=ref.numel())
    if tuple(got.shape) != tuple(ref.shape) or got.dtype != ref.dtype:
        rep.message = f"got {got.dtype}{tuple(got.shape)}, expected {ref.dtype}{tuple(ref.shape)}"
        rep.headroom = 0.0
        return rep
    gb, rb = _bits(got), _bits(ref.to(got.device))
    neq = gb != rb
    rep.mismatch_count = int(neq.sum())
    rep.mismatch_ratio = rep.mismatch_count / rep.numel if rep.numel else 0.0
    a, r = got.detach().to(torch.float64), ref.detach().to(got.device, torch.float64)
    fin = torch.isfinite(a) & torch.isfinite(r)
    abs_err = torch.where(fin, (a - r).abs(), torch.zeros_like(a))
    ulps = torch.where(fin, abs_err / ulp(torch.where(fin, r, torch.zeros_like(r)), fmt), torch.zeros_like(a))
    if rep.numel:
        i = int(abs_err.reshape(-1).argmax())
        rep.max_abs, rep.max_abs_index = float(abs_err.reshape(-1)[i]), _unravel(i, rep.shape)
        rep.max_abs_values = (float(a.reshape(-1)[i]), float(r.reshape(-1)[i]))
        i = int(ulps.reshape(-1).argmax())
        rep.max_ulps, rep.max_ulps_index = float(ulps.reshape(-1)[i]), _unravel(i, rep.shape)
    if rep.mismatch_count:
        first = _unravel(int(neq.reshape(-1).nonzero()[0]), rep.shape)
        rep.rule, rep.passed, rep.headroom = "bit_exact", False, 0.0
        rep.message = f"{rep.mismatch_count}/{rep.numel} elements differ in bits; first at {first}"
        return rep
    rep.rule, rep.passed, rep.headroom = "bit_exact", True, math.inf
    return rep


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of ``t`` as an integer tensor (same shape)."""
    t = t.detach().contiguous()
    int_of = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if t.dtype.is_floating_point:
        return t.view(int_of[t.element_size()])
    return t


@dataclass
class ThreeOutputReport:
    """``err(got, golden) <= k * err(same, golden) + floor`` with err = max abs error."""

    name: str
    passed: bool
    rule: str
    message: str
    err_kernel: float
    err_same_precision: float
    k: float
    floor: float
    bound: float
    headroom: float

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, float) and not math.isfinite(v):
                d[k] = repr(v)
        return d


def _max_abs_err(x: torch.Tensor, golden: torch.Tensor) -> tuple[float, int]:
    """Max abs error over entries where both are finite, and the number of anomaly-position
    mismatches (NaN/+inf/-inf sets differ)."""
    a = x.detach().to(torch.float64)
    g = golden.detach().to(a.device, torch.float64)
    ma, mg = _anomaly_masks(a), _anomaly_masks(g)
    mism = sum(int((ma[k] != mg[k]).sum()) for k in ma)
    fin = torch.isfinite(a) & torch.isfinite(g)
    if not bool(fin.any()):
        return 0.0, mism
    return float((a[fin] - g[fin]).abs().max()), mism


def three_output(
    got: torch.Tensor,
    golden: torch.Tensor,
    same_precision: torch.Tensor,
    *,
    k: float,
    floor: float | None = None,
    fmt: str = "bf16",
    name: str = "out",
) -> ThreeOutputReport:
    """The three-output rule (attention.md 7): a kernel may be at most ``k`` times as far from
    the fp64 golden as the same-precision emulation is, plus the output rounding floor.

    golden: fp64 oracle output; same_precision: the oracle in ``bf16_p`` mode (same shape).
    floor: absolute slack (default ``rounding_floor(golden, fmt)``). Anomaly positions of
    ``got`` must equal those of ``golden``.
    """
    fn = "three_output"
    for arg, t in (("got", got), ("golden", golden), ("same_precision", same_precision)):
        check_tensor(fn, arg, t)
    if tuple(same_precision.shape) != tuple(golden.shape):
        fail(fn, "same_precision", "must have the golden's shape", tuple(same_precision.shape))
    if isinstance(k, bool) or not isinstance(k, (int, float)) or not (k >= 1):
        fail(fn, "k", "must be a number >= 1", k)
    if floor is None:
        floor = rounding_floor(golden, fmt)
    if tuple(got.shape) != tuple(golden.shape):
        return ThreeOutputReport(name, False, RULE_SHAPE, f"shape {tuple(got.shape)} != {tuple(golden.shape)}",
                                 math.nan, math.nan, float(k), float(floor), math.nan, 0.0)
    e_k, mism = _max_abs_err(got, golden)
    e_s, _ = _max_abs_err(same_precision, golden)
    bound = k * e_s + floor
    if mism:
        return ThreeOutputReport(name, False, RULE_ANOMALY, f"{mism} anomaly positions differ from the golden",
                                 e_k, e_s, float(k), float(floor), bound, 0.0)
    head = bound / e_k if e_k > 0 else math.inf
    ok = e_k <= bound
    msg = "" if ok else f"err(kernel)={e_k:.3g} > {k:g}*err(same-precision)={e_s:.3g} + floor {floor:.3g}"
    return ThreeOutputReport(name, ok, RULE_THREE_OUTPUT, msg, e_k, e_s, float(k), float(floor), bound, head)


__all__ = [
    "FORMATS", "NumericReport", "ThreeOutputReport", "compare", "cos_diff", "exact_equal",
    "format_of", "rounding_floor", "three_output", "ulp", "InputError",
]
