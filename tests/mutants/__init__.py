"""Deliberately wrong implementations of the pipeline stages (the mutation suite).

Each mutant is a small function over the reference that reproduces one real bug class (cited),
wrapped as an entry-like object with the fields of ``kernels.registry.KernelEntry`` (family
``"mutant"``), so it is judged by exactly the runner, comparators and tolerance records the kernel
matrix uses (``oracles.matrix.run_entry``). ``tests/test_mutants.py`` requires every mutant to be
caught on the default case set, and the reference itself (``reference_entry``) to pass.

A mutant that survives means a default case or a judge is too weak -- never a reason to weaken
the mutant.

One module per stage family (as PyTorch's ``opinfo/definitions/<domain>.py``), each with its
``MUTANTS`` list; ``machinery`` holds the entry type, the reference entry and the shared helpers.
``MUTANTS`` here is their concatenation, in the order the suite lists them.
"""

from __future__ import annotations

from . import writers
from . import v41_records
from . import gathers
from . import indices
from . import attention
from . import sweeps
from . import epilogue
from . import sglang
from . import v41_attention
from .attention import sink_negated  # noqa: F401
from .machinery import (  # noqa: F401  (the names other tests use)
    MutantEntry,
    attn_out,
    fp32_compressor_entry,
    mutant,
    reference_entry,
    v41_nonfinite_entry,
    v41_nvfp4_nan_as_zero,
    v41_nvfp4_poisoned,
)

MUTANTS: list[MutantEntry] = [
    *writers.MUTANTS,
    *v41_records.MUTANTS,
    *gathers.MUTANTS,
    *indices.MUTANTS,
    *attention.MUTANTS,
    *sweeps.MUTANTS,
    *epilogue.MUTANTS,
    *sglang.MUTANTS,
    *v41_attention.MUTANTS,
]
