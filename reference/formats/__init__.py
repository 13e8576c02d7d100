"""dsv4_numerics.reference.formats: Number formats: the FP8 (E4M3/E8M0) and FP4 (E2M1) codecs and the producers' quantisation rules."""
