"""MkDocs hook: the pages that are generated from the code, so they cannot drift from it.

* ``<!-- generated: cli-reference -->`` becomes the reference of every ``dsv4-numerics`` command,
  walked from the argparse parser of :mod:`dsv4_numerics.cli` (``build_parser``) and its
  sub-parsers.
* ``<!-- generated: policy-catalogue -->`` becomes the catalogue of named policies: every policy
  key an entry or a stage can declare, each value with what it does to the bits (the enum's own
  docstring in ``reference/policies.py``), the built-in entries that declare it (read from the
  assembled kernel registry) and the stages whose ``explain`` searches it. A value without a
  description, or a policy key an entry declares that the catalogue does not know, fails the build.

The functions are importable on their own (``tests/docs/test_docs_build.py`` calls them).
"""

from __future__ import annotations

import argparse
import html
import importlib
import inspect
import os
import re
import shutil
from pathlib import Path

CLI_MARK = "<!-- generated: cli-reference -->"
POLICY_MARK = "<!-- generated: policy-catalogue -->"


def _cell(text: str) -> str:
    """Text for one markdown table cell: one line, pipes escaped, HTML-escaped outside code spans."""
    text = " ".join(str(text).split())
    parts = re.split(r"(``.+?``|`[^`]+`)", text)
    out = []
    for i, p in enumerate(parts):
        out.append(p if i % 2 else html.escape(p, quote=False))
    return "".join(out).replace("|", "\\|")


# --------------------------------------------------------------------------- CLI reference


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    out = []
    for action in parser._actions:  # noqa: SLF001 - argparse keeps its actions there
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            helps = {a.dest: (a.help or "") for a in action._choices_actions}  # noqa: SLF001
            for name, sub in action.choices.items():
                out.append((name, sub, helps.get(name, "")))
    return out


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    fmt = parser._get_formatter()  # noqa: SLF001
    rows = []
    for a in parser._actions:  # noqa: SLF001
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):  # noqa: SLF001
            continue
        if a.help == argparse.SUPPRESS:
            continue
        if a.option_strings:
            metavar = fmt._format_args(a, a.dest.upper()) if a.nargs != 0 else ""  # noqa: SLF001
            name = ", ".join(f"`{o}{' ' + metavar if metavar else ''}`" for o in a.option_strings)
        else:
            name = f"`{fmt._metavar_formatter(a, a.dest)(1)[0]}`"  # noqa: SLF001
            if a.nargs in ("*", "?"):
                name += " (optional)"
            elif a.nargs == "+":
                name += " (one or more)"
        help_text = fmt._expand_help(a) if a.help else ""  # noqa: SLF001
        extra = []
        if a.choices is not None and not isinstance(a.choices, dict):
            extra.append("choices: " + ", ".join(f"`{c}`" for c in a.choices))
        if isinstance(a, argparse._AppendAction) and "repeatable" not in (a.help or ""):  # noqa: SLF001
            extra.append("repeatable")
        cell = _cell(help_text) or "-"
        if extra:
            cell += " (" + "; ".join(extra) + ")"
        rows.append(f"| {name} | {cell} |")
    return rows


def _command_section(path: list[str], parser: argparse.ArgumentParser, summary: str, level: int) -> list[str]:
    title = " ".join(path)
    lines = [f"{'#' * level} `{title}`", ""]
    if summary:
        lines += [_cell(summary[0].upper() + summary[1:]) + ".", ""]
    usage = parser.format_usage().strip()
    usage = re.sub(r"^usage:\s*", "", usage)
    lines += ["```text", usage, "```", ""]
    if parser.description and parser.description.strip() != summary.strip():
        lines += [_cell(parser.description), ""]
    rows = _option_rows(parser)
    if rows:
        lines += ["| argument | meaning |", "|---|---|", *rows, ""]
    if parser.epilog:
        lines += ["```text", parser.epilog.strip("\n"), "```", ""]
    for name, sub, help_text in _subparsers(parser):
        lines += _command_section([*path, name], sub, help_text, min(level + 1, 4))
    return lines


def cli_reference_markdown() -> str:
    """The reference of every command and option, walked from the argparse parser (usage lines
    wrapped at 100 columns whatever the terminal, so the page is the same on every machine)."""
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        return _cli_reference_markdown()
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved


def _cli_reference_markdown() -> str:
    cli = importlib.import_module("dsv4_numerics.cli")
    parser = cli.build_parser()
    parser.prog = "dsv4-numerics"
    lines = ["## `dsv4-numerics`", "", _cell(parser.description or ""), "", "```text",
             re.sub(r"^usage:\s*", "", parser.format_usage().strip()), "```", ""]
    rows = _option_rows(parser)
    if rows:
        lines += ["| argument | meaning |", "|---|---|", *rows, ""]
    lines += ["| command | what it does |", "|---|---|"]
    subs = _subparsers(parser)
    for name, _sub, help_text in subs:
        lines.append(f"| [`{name}`](#dsv4-numerics-{name}) | {_cell(help_text)} |")
    lines.append("")
    for name, sub, help_text in subs:
        lines += _command_section(["dsv4-numerics", name], sub, help_text, 2)
    return "\n".join(lines)


# --------------------------------------------------------------------------- policy catalogue

# Keys whose values are free-form or adapter-level (not an enum of reference/policies.py): what
# each means. An entry declaring a key that is neither here nor an enum fails the build.
FREE_FORM_KEYS: dict[str, str] = {
    "fp8_clamp": "a positive float: the largest magnitude the writer stores before FP8 encoding "
                 "(`224.0`: the gfx942 E4M3FNUZ SWA writer)",
    "writer_rope": "`identity`: the adapter feeds the canonical pre-roped rows through an identity "
                   "RoPE table, so the expected bytes are those of `apply_rope(k, identity, rope_arith)`; "
                   "`identity_all`: the V4.1 `rope_quant_insert` kernels, which rotate all 256 pairs and "
                   "quantise the fp32 result",
    "round_to_bf16_first": "`true` / `false`: a plain FP8 row writer rounds its input to bf16 before the "
                           "per-tensor FP8 encode",
    "output_inv_roped": "`true`: the kernel returns the attention output inverse-roped, so the expected "
                        "`out` is inverse-roped (the case needs `positions` and `cos_sin`)",
    "fp8_q": "`true`: the kernel is fed per-tensor E4M3 q rows with scale 1.0, and the oracle the same "
             "FP8-rounded values",
    "fp8_kv": "`true`: the same for the KV rows",
    "fp8_output": "`true`: the kernel writes an FP8 output (the RopeQuant epilogue); the adapter "
                  "returns it decoded",
    # descriptive labels: recorded with the entry (and in its Results); no stage reads them
    "index_form": "label: the production index layout the adapter builds (`dense` / `ragged`)",
    "ragged": "label: how a ragged index builder lays out a row (`compacting` / `positional`)",
    "topk_lens": "label: how the builder reports per-row top-k lengths (`count`)",
    "combine_form": "label: which prefill combine the builder is (`common` vLLM, `rocm`, `sglang`)",
    "dispatch": "label: which branch of the production wrapper the adapter drives (`default`, `gfx942` split-K)",
    "plain_layout": "label: the row format of a full-cache writer (`bf16`, `fp8`)",
    "arch_specific": "label: `true` where the kernel exists for one architecture only",
    "scale_layout": "label: the scale layout the op returns (`sm90_fp32`, `sm100_packed_ue8m0`), "
                    "converted by the adapter",
}


def _member_descriptions(enum: type) -> dict[str, str]:
    doc = inspect.getdoc(enum) or ""
    desc: dict[str, list[str]] = {}
    current = None
    head = re.compile(r"^([A-Z][A-Z0-9_]+)(?:\s*\(([^)]*)\))?:\s*(.*)$")
    for line in doc.splitlines():
        m = head.match(line)
        if m and m.group(1) in enum.__members__:
            current = m.group(1)
            alias = f"({m.group(2)}) " if m.group(2) else ""
            desc[current] = [alias + m.group(3)]
        elif current and line.startswith((" ", "\t")) and line.strip():
            desc[current].append(line.strip())
        elif not line.strip() or not line.startswith((" ", "\t")):
            current = None if not line.strip() or head.match(line) is None else current
    return {k: " ".join(v) for k, v in desc.items()}


def _preamble(enum: type) -> str:
    doc = inspect.getdoc(enum) or ""
    out = []
    for line in doc.splitlines():
        m = re.match(r"^([A-Z][A-Z0-9_]+)(?:\s*\([^)]*\))?:", line)
        if m and m.group(1) in enum.__members__:
            break
        out.append(line)
    return " ".join(" ".join(out).split())


def _policy_enums() -> dict[str, type]:
    registry = importlib.import_module("dsv4_numerics.kernels.registry")
    pol = importlib.import_module("dsv4_numerics.reference.policies")
    enums = dict(registry.POLICY_ENUMS)
    # enum-valued keys the stages read that the registry leaves unchecked
    enums.setdefault("nvfp4_rule", pol.Nvfp4ScaleRule)
    enums.setdefault("indexer_k_scale", pol.IndexerKScale)
    enums.setdefault("v32_scale_decode", pol.V32ScaleDecode)
    return enums


def policy_catalogue_markdown() -> str:
    """The catalogue of named policies, generated from the enums and the kernel registry."""
    registry = importlib.import_module("dsv4_numerics.kernels.registry")
    search = importlib.import_module("dsv4_numerics.api.policy_search")
    enums = _policy_enums()
    entries = registry.all_entries()
    declared: dict[tuple[str, str], list[str]] = {}
    for e in entries:
        for k, v in e.policies.items():
            v = v.value if hasattr(v, "value") else str(v)
            declared.setdefault((k, v), []).append(e.name)
    unknown = sorted({k for (k, _v) in declared} - set(enums) - set(FREE_FORM_KEYS))
    if unknown:
        raise RuntimeError(f"policy catalogue: entries declare keys the catalogue does not describe: {unknown} "
                           "(add them to FREE_FORM_KEYS in docs/_hooks/generate.py, or give them an enum)")
    searched: dict[str, list[str]] = {}
    for stage, axes in search.AXES.items():
        for _label, alternatives in axes:
            for key in {k for alt in alternatives for k in alt}:
                searched.setdefault(key, [])
                if stage not in searched[key]:
                    searched[key].append(stage)

    def names(key: str, value: str) -> str:
        got = sorted(declared.get((key, value), []))
        return ", ".join(f"`{n}`" for n in got) if got else "-"

    lines = ["| key | enum | values | `explain` searches it on |", "|---|---|---|---|"]
    for key, enum in enums.items():
        vals = ", ".join(f"`{m.value}`" for m in enum)
        st = ", ".join(f"`{s}`" for s in searched.get(key, [])) or "-"
        lines.append(f"| [`{key}`](#{key}) | `{enum.__name__}` | {vals} | {st} |")
    lines.append("")
    for key, enum in enums.items():
        descs = _member_descriptions(enum)
        missing = [m.name for m in enum if m.name not in descs]
        if missing:
            raise RuntimeError(f"policy catalogue: {enum.__module__}.{enum.__name__} documents no "
                               f"'NAME: ...' line for {missing} in its docstring")
        lines += [f"### {key}", "",
                  f"`reference.policies.{enum.__name__}`. {_cell(_preamble(enum))}", ""]
        st = searched.get(key)
        if st:
            lines += [f"`explain` tries every value on the stages {', '.join(f'`{s}`' for s in st)}; "
                      f"a match reads `{key}=<value>` and the declaration "
                      f"`policies={{'{key}': '<value>'}}`.", ""]
        else:
            lines += [f"Declared as `policies={{'{key}': '<value>'}}`; `explain` does not search it "
                      "(the cases cannot tell its values apart).", ""]
        lines += ["| value | what it does | declared by |", "|---|---|---|"]
        for m in enum:
            lines.append(f"| `{key}={m.value}` | {_cell(descs[m.name])} | {names(key, m.value)} |")
        lines.append("")
    lines += ["### Adapter-level and free-form keys", "",
              "These keys are not enums: they tell the stage how the adapter fed the kernel, or "
              "carry a number.", "",
              "| key | meaning | declared by |", "|---|---|---|"]
    for key, text in FREE_FORM_KEYS.items():
        vals = sorted({v for (k, v) in declared if k == key})
        by = "; ".join(f"`{v}`: {names(key, v)}" for v in vals) or "-"
        lines.append(f"| `{key}` | {_cell(text)} | {by} |")
    lines.append("")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the import root

REPO = Path(__file__).resolve().parents[2]
# pyproject.toml's package-dir: the lower layers are installed inside the dsv4_numerics namespace
LAYERS = {"reference": "reference", "oracles": "oracles", "kernels": "kernels", "fixtures": "fixtures"}


def build_import_root(root: Path) -> Path:
    """A folder whose ``dsv4_numerics/`` is laid out as installed (the application's files plus the
    lower layers as sub-packages), made of symbolic links, for mkdocstrings' static source search."""
    pkg = root / "dsv4_numerics"
    if root.exists():
        shutil.rmtree(root)
    pkg.mkdir(parents=True)
    for child in (REPO / "dsv4_numerics").iterdir():
        if child.name != "__pycache__":
            (pkg / child.name).symlink_to(child)
    for name, folder in LAYERS.items():
        (pkg / name).symlink_to(REPO / folder)
    return root


# --------------------------------------------------------------------------- the hooks


# Made when MkDocs loads this hook, before any plugin reads its configuration: mkdocstrings'
# Python handler keeps only the search paths that exist when it starts (mkdocs.yml: ``paths``).
IMPORT_ROOT = build_import_root(REPO / "build" / "docs-import-root")



def on_page_markdown(markdown: str, page, config, files):  # noqa: ARG001 - the MkDocs hook signature
    if CLI_MARK in markdown:
        markdown = markdown.replace(CLI_MARK, cli_reference_markdown())
    if POLICY_MARK in markdown:
        markdown = markdown.replace(POLICY_MARK, policy_catalogue_markdown())
    return markdown
