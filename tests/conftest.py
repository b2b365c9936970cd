"""Test-wide settings: one torch thread; where the Triton kernels run.

The tiny models' matmuls take microseconds; with more threads than free cores (CI has 2, shared
with the test's own server threads) OpenMP's spinning makes them 20x slower.

The Triton kernel tests (``test_triton_*.py``, ``test_device.py``) run in Triton's interpreter on
CPU tensors here (``TRITON_INTERPRET=1``, set before anything imports triton);
``scripts/gpu_check.sh`` runs them on a GPU with ``PAGEDKV_TEST_DEVICE=cuda`` (``pagedkv_testing/triton_device.py``).
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# No test reaches the Hugging Face Hub: a repo id not in the cache is an error, not a download
# (tests/models/test_hub_download.py runs its downloads against a local stand-in, in subprocesses).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
TEST_DEVICE = os.environ.get("PAGEDKV_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402 - after TRITON_INTERPRET is set: triton reads it when it is imported

torch.set_num_threads(1)

