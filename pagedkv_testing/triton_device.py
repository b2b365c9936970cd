"""Where the Triton kernel tests run their kernels: Triton's interpreter on CPU tensors here, or
the GPU named by ``PAGEDKV_TEST_DEVICE`` (``scripts/gpu_check.sh`` sets ``cuda``).

Tests build their inputs and references on the CPU and call kernels through :func:`call`: on a
GPU it copies the tensor arguments there, runs the kernel, and copies every tensor argument back
into the original (the kernels write their outputs in place), so the test code is the same for
both."""

from __future__ import annotations

import os

import torch

DEVICE = os.environ.get("PAGEDKV_TEST_DEVICE", "cpu")


def call(fn, *args, **kwargs):
    if DEVICE == "cpu":
        return fn(*args, **kwargs)
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def move(x):
        if isinstance(x, torch.Tensor):
            moved = x.to(DEVICE)
            pairs.append((x, moved))
            return moved
        return x

    result = fn(*[move(a) for a in args], **{k: move(v) for k, v in kwargs.items()})
    for original, moved in pairs:
        original.copy_(moved.cpu())
    for original, moved in pairs:
        if result is moved:
            return original
    return result.cpu() if isinstance(result, torch.Tensor) else result
