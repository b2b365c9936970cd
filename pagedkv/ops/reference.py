"""Naive contiguous attention: the reference the paged ops are tested and benchmarked against."""

from __future__ import annotations

import math

import torch


def reference_attention(
    q: torch.Tensor,  # [n, heads, d] queries of the last n tokens of the context
    k: torch.Tensor,  # [ctx, kv_heads, d] the whole context, contiguous
    v: torch.Tensor,  # [ctx, kv_heads, d]
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal softmax attention written out in full (float64 inside); returns ``[n, heads, d]``."""
    n, heads, d = q.shape
    ctx, kvh, _ = k.shape
    group = heads // kvh
    qd = q.double()
    kd = k.double().repeat_interleave(group, dim=1)  # [ctx, heads, d]
    vd = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,chd->hnc", qd, kd) * (scale if scale is not None else 1.0 / math.sqrt(d))
    query_pos = torch.arange(ctx - n, ctx).view(n, 1)
    key_pos = torch.arange(ctx).view(1, ctx)
    hidden = key_pos > query_pos
    if sliding_window is not None:
        hidden |= key_pos <= query_pos - sliding_window
    scores = scores.masked_fill(hidden, float("-inf"))
    out = torch.einsum("hnc,chd->nhd", scores.softmax(-1), vd)
    return out.to(q.dtype)
