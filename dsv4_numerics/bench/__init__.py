"""Benchmarks (not tests): the reference's CPU pack path (``cpu``), the float64 oracle (``oracle``),
the judge against FlashMLA on a GPU (``gpu``) and the host's CPU ceiling (``cpu_ceiling``)."""
