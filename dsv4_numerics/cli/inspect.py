"""``dsv4-numerics inspect``: decode a KV-cache dump (:mod:`dsv4_numerics.inspect`) into a
per-slot table, flag impossible content, or tell its layout."""

from __future__ import annotations

import json

from dsv4_numerics.cli import EXIT_FAIL, EXIT_OK, UsageError


def add_parser(sub) -> None:
    i = sub.add_parser("inspect", help="decode a KV-cache dump into a per-slot table and flag impossible content")
    i.add_argument("file", metavar="FILE", help="safetensors file or raw bytes")
    i.add_argument("--key", help="tensor name inside a safetensors file (default: its only uint8 tensor)")
    i.add_argument("--format", default="auto", choices=("auto", "safetensors", "raw"))
    i.add_argument("--page-size", type=int, default=None, metavar="BS", help="entries per page (block size)")
    i.add_argument("--stride", type=int, default=None, metavar="BYTES", help="page stride in bytes (raw dumps)")
    i.add_argument("--layout", default="model1", help="cache layout: model1 (584-byte fp8_ds_mla), or detect: tell "
                   "MODEL1 pages from V4.1 528/288-byte caches and their interleaved / page-footer byte order, and say why")
    i.add_argument("--fp8", default="e4m3fn", help="NoPE code flavour: e4m3fn or e4m3fnuz (gfx942 SWA cache)")
    i.add_argument("--producer", default="vllm", help="vllm (pad byte must be 0), flashmla or unknown")
    i.add_argument("--slots", default=None, help="slots to examine, e.g. 0-63,100 (default: all)")
    i.add_argument("--limit", type=int, default=64, help="at most this many table rows (default 64)")
    i.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH ('-' for stdout only)")
    i.set_defaults(handler=run)


def run(args) -> int:
    from dsv4_numerics.inspect import cache as ic

    cache, desc = ic.load_dump(args.file, args.key, args.format)
    if args.limit < 0:
        raise UsageError("inspect: --limit must be >= 0")
    if args.layout == "detect":
        from dsv4_numerics.inspect import layout as il

        if cache.dim() == 1:
            if not args.stride or cache.numel() % args.stride:
                raise UsageError("inspect --layout detect: a raw dump needs --stride dividing its length")
            cache = cache.reshape(-1, args.stride)
        verdict = il.detect_layout(cache, args.page_size)
        print(f"{desc}\n{il.format_verdict(verdict)}")
        return EXIT_OK if verdict.best else EXIT_FAIL
    rep = ic.inspect_cache(cache, args.page_size, args.stride, fp8=args.fp8, producer=args.producer, slots=args.slots, layout=args.layout)
    if args.json != "-":
        print(ic.format_report(rep, desc, args.limit))
    if args.json:
        text = json.dumps(rep.to_dict(), indent=1, allow_nan=False)
        if args.json == "-":
            print(text)
        else:
            from dsv4_numerics.fixtures import store

            store.atomic_write_bytes(args.json, (text + "\n").encode())
    return EXIT_FAIL if rep.impossible else EXIT_OK
