"""Crash-isolated kernel runs and the main job: kernel children (``child``), their pool and broker,
the fork server, CUDA contexts, case files, the host's CPUs and GPUs, the run timeline, and
``check`` with its requirements."""
