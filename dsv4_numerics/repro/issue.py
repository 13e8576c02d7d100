"""``ISSUE.md``: the bug report a maintainer can paste, written beside ``repro.py``.

It states the op and the package version, the architecture, the contract the op breaks (the
policy's documented rule, with the citation into the producer's own source that
``reference/policies.py`` and the adapter's docstring hold), what the op does instead (the named
policy describing it, the judge's verdict on the reduced case and the reproducer's own output),
how many bytes or elements it moves on the stage's default cases, and the one command to run.
"""

from __future__ import annotations

import platform
import re
from typing import Any

import torch

from dsv4_numerics.kernels.registry import POLICY_ENUMS


def policy_text(key: str, value: str) -> str:
    """The documentation of policy ``key``'s member ``value``: its paragraph of the enum's
    docstring (``reference.policies``), joined into one line; ``""`` when none."""
    enum = POLICY_ENUMS.get(key)
    if enum is None:
        return ""
    member = next((m for m in enum if m.value == value), None)
    doc = enum.__doc__ or ""
    if member is None:
        return ""
    m = re.search(rf"^\s*{member.name}:(.*?)(?=^\s*[A-Z0-9_]+:|\Z)", doc, re.S | re.M)
    return " ".join(m.group(1).split()) if m else ""


def departures(declared: dict[str, str], judged: dict[str, str]) -> list[tuple[str, str, str]]:
    """``(key, contract value, the op's value)`` for each policy the reproducer judges differently
    from the kernel's declaration."""
    keys = sorted(set(declared) | set(judged))
    return [(k, judged.get(k, "(stage default)"), declared.get(k, "(stage default)")) for k in keys
            if declared.get(k) != judged.get(k)]


def render(info: dict[str, Any]) -> str:
    """The text of ISSUE.md from the facts ``dsv4_numerics.repro`` gathered (keys used below)."""
    lines = [f"# {info['op']}: {info['title']}", ""]
    lines += [
        f"- op: `{info['op']}` ({info['source']})",
        f"- package: {info['version'] or 'version unknown'}",
        f"- architecture: {info['arch']} ({platform.machine()}, {platform.system()}); torch {torch.__version__}",
        f"- found by: dsv4-numerics, stage `{info['stage']}`, case `{info['case']}` reduced "
        f"({info['size_before']['bytes']} -> {info['size_after']['bytes']} bytes of inputs)",
        "",
        "## Expected behaviour (the contract)",
        "",
    ]
    if info["departures"]:
        for key, contract, actual in info["departures"]:
            ctext = policy_text(key, contract)
            lines.append(f"- `{key}`: **{contract}**" + (f" -- {ctext}" if ctext else ""))
    else:
        lines.append(f"- the stage's reference under the op's own declared behaviour ({policies_text(info['judged'])}); "
                     "the op fails it")
    if info.get("notes"):
        lines += ["", f"Adapter notes: {info['notes']}"]
    lines += ["", "## What the op does instead", ""]
    for key, contract, actual in info["departures"]:
        atext = policy_text(key, actual)
        lines.append(f"- `{key}={actual}`" + (f" -- {atext}" if atext else ""))
    lines += [
        "",
        f"On the reduced case the judge says: `{info['rule']}` -- {info['message']}",
        "",
        "## How much it moves on the default cases",
        "",
    ]
    if info["impact"]:
        lines += ["| case | rule | differing |", "| --- | --- | --- |"]
        lines += [f"| {c} | `{r}` | {n} |" for c, r, n in info["impact"]]
        lines.append(f"\n{info['impact_failed']} of {info['impact_total']} default cases fail; "
                     f"{info['impact_count']} {info['impact_unit']} differ in all.")
    else:
        lines.append(f"none of the {info['impact_total']} default cases fails (this finding needs the case above).")
    if info.get("releases"):
        lines += ["", "## Releases", "", info["releases"]]
    lines += [
        "",
        "## Reproduce",
        "",
        "```",
        info["command"],
        "```",
        "",
        f"`repro.py` ({info['lines']} lines) needs torch, safetensors and {info['dist'] or 'the package'}; "
        f"the inputs ({info['input_bytes']} bytes) are in `inputs.safetensors`. It exits 1 while the divergence "
        "is present, 0 once fixed.",
        "",
        "Its output here:",
        "",
        "```",
        info["output"].rstrip() or "(not run here)",
        "```",
        "",
    ]
    return "\n".join(lines)


def policies_text(p: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(p.items())) or "stage defaults"


__all__ = ["departures", "policy_text", "render"]
