"""``dsv4-numerics stage-vllm`` and ``stage-sglang``: stage production kernels out of their
wheels into one folder (:mod:`dsv4_numerics.staging`)."""

from __future__ import annotations

import sys

from dsv4_numerics.cli import UsageError


def add_parser(sub) -> None:
    from dsv4_numerics.staging import sglang as staging_sglang
    from dsv4_numerics.staging import vllm as staging

    sv = sub.add_parser("stage-vllm", help="stage vLLM's DSv4 kernels from its wheel into one folder (any release, one per folder; use it "
                             "with DSV4_STAGED=DIR)",
                        description="Copy vLLM's DSv4 kernel files out of a vllm wheel (0.33.0's file list; an older "
                                    "release's what it ships, its missing op files recorded) into DEST (additive) with "
                                    "small stand-ins for the engine modules they import; DEST/MANIFEST.json lists every "
                                    "file. Then set DSV4_STAGED=DEST for check, the tests and .ci/gpu-matrix.")
    staging.add_arguments(sv)
    sv.set_defaults(handler=run)

    sg = sub.add_parser("stage-sglang", help="stage SGLang's DSv4 kernel sources from its wheel into one folder (any release, "
                                             "one per folder; additive, next to stage-vllm parts; use it with "
                                             "DSV4_STAGED=DIR)",
                        description="Copy SGLang's DSv4 Triton and JIT-CUDA kernel sources out of an sglang wheel "
                                    "(0.5.23's layout; an older release's what it ships, its missing files recorded) "
                                    "into DEST/sglang/ with small stand-ins for the engine modules they import; "
                                    "DEST/MANIFEST.json lists every file.")
    staging_sglang.add_arguments(sg)
    sg.set_defaults(handler=run)


def run(args) -> int:
    from dsv4_numerics.staging import sglang as staging_sglang
    from dsv4_numerics.staging import vllm as staging

    module = staging if args.command == "stage-vllm" else staging_sglang
    try:
        return module.run(args, log=lambda m: print(m, file=sys.stderr))
    except staging.StagingError as e:
        raise UsageError(f"{args.command}: {e}") from None
