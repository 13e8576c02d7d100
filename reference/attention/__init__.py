"""dsv4_numerics.reference.attention.ordered: Attention: the ordered fp64 oracle, the fast oracle with its proven bound (and captured graphs), dense MLA, the output epilogue."""
