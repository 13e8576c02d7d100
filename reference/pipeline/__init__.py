"""dsv4_numerics.reference.pipeline: The layer around attention: RoPE, the KV compressor, the layer simulation that produces realistic activations."""
