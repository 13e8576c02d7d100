"""dsv4_numerics.oracles: how a kernel is judged against the reference -- bit-exact byte
comparison with decoded diffs, numeric comparators, and derived, scoped tolerance records."""
