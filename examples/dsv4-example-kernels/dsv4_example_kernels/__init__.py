"""Example kernels of a project outside dsv4-numerics, written from the DSv4 datapath spec in plain
PyTorch and judged by dsv4-numerics through its public API, its pytest plugin and the
``dsv4_numerics.kernels`` entry-point group:

- :func:`swa_writer.write_swa_cache` -- the 584-byte SWA cache writer; it chooses tile scales with
  the Q_S rule (``scale_rule=scale_clamp``, like the CuTe-DSL compressor), a deliberate, realistic
  difference from the SWA stage's default Q_A rule (``amax_clamp``, the vLLM CUDA writer);
- :func:`decode.sparse_decode` -- sparse decode attention with fp32 math and a bf16 output.
"""
