"""Test-wide settings: one torch thread.

The tiny models' matmuls take microseconds; with more threads than free cores (CI has 2, shared
with the test's own server threads) OpenMP's spinning makes them 20x slower.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
