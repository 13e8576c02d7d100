"""dsv4_numerics.reference: the pure-PyTorch, deterministic, bit-exact model of the DSv4
attention pipeline.

Imports nothing from the rest of the suite. Layout (one job per module):

- ``constants``, ``errors``, ``policies``, ``detmath``: the foundations every layer uses;
- ``formats``: FP8 / FP4 codecs and the producers' quantisation rules;
- ``caches``: the paged cache layouts (MODEL1 584 B, V3.2, plain rows, V4.1 528/288 B);
- ``indices``: index builders and validators;
- ``attention``: the ordered and fast oracles, dense MLA, the output epilogue;
- ``pipeline``: RoPE, the compressor, the layer simulation, the V4.1 query quantiser;
- ``cases``: ``Case``, the case registry and the builders per stage family.
"""
