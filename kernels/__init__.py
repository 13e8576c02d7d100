"""dsv4_numerics.kernels: thin adapters that drive real production DSv4 kernels through one
canonical call per stage, each with an honest availability probe (see ``registry``)."""
