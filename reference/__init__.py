"""dsv4_numerics.reference: the pure-PyTorch, deterministic, bit-exact model of the DSv4
attention pipeline.

Imports nothing from the rest of the suite. Import from the submodules, each of which holds one
job (``constants``, ``policies``, ``fp8``, ``quant``, ``cache_model1``, ``indices``, ``rope``,
``attention``, ``epilogue``, ``compressor``, ``layer``, ...).
"""
