"""dsv4_numerics.reference.indices: Index plumbing: slot maps, sliding-window and prefill index builders, the ROCm and FlashInfer index forms, index validation."""
