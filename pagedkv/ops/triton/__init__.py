"""Triton kernels for NVIDIA GPUs, behind the functions the CPU path uses.

- ``decode.py``: paged decode attention (one query token per row), split-K over blocks with a
  reduction kernel, GQA-aware (a program reads each K/V row once for all query heads of its KV head).
- ``prefill.py``: paged prefill attention for a chunk of query rows of one sequence over its
  cached prefix and the chunk itself (causal, sliding window, soft-cap).
- ``cache_ops.py``: the KV cache write (float formats, and int8 / fp8 with per-block scales grown
  as tokens arrive, as ``csrc/paged_attention.cpp``'s ``write_kv_scaled``) and the block copy.

Every kernel reads float32 / float16 / bfloat16 caches and the 8-bit formats (int8, fp8 e4m3 /
e5m2) with their scales ``[num_blocks, kv_heads]`` float32 (decode and prefill also a mixed pool,
each block in its own format), and sits beside a plain PyTorch
reference in its test. Without a GPU they run in Triton's interpreter (``TRITON_INTERPRET=1``,
set before triton is imported) on CPU tensors: how the tests here prove them.
"""

from __future__ import annotations

import importlib.util

from pagedkv import envs


def installed() -> bool:
    """Whether the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors)."""
    return envs.TRITON_INTERPRET.get()


def usable_on(device_type: str) -> bool:
    """Whether the Triton kernels can run on tensors of ``device_type`` here."""
    if not installed():
        return False
    return device_type == "cuda" or (device_type == "cpu" and interpreting())
