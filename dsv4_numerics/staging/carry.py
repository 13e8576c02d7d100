"""``python -m dsv4_numerics.staging.carry``: several staged release folders as ONE content-addressed
tree, so moving them to another machine moves each distinct file once.

Release folders share most of their files (the stand-ins are the same in every release, and many
kernel sources do not change between two releases). ``pack TREE FOLDER...`` stores every distinct
file once, xz-compressed, under ``TREE/objects/<sha256[:2]>/<sha256>.xz`` (kernel sources and
libraries shrink to about 40 %) and writes ``TREE/index.json``:
``{"folders": {name: {path: {"sha256": ..., "size": ..., "mode": ...}}}}`` (``name`` = the
folder's base name, e.g. ``vllm-0.31.0``). ``unpack TREE OUT`` decompresses each object once into
``OUT/.objects/`` and rebuilds every folder under ``OUT/<name>/`` byte for byte (hard links to those
objects where the file system allows, else copies; each file's sha256 checked) and prints the
``DSV4_STAGED`` value listing them all.

Standard library only; a folder name or path that would leave ``OUT`` is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import sys
from pathlib import Path

INDEX = "index.json"
OBJECTS = "objects"


class CarryError(Exception):
    """A pack/unpack request that cannot be carried out (printed as one line, exit 2)."""


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _object(tree: Path, sha: str) -> Path:
    return Path(tree) / OBJECTS / sha[:2] / f"{sha}.xz"


def pack(tree: Path, folders: list[Path], log=print) -> dict:
    """Add ``folders`` (each a staged folder) to ``tree`` (created; an existing index is extended,
    a folder of the same name replaced) and return the index written. Logs the bytes of the
    folders and of the objects stored."""
    tree = Path(tree)
    index_path = tree / INDEX
    index = json.loads(index_path.read_text()) if index_path.is_file() else {"folders": {}}
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise CarryError(f"{folder} is not a folder")
        entries = {}
        for f in sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            sha = _sha(f)
            obj = _object(tree, sha)
            if not obj.exists():
                obj.parent.mkdir(parents=True, exist_ok=True)
                tmp = obj.with_name(obj.name + ".tmp")
                tmp.write_bytes(lzma.compress(f.read_bytes(), preset=6))
                tmp.replace(obj)
            entries[f.relative_to(folder).as_posix()] = {"sha256": sha, "size": f.stat().st_size,
                                                        "mode": f.stat().st_mode & 0o777}
        index["folders"][folder.name] = entries
    index_path.parent.mkdir(parents=True, exist_ok=True)
    index_path.write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    logical = sum(e["size"] for fs in index["folders"].values() for e in fs.values())
    stored = sum(p.stat().st_size for p in (tree / OBJECTS).rglob("*") if p.is_file()) if (tree / OBJECTS).is_dir() else 0
    log(f"{tree}: {len(index['folders'])} folders, {logical / 2**20:.1f} MiB of files stored as "
        f"{stored / 2**20:.1f} MiB of distinct objects (+ {index_path.stat().st_size / 2**10:.0f} KiB index)")
    return index


def _inside(base: Path, rel: str) -> Path:
    out = (base / rel).resolve()
    if base.resolve() not in out.parents and out != base.resolve():
        raise CarryError(f"{rel!r} would leave {base}")
    return out


def unpack(tree: Path, out: Path, log=print) -> list[Path]:
    """Rebuild every folder of ``tree``'s index under ``out`` (a folder already there is replaced)
    and return their paths, in index order."""
    tree, out = Path(tree), Path(out)
    index_path = tree / INDEX
    if not index_path.is_file():
        raise CarryError(f"{tree} holds no {INDEX}: make it with `pack`")
    index = json.loads(index_path.read_text())
    made = []
    plain_dir = out / ".objects"
    for name, entries in sorted(index["folders"].items()):
        dest = _inside(out, name)
        if dest.exists():
            shutil.rmtree(dest)
        for rel, e in sorted(entries.items()):
            target = _inside(dest, rel)
            obj = plain_dir / e["sha256"]
            if not obj.is_file():
                packed = _object(tree, e["sha256"])
                if not packed.is_file():
                    raise CarryError(f"{tree}: object {e['sha256']} of {name}/{rel} is missing")
                obj.parent.mkdir(parents=True, exist_ok=True)
                obj.write_bytes(lzma.decompress(packed.read_bytes()))
                obj.chmod(e["mode"])
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(obj, target)
                linked = True
            except OSError:
                shutil.copyfile(obj, target)
                linked = False
            if _sha(target) != e["sha256"]:
                raise CarryError(f"{name}/{rel}: sha256 differs from the index after unpacking")
            if not linked:
                target.chmod(e["mode"])
        made.append(dest)
    log(f"unpacked {len(made)} folders into {out}; use them with DSV4_STAGED="
        + os.pathsep.join(str(p.resolve()) for p in made))
    return made


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv4_numerics.staging.carry", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pk = sub.add_parser("pack", help="store FOLDERs in TREE, each distinct file once")
    pk.add_argument("tree", metavar="TREE")
    pk.add_argument("folders", nargs="+", metavar="FOLDER")
    up = sub.add_parser("unpack", help="rebuild TREE's folders under OUT")
    up.add_argument("tree", metavar="TREE")
    up.add_argument("out", metavar="OUT")
    up.add_argument("--print-staged", action="store_true",
                    help="print only the DSV4_STAGED value (the folders, colon-separated)")
    a = p.parse_args(argv)
    try:
        if a.cmd == "pack":
            pack(Path(a.tree), [Path(f) for f in a.folders])
        else:
            made = unpack(Path(a.tree), Path(a.out), log=(lambda s: print(s, file=sys.stderr)) if a.print_staged
                          else print)
            if a.print_staged:
                print(os.pathsep.join(str(m.resolve()) for m in made))
    except (CarryError, OSError, ValueError) as e:
        print(f"carry: error: {e}", file=sys.stderr)
        return 2
    return 0


__all__ = ["CarryError", "pack", "unpack"]

if __name__ == "__main__":
    sys.exit(main())
