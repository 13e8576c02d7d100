"""The ``dsv4-numerics`` command line.

Commands::

    dsv4-numerics check [--json PATH] [--device DEV] [--entry ENTRY_OR_GLOB]... [--no-kernels] [--no-fixtures]
                        [--require ENTRY_OR_GLOB]... [--require-available]
                        [--entries-from FILE_OR_MODULE]... [--no-external] [--cases default|full]
                        [--case GLOB]... [--jobs N]
    dsv4-numerics repro ENTRY [--case NAME] [--contract [KEYS]] --out DIR [--force]
    dsv4-numerics repro --findings [--gpu] --out DIR
    dsv4-numerics kernels [--json] [--available] [--entries-from FILE_OR_MODULE]... [--no-external]
    dsv4-numerics fixtures list [--json]
    dsv4-numerics fixtures regen [NAME...] [--accept] [--device DEV] [--out-dir DIR]
    dsv4-numerics fixtures regen [CASE...] --record-kernel ENTRY [--accept] [--device DEV] [--out-dir DIR]
    dsv4-numerics fixtures verify [NAME...] [--device DEV]
    dsv4-numerics fixtures import DIR [NAME...] [--accept]
    dsv4-numerics inspect FILE [--key K] [--page-size BS] [--stride BYTES] [--layout model1] ...
    dsv4-numerics bench {cpu,oracle,gpu} [ARGS...]
    dsv4-numerics report merge REPORT... [--json OUT.json] [--html OUT.html] [--title TEXT]
    dsv4-numerics report diff BASE NEW [--ratio R] [--json OUT.json] [--base-release R] [--new-release R]
    dsv4-numerics report history REPORT... [--markdown OUT.md]

``--root DIR`` (before or after the subcommand) points the fixture commands at another fixture
root (a directory holding ``manifest.json`` and ``data/``); default: the installed package's.

Exit status: 0 success; 1 a check, verification or inspection found a problem, ``check`` judged
nothing or a required entry was not judged, ``fixtures verify`` had nothing to verify, or
regen/import refused to change pinned fixtures without ``--accept``; 2 a usage or input error (missing file,
corrupt fixture, bad stride, unknown kernel name...), reported as one line on stderr, never a
traceback (``DSV4_TRACEBACK=1`` shows one for internal errors).
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib import metadata
from pathlib import Path

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3
PROG = "dsv4-numerics"


def _version() -> str:
    try:
        return metadata.version("dsv4-numerics")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class UsageError(Exception):
    """A command-line mistake; printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """The parser of the command and of every sub-command: a usage error is a :class:`UsageError`
    (one line, exit status 2) instead of argparse's usage text and exit."""

    def error(self, message: str):  # one line instead of usage + message
        raise UsageError(f"{message} (see `{self.prog} --help`)")


# ----------------------------------------------------------------------------- shared helpers
def err(msg: str) -> None:
    """Print ``msg`` as the command's one-line error on stderr."""
    print(f"{PROG}: error: {msg}", file=sys.stderr)


def progress(quiet: bool):
    """A progress callback: each line to stderr, or nothing when ``quiet``."""
    if quiet:
        return lambda s: None

    def say(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    return say


def add_root_argument(p: argparse.ArgumentParser) -> None:
    """``--root DIR`` on a sub-command (it may also stand before the sub-command)."""
    p.add_argument("--root", default=argparse.SUPPRESS, metavar="DIR",
                   help="fixture root holding manifest.json and data/ (default: the installed package's)")


def add_external_arguments(p: argparse.ArgumentParser) -> None:
    """``--entries-from`` and ``--no-external``: where kernel entries beyond the built-in ones come from."""
    p.add_argument("--entries-from", action="append", default=[], metavar="FILE_OR_MODULE",
                   help="also take kernel entries from this .py file or module (its ENTRIES list or entries() "
                        "function; repeatable)")
    p.add_argument("--no-external", action="store_true",
                   help="ignore entries of installed packages (entry-point group dsv4_numerics.kernels)")


def fixture_root(args, must_exist: bool = False) -> Path:
    """The fixture root of ``--root`` (default: the installed package's); UsageError for a file,
    or for a missing folder when ``must_exist``."""
    from dsv4_numerics.fixtures import store

    r = getattr(args, "root", None)
    if r is None:
        return store.PACKAGE_ROOT
    p = Path(r)
    if p.exists() and not p.is_dir():
        raise UsageError(f"--root {r} is not a directory")
    if must_exist and not p.exists():
        raise UsageError(f"--root {r}: no such directory")
    return p


def check_device(dev: str | None) -> str | None:
    """A usable torch device string, or UsageError (unknown name, or CUDA asked for without a GPU)."""
    if dev is None:
        return None
    import torch

    try:
        d = torch.device(dev)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {dev!r} is not a torch device name (cpu, cuda, cuda:1, ...)") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {dev}: no CUDA/ROCm device is visible to torch {torch.__version__}")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise UsageError(f"--device {dev}: only {torch.cuda.device_count()} GPU(s) visible")
    if d.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {dev}: only cpu and cuda devices are supported")
    return str(dev)


def check_writable(path: str, flag: str = "--json") -> None:
    """UsageError unless ``path`` can be written: its folder exists and it is no folder itself."""
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {parent} does not exist")
    if Path(path).is_dir():
        raise UsageError(f"{flag} {path} is a directory")


# ----------------------------------------------------------------------------- the parser
# The command modules, in the order ``--help`` lists their sub-commands. Each has
# ``add_parser(sub)`` (adds its sub-command(s) and sets ``handler`` to its ``run(args) -> exit
# status``). Registering a command is one line here.
from dsv4_numerics.cli import bench, check, fixtures, inspect, kernels, report, repro, stage  # noqa: E402

COMMANDS = (check, repro, kernels, fixtures, inspect, stage, report, bench)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description="Reference-first numerics and correctness suite for DeepSeek-V4 sparse attention.")
    p.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    p.add_argument("--root", default=None, metavar="DIR", help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    from dsv4_numerics.reference.errors import InputError

    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return EXIT_OK
        return args.handler(args)
    except UsageError as e:
        err(str(e))
        return EXIT_USAGE
    except InputError as e:  # includes store.FixtureError and registry.UnknownKernelError
        err(str(e))
        return EXIT_USAGE
    except OSError as e:
        err(f"{e.strerror or e}{': ' + str(e.filename) if getattr(e, 'filename', None) else ''}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        err("interrupted")
        return 130
    except Exception as e:  # noqa: BLE001 - an internal error: still one line unless asked
        if os.environ.get("DSV4_TRACEBACK") == "1":
            raise
        err(f"internal error: {type(e).__name__}: {e} (set DSV4_TRACEBACK=1 for the traceback)")
        return EXIT_INTERNAL
