"""tests/mla: run the float64 oracles single-threaded.

The oracle evaluates many small, sequentially ordered float64 ops (attention.py "Determinism");
with intra-op threads on a loaded 2-core CI box those ops spend most of their time in thread
hand-offs (measured here: 11.8 s CPU with 2 threads vs 0.8 s with 1 for one prefill case).
Results do not depend on the thread count (fixed reduction order), so this changes time only.
"""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_thread_oracle():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
