"""Reports of many runs: one matrix (``merge``), what changed between two runs (``diff``), the
self-contained HTML page (``html``) and the run metadata every report carries (``run_meta``)."""
