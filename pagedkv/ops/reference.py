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
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal softmax attention written out in full (float64 inside); returns ``[n, heads, d]``.
    ``softcap`` c: scores become ``c * tanh(score / c)`` before the mask (Gemma 2)."""
    n, heads, d = q.shape
    ctx, kvh, _ = k.shape
    group = heads // kvh
    qd = q.double()
    kd = k.double().repeat_interleave(group, dim=1)  # [ctx, heads, d]
    vd = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,chd->hnc", qd, kd) * (scale if scale is not None else 1.0 / math.sqrt(d))
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    query_pos = torch.arange(ctx - n, ctx).view(n, 1)
    key_pos = torch.arange(ctx).view(1, ctx)
    hidden = key_pos > query_pos
    if sliding_window is not None:
        hidden |= key_pos <= query_pos - sliding_window
    scores = scores.masked_fill(hidden, float("-inf"))
    out = torch.einsum("hnc,chd->nhd", scores.softmax(-1), vd)
    return out.to(q.dtype)


def reference_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: list[list[int]], row_seq: list[int], row_len: list[int],
                              scale: float | None = None, sliding_window: int | None = None,
                              k_scales: torch.Tensor | None = None,
                              v_scales: torch.Tensor | None = None, softcap: float | None = None,
                              k_quant: torch.Tensor | None = None, v_quant: torch.Tensor | None = None,
                              base: int = 0, k_base: int | None = None) -> torch.Tensor:
    """What ``native_paged_attention`` computes, one row at a time: row r's sequence's first
    ``row_len[r]`` cached tokens gathered contiguously (8-bit blocks dequantized with their
    ``[num_blocks, kv_heads]`` scales) and attended by ``reference_attention`` (rows of length 0
    stay zero); returns float32 ``[rows, heads, d]``. A mixed pool (``k_quant``/``v_quant``):
    block ``b < base`` is read from the float ``k_cache``/``v_cache`` as stored, block ``b >=
    base`` is ``k_quant[b - base] * k_scales[b - base]``, block by block; ``k_base``: K's own base
    where it differs from V's (K full precision below it, 8-bit from it)."""
    rows, heads, d = q.shape
    kvh = k_cache.shape[2]
    out = torch.zeros(rows, heads, d, dtype=torch.float32)

    def gather(cache: torch.Tensor, scales: torch.Tensor | None, table: torch.Tensor, n: int) -> torch.Tensor:
        blocks = cache.index_select(0, table).double()  # [blocks, block_size, kv_heads, d]
        if scales is not None:
            blocks = blocks * scales.index_select(0, table).double()[:, None, :, None]
        return blocks.reshape(-1, kvh, d)[:n]

    def gather_mixed(cache: torch.Tensor, quant: torch.Tensor, scales: torch.Tensor | None, table: torch.Tensor,
                     n: int, base: int) -> torch.Tensor:
        parts = []
        for b in table.tolist():
            if b < base:
                parts.append(cache[b].double())
            else:
                assert scales is not None  # a mixed pool's 8-bit blocks come with their scales
                parts.append(quant[b - base].double() * scales[b - base].double()[None, :, None])
        return torch.cat(parts).reshape(-1, kvh, d)[:n]

    for r, n in enumerate(row_len):
        if n <= 0:
            continue
        table = torch.tensor(block_tables[row_seq[r]], dtype=torch.long)
        if k_quant is not None and v_quant is not None:
            keys = gather_mixed(k_cache, k_quant, k_scales, table, n, base if k_base is None else k_base)
            values = gather_mixed(v_cache, v_quant, v_scales, table, n, base)
        else:
            keys = gather(k_cache, k_scales, table, n)
            values = gather(v_cache, v_scales, table, n)
        out[r] = reference_attention(q[r:r + 1].float(), keys, values, scale, sliding_window, softcap)[0]
    return out
