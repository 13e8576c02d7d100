"""Tolerance records: derived, scoped, and guarded against unscoped loosening.

A record (``Tol``) says how a kernel's numeric output is judged (attention.md 4.2 metric, tiers of
attention.md 7):

* metric ``"kernelkit"``: ``atol`` (``atol_unit="abs"``: units of the output; ``"vrms"``: units of
  the case's RMS of the referenced V rows -- attention outputs and their rounding errors scale
  exactly with V, so a bound derived at one value scale transfers to another),
  ``rtol = rtol_ulps * 2**-p`` with ``p`` the fraction bits of ``rtol_format`` (bf16:
  ``rtol_ulps / 128``), ``cos_tol``; optionally ``logit_ulps`` (softmax statistics: a per-row error
  budget ``logit_ulps * 2**-23 * F`` on top of ``atol`` / ``rtol``, ``F`` the row's logit scale of
  ``row_scale.logit_scale``: the fp32 logit chain's error grows with the row's logit magnitude,
  not with the statistic's value);
* metric ``"block_scale"`` (tier C, FP8 output epilogues): element bound
  ``|deq - ref| <= block_mult * 2**(s - 127)`` with ``s`` the block's UE8M0 byte.

Every record states how it was ``derived`` (from the reference only, never from kernel output),
the ``measured`` reference figures it was derived from, the ``margin`` applied, and what the
kernel authors use (``authors``) for comparison.

The shipped records are ``tolerances.jsonl`` (written by ``derive.py``) plus any sibling
``tolerances_*.jsonl`` (a family's own derived records, e.g. ``tolerances_mla.jsonl``), validated
together by ``default_tolerances()``. A file holds three kinds of line (``"kind"``):

* ``"default"`` -- the tier default of one (tier, output); scope must be all-wildcard. A default
  may not be looser than the tier ceiling of attention.md 7 (``TIER_CEILINGS`` below).
* ``"assign"`` -- puts the kernels matching a scope into a tier (most specific assignment wins;
  kernels with no assignment are tier A, the strictest numeric tier).
* ``"override"`` -- a scoped record for some kernels/outputs/dtypes/archs/configs. An override
  looser than its tier's default must name the kernel(s) or the architecture it loosens
  (``scope.kernel`` or ``scope.arch`` not ``"*"``; e.g. ``derive --arch`` records) and give a
  ``reason``; otherwise the file is rejected at load (``InputError``).

Lookup (``Tolerances.lookup``): the kernel's tier (its most specific assignment, else A), then
the most specific matching override *of that tier*, else the tier's default. An override that
names the kernel but carries another tier is a conflict (``InputError``), never silently skipped. Specificity counts scope fields: an exact value scores 2, a glob
(``fnmatch``) 1, ``"*"`` 0, plus one per config predicate key; ties go to the earlier line.
"""

from __future__ import annotations

import fnmatch
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from dsv4_numerics.reference.constants import E4M3_MAX
from dsv4_numerics.reference.errors import InputError, fail

from .numeric import FORMATS

DEFAULT_PATH = Path(__file__).with_name("tolerances.jsonl")
TIERS = ("A", "B", "C")
METRICS = ("kernelkit", "block_scale")
ATOL_UNITS = ("abs", "vrms")
SCOPE_FIELDS = ("kernel", "output", "dtype", "arch")


def half_e4m3_step_at_top() -> float:
    """Half the E4M3FN quantum in the top binade ``[256, 448]``, in units of the block scale:
    ``2**(floor(log2 448) - 3) / 2 = 16`` (attention.md 7 tier C: ``16 * 2**(e - 127)``)."""
    top_binade = math.frexp(E4M3_MAX)[1] - 1  # 448 = 1.75 * 2**8 -> 8 (exact, frexp)
    return math.ldexp(1.0, top_binade - FORMATS["e4m3"][0] - 1)


# Tier ceilings: the proposal of attention.md 7, the loosest a tier DEFAULT may be.
# (tier, output) -> limits. rtol given as a plain ratio.
# ``atol_vrms``: the same absolute ceiling expressed per unit of V's RMS at the domain it was set
# for (FlashMLA's V ~ N(0, 0.1^2): RMS 0.1), used for records with ``atol_unit = "vrms"``.
FLASHMLA_V_RMS = 0.1
TIER_CEILINGS: dict[tuple[str, str], dict[str, float]] = {
    # Tier A: out abs 1e-3, rel 3.01/128, cos 1e-5; lse/max_logits abs 1e-5, rel 1.3e-4.
    ("A", "out"): {"atol": 1e-3, "atol_vrms": 1e-3 / FLASHMLA_V_RMS, "rtol": 3.01 / 128, "cos_tol": 1e-5},
    ("A", "lse"): {"atol": 1e-5, "rtol": 1.3e-4, "cos_tol": 1e-5},
    ("A", "max_logits"): {"atol": 1e-5, "rtol": 1.3e-4, "cos_tol": 1e-5},
    # Tier B: atol = rtol = 5e-2 (SM120 authors), cos 1e-3 [proposal].
    ("B", "out"): {"atol": 5e-2, "atol_vrms": 5e-2 / FLASHMLA_V_RMS, "rtol": 5e-2, "cos_tol": 1e-3},
    ("B", "lse"): {"atol": 5e-2, "rtol": 5e-2, "cos_tol": 1e-3},
    # Compressor fp32 normed rows (H7): the spec gives no number; the ceiling is 2**-12 relative
    # (256 fp32 ulps; far above the <= 2-ulp rsqrt differences of datapath 5.1) so a default can
    # never drift to a value that hides a wrong reduction.
    ("A", "normed"): {"atol": 1e-3, "rtol": 2.0**-12, "cos_tol": 1e-9},
    # Tier C: half an e4m3 step at the top of the block range, times the block scale.
    ("C", "deq"): {"block_mult": half_e4m3_step_at_top()},
}


@dataclass(frozen=True)
class Scope:
    """Where a record applies. Fields are exact names, ``fnmatch`` globs, or ``"*"``.

    kernel: an entry's ``tolerance_scope``; output: output tensor name (``out``, ``lse``,
    ``max_logits``, ``deq``); dtype: the kernel output dtype (``bf16``, ``fp32``, ``e4m3``);
    arch: ``sm90``/``sm100``/``sm120``/``gfx942``/``gfx950``/``cpu``; config: predicate over a
    case's ``params`` -- ``{key: value}`` (equality), ``{key: [v1, v2]}`` (membership) or
    ``{key: {"min": a, "max": b}}`` (inclusive range). A missing param never matches.
    """

    kernel: str = "*"
    output: str = "*"
    dtype: str = "*"
    arch: str = "*"
    config: tuple[tuple[str, Any], ...] = ()

    @staticmethod
    def from_dict(d: dict[str, Any] | None) -> "Scope":
        d = dict(d or {})
        unknown = set(d) - set(SCOPE_FIELDS) - {"config"}
        if unknown:
            fail("Scope.from_dict", "scope", f"has unknown fields {sorted(unknown)}; allowed {list(SCOPE_FIELDS) + ['config']}")
        for f in SCOPE_FIELDS:
            if not isinstance(d.get(f, "*"), str) or d.get(f, "*") == "":
                fail("Scope.from_dict", f"scope.{f}", "must be a non-empty string", d.get(f))
        cfg = d.get("config") or {}
        if not isinstance(cfg, dict):
            fail("Scope.from_dict", "scope.config", "must be a JSON object", cfg)
        items = tuple(sorted((k, _freeze(v)) for k, v in cfg.items()))
        return Scope(*(d.get(f, "*") for f in SCOPE_FIELDS), config=items)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {f: getattr(self, f) for f in SCOPE_FIELDS}
        if self.config:
            d["config"] = {k: _thaw(v) for k, v in self.config}
        return d

    @property
    def is_wildcard(self) -> bool:
        return all(getattr(self, f) == "*" for f in SCOPE_FIELDS) and not self.config

    def specificity(self) -> int:
        s = 0
        for f in SCOPE_FIELDS:
            v = getattr(self, f)
            w = 0 if v == "*" else (1 if any(c in v for c in "*?[") else 2)
            s += 2 * w if f == "kernel" else w
        return s + len(self.config)

    def matches(self, kernel: str, output: str, dtype: str, arch: str, params: dict | None) -> bool:
        query = {"kernel": kernel, "output": output, "dtype": dtype, "arch": arch}
        for f in SCOPE_FIELDS:
            pat = getattr(self, f)
            if pat != "*" and not fnmatch.fnmatchcase(query[f], pat):
                return False
        params = params or {}
        for key, want in self.config:
            if key not in params:
                return False
            if not _pred(_thaw(want), params[key]):
                return False
        return True


def _freeze(v: Any) -> Any:
    if isinstance(v, dict):
        return ("__dict__",) + tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    if isinstance(v, list):
        return ("__list__",) + tuple(_freeze(x) for x in v)
    return v


def _thaw(v: Any) -> Any:
    if isinstance(v, tuple) and v and v[0] == "__dict__":
        return {k: _thaw(x) for k, x in v[1:]}
    if isinstance(v, tuple) and v and v[0] == "__list__":
        return [_thaw(x) for x in v[1:]]
    return v


def _pred(want: Any, got: Any) -> bool:
    if isinstance(want, list):
        return got in want
    if isinstance(want, dict):
        try:
            lo, hi = want.get("min", -math.inf), want.get("max", math.inf)
            return lo <= got <= hi
        except TypeError:
            return False
    return got == want


@dataclass(frozen=True)
class Tol:
    """One tolerance record (module docstring). ``rtol`` is derived from ``rtol_ulps`` and
    ``rtol_format``; ``block_mult`` is used by the ``block_scale`` metric only."""

    kind: str
    tier: str
    scope: Scope
    metric: str = "kernelkit"
    atol: float = 0.0
    atol_unit: str = "abs"
    rtol_ulps: float = 0.0
    rtol_format: str = "bf16"
    cos_tol: float = 0.0
    block_mult: float = 0.0
    three_output_k: float | None = None
    logit_ulps: float = 0.0
    derived: str = ""
    measured: dict[str, Any] = field(default_factory=dict)
    margin: float | None = None
    authors: str = ""
    reason: str = ""
    line: int = 0  # 1-based line in the source file (0 = built in code)

    @property
    def rtol(self) -> float:
        return self.rtol_ulps * math.ldexp(1.0, -FORMATS[self.rtol_format][0])

    def limits(self) -> dict[str, float]:
        if self.metric == "block_scale":
            return {"block_mult": self.block_mult}
        akey = "atol" if self.atol_unit == "abs" else f"atol_{self.atol_unit}"
        lim = {akey: self.atol, "rtol": self.rtol, "cos_tol": self.cos_tol}
        if self.logit_ulps:
            lim["logit_ulps"] = self.logit_ulps
        return lim

    def atol_for(self, vrms: float | None) -> float:
        """The absolute tolerance for a case whose referenced V rows have RMS ``vrms``."""
        if self.atol_unit == "abs":
            return self.atol
        if vrms is None or not math.isfinite(vrms) or vrms < 0:
            fail("Tol.atol_for", "vrms", "must be a finite number >= 0 for an atol in units of V's RMS", vrms)
        return self.atol * vrms

    def looser_than(self, other: "Tol | dict[str, float]") -> list[str]:
        """Names of the limits in which this record is looser than ``other``."""
        lim = other.limits() if isinstance(other, Tol) else other
        mine = self.limits()
        return [k for k, v in lim.items() if k in mine and mine[k] > v * (1 + 1e-12)]

    def comparable_to(self, other: "Tol") -> bool:
        return self.metric == other.metric and self.atol_unit == other.atol_unit

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["scope"] = self.scope.to_dict()
        d.pop("line")
        if not d.get("logit_ulps"):
            d.pop("logit_ulps")
        if self.metric == "block_scale":
            for k in ("atol", "atol_unit", "rtol_ulps", "rtol_format", "cos_tol"):
                d.pop(k)
        else:
            d.pop("block_mult")
        return {k: v for k, v in d.items() if v not in (None, "", {})}

    def describe(self) -> str:
        lim = ", ".join(f"{k}={v:.4g}" for k, v in self.limits().items())
        return f"tier {self.tier} {self.kind} {self.scope.to_dict()} [{lim}] (line {self.line})"


_TOL_KEYS = {f for f in Tol.__dataclass_fields__} - {"line"}


def _parse(d: dict[str, Any], line: int, src: str) -> Tol:
    fn = "Tolerances.load"
    where = f"{src}:{line}"
    if not isinstance(d, dict):
        fail(fn, where, "must be a JSON object")
    unknown = set(d) - _TOL_KEYS
    if unknown:
        fail(fn, where, f"has unknown keys {sorted(unknown)}")
    kind = d.get("kind")
    if kind not in ("default", "assign", "override"):
        fail(fn, f"{where} kind", "must be 'default', 'assign' or 'override'", kind)
    tier = d.get("tier")
    if tier not in TIERS:
        fail(fn, f"{where} tier", f"must be one of {TIERS}", tier)
    metric = d.get("metric", "kernelkit")
    if metric not in METRICS:
        fail(fn, f"{where} metric", f"must be one of {METRICS}", metric)
    if d.get("atol_unit", "abs") not in ATOL_UNITS:
        fail(fn, f"{where} atol_unit", f"must be one of {ATOL_UNITS}", d.get("atol_unit"))
    rf = d.get("rtol_format", "bf16")
    if rf not in FORMATS:
        fail(fn, f"{where} rtol_format", f"must be one of {sorted(FORMATS)}", rf)
    for k in ("atol", "rtol_ulps", "cos_tol", "block_mult", "logit_ulps"):
        v = d.get(k, 0.0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0) or math.isinf(v):
            fail(fn, f"{where} {k}", "must be a finite number >= 0", v)
    k3 = d.get("three_output_k")
    if k3 is not None and (not isinstance(k3, (int, float)) or k3 < 1):
        fail(fn, f"{where} three_output_k", "must be a number >= 1", k3)
    scope = Scope.from_dict(d.get("scope"))
    if kind == "default" and not (scope.kernel == "*" and scope.dtype == "*"
                                                        and scope.arch == "*" and not scope.config):
        fail(fn, f"{where} scope", "of a 'default' record may name only the output (everything else '*')", scope.to_dict())
    if kind in ("default", "override") and scope.output == "*":
        fail(fn, f"{where} scope.output", f"must name the output of a '{kind}' record")
    if kind != "assign" and not d.get("derived"):
        fail(fn, f"{where} derived", "must say how the values were derived (from the reference only)")
    fields = {k: v for k, v in d.items() if k in _TOL_KEYS and k != "scope"}
    fields["scope"] = scope
    return Tol(line=line, **fields)


class Tolerances:
    """A validated set of tolerance records with most-specific-first lookup."""

    def __init__(self, records: Iterable[Tol], source: str = "<records>"):
        self.source = source
        self.records = list(records)
        self.defaults: dict[tuple[str, str], Tol] = {}
        self.assigns: list[Tol] = []
        self.overrides: list[Tol] = []
        for r in self.records:
            if r.kind == "default":
                key = (r.tier, r.scope.output)
                if key in self.defaults:
                    fail("Tolerances", f"{source}:{r.line}", f"duplicates the tier {r.tier} default for output '{r.scope.output}' (line {self.defaults[key].line})")
                ceiling = TIER_CEILINGS.get(key)
                if ceiling is None:
                    fail("Tolerances", f"{source}:{r.line}", f"has no tier ceiling for (tier {r.tier}, output '{r.scope.output}'); known {sorted(TIER_CEILINGS)}")
                loose = r.looser_than(ceiling)
                if loose:
                    fail("Tolerances", f"{source}:{r.line}", f"is a tier {r.tier} default looser than the attention.md 7 ceiling in {loose} ({r.limits()} vs {ceiling})")
                self.defaults[key] = r
            elif r.kind == "assign":
                self.assigns.append(r)
            else:
                self.overrides.append(r)
        seen: dict[tuple, int] = {}
        for r in self.overrides + self.assigns:
            key = (r.kind, r.tier if r.kind == "override" else "", r.scope)
            if key in seen:
                fail("Tolerances", f"{source}:{r.line}", f"repeats the scope of line {seen[key]}")
            seen[key] = r.line
        for r in self.overrides:
            base = self.defaults.get((r.tier, r.scope.output))
            if base is None:
                fail("Tolerances", f"{source}:{r.line}", f"overrides (tier {r.tier}, output '{r.scope.output}') which has no default record")
            if not r.comparable_to(base):
                fail("Tolerances", f"{source}:{r.line}", f"uses metric '{r.metric}' / atol_unit '{r.atol_unit}' but its tier "
                     f"default uses '{base.metric}' / '{base.atol_unit}' (an override must be comparable to its default)")
            loose = r.looser_than(base)
            if loose and r.scope.kernel == "*" and r.scope.arch == "*":
                fail("Tolerances", f"{source}:{r.line}",
                     f"is an unscoped loosening: looser than the tier {r.tier} default in {loose} with a wildcard kernel and "
                     "arch scope; an override must name the kernel(s) or the architecture it loosens")
            if loose and not r.reason:
                fail("Tolerances", f"{source}:{r.line}", f"loosens {loose} for kernel {r.scope.kernel} / arch {r.scope.arch} without a 'reason'")

    @classmethod
    def load(cls, path: str | Path = DEFAULT_PATH) -> "Tolerances":
        """Parse and validate a JSONL file (blank lines and lines starting with ``#`` ignored)."""
        return cls.load_many([path])

    @classmethod
    def load_many(cls, paths: Iterable[str | Path]) -> "Tolerances":
        """Parse several JSONL files and validate their records *together* (an override in one
        file is checked against the tier defaults of another)."""
        recs, names = [], []
        for path in paths:
            path = Path(path)
            if not path.is_file():
                fail("Tolerances.load", "path", "must be an existing file", str(path))
            names.append(path.name)
            for i, raw in enumerate(path.read_text().splitlines(), start=1):
                s = raw.strip()
                if not s or s.startswith("#"):
                    continue
                try:
                    d = json.loads(s)
                except json.JSONDecodeError as e:
                    fail("Tolerances.load", f"{path.name}:{i}", f"must be valid JSON ({e.msg})")
                recs.append(_parse(d, i, path.name))
        return cls(recs, source="+".join(names))

    @classmethod
    def from_dicts(cls, dicts: Iterable[dict[str, Any]], source: str = "<dicts>") -> "Tolerances":
        return cls([_parse(d, i, source) for i, d in enumerate(dicts, start=1)], source=source)

    def tier_of(self, kernel: str, dtype: str = "*", arch: str = "*", params: dict | None = None,
                output: str = "*") -> str:
        """Tier of a kernel: the most specific matching assignment, else ``"A"``."""
        best = self._best(self.assigns, kernel, output, dtype, arch, params)
        return best.tier if best is not None else "A"

    @staticmethod
    def _best(recs: list[Tol], kernel: str, output: str, dtype: str, arch: str, params: dict | None) -> Tol | None:
        hits = [r for r in recs if r.scope.matches(kernel, output, dtype, arch, params)]
        if not hits:
            return None
        top = max(h.scope.specificity() for h in hits)
        return min((h for h in hits if h.scope.specificity() == top), key=lambda h: h.line)

    def lookup(self, kernel: str, output: str, dtype: str = "*", arch: str = "*",
               params: dict | None = None) -> Tol:
        """The record that judges ``output`` of ``kernel`` (most specific override, else the
        default of the kernel's tier). Raises ``InputError`` if no record applies."""
        for arg, v in (("kernel", kernel), ("output", output), ("dtype", dtype), ("arch", arch)):
            if not isinstance(v, str) or not v:
                fail("Tolerances.lookup", arg, "must be a non-empty string", v)
        tier = self.tier_of(kernel, dtype, arch, params, output)
        clash = [r for r in self.overrides if r.tier != tier and r.scope.kernel != "*"
                 and r.scope.matches(kernel, output, dtype, arch, params)]
        if clash:
            fail("Tolerances.lookup", "kernel", f"'{kernel}' is assigned tier {tier} but the override at line "
                 f"{clash[0].line} names it with tier {clash[0].tier}; add an 'assign' record or fix the override")
        best = self._best([r for r in self.overrides if r.tier == tier], kernel, output, dtype, arch, params)
        if best is not None:
            return best
        d = self.defaults.get((tier, output))
        if d is None:
            fail("Tolerances.lookup", "output", f"has no tier {tier} default record (kernel {kernel}); known outputs: {sorted(o for t, o in self.defaults if t == tier)}", output)
        return d


_CACHE: dict[str, Tolerances] = {}


def shipped_paths() -> list[Path]:
    """``tolerances.jsonl`` then every sibling ``tolerances_*.jsonl`` (e.g. the MLA family's), sorted."""
    return [DEFAULT_PATH] + sorted(DEFAULT_PATH.parent.glob("tolerances_*.jsonl"))


def default_tolerances() -> Tolerances:
    """The shipped records (``shipped_paths``), loaded and validated together, once."""
    paths = shipped_paths()
    key = "|".join(map(str, paths))
    if key not in _CACHE:
        _CACHE[key] = Tolerances.load_many(paths)
    return _CACHE[key]


__all__ = ["DEFAULT_PATH", "InputError", "Scope", "TIER_CEILINGS", "Tol", "Tolerances",
           "default_tolerances", "half_e4m3_step_at_top", "shipped_paths"]
