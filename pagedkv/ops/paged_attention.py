"""Paged attention in plain PyTorch: batched decode and (chunked) prefill over a block-table cache.

Decode (one new token per sequence, ``B`` sequences of ragged lengths): the blocks of every sequence
are gathered once per layer into a padded buffer and attended with one SDPA call under a padding
mask. The gather index and the mask depend only on the block tables, so ``DecodeMetadata`` builds
them once per step and every layer reuses them (and the buffers)::

    block_index  [B * max_blocks]        physical block ids, row-major; padding -> block 0
    k_buf/v_buf  [B * max_blocks, block_size, kv_heads, d]  ==  [B, max_blocks * block_size, ...]
    mask         [B, 1, 1, max_blocks * block_size]  True where the slot holds one of the B contexts

Prefill (``n`` new tokens after ``start_pos`` cached ones): new tokens attend causally to the cached
prefix and to themselves; key ``j`` is visible to query ``i`` iff ``j <= start_pos + i``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class DecodeMetadata:
    """Per-step gather index, padding mask and reusable buffers for batched decode."""

    block_index: torch.Tensor  # [B * max_blocks] int64
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] bool
    k_buf: torch.Tensor  # [B * max_blocks, block_size, kv_heads, head_dim]
    v_buf: torch.Tensor  # [B * max_blocks, block_size, kv_heads, head_dim]
    num_seqs: int
    padded_len: int

    @classmethod
    def build(cls, block_tables: list[list[int]], context_lens: list[int], block_size: int,
              kv_heads: int, head_dim: int, dtype: torch.dtype) -> DecodeMetadata:
        """``context_lens[i]`` = tokens visible to sequence i (cached + the new one)."""
        num_seqs = len(context_lens)
        max_blocks = max((n + block_size - 1) // block_size for n in context_lens)
        rows = [table[: (n + block_size - 1) // block_size] for table, n in zip(block_tables, context_lens)]
        padded = [r + [0] * (max_blocks - len(r)) for r in rows]
        block_index = torch.tensor(padded, dtype=torch.long).view(-1)
        padded_len = max_blocks * block_size
        lens = torch.tensor(context_lens, dtype=torch.long)
        mask = torch.arange(padded_len).view(1, -1) < lens.view(-1, 1)  # [B, padded_len]
        buf_shape = (num_seqs * max_blocks, block_size, kv_heads, head_dim)
        return cls(block_index, mask.view(num_seqs, 1, 1, padded_len),
                   torch.empty(buf_shape, dtype=dtype), torch.empty(buf_shape, dtype=dtype),
                   num_seqs, padded_len)


def paged_decode_attention(
    q: torch.Tensor,  # [B, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    meta: DecodeMetadata,
    scale: float | None = None,
) -> torch.Tensor:
    """One query per sequence against its whole paged context; returns ``[B, heads, head_dim]``."""
    b, kvh, d = meta.num_seqs, k_cache.shape[2], k_cache.shape[3]
    torch.index_select(k_cache, 0, meta.block_index, out=meta.k_buf)
    torch.index_select(v_cache, 0, meta.block_index, out=meta.v_buf)
    k = meta.k_buf.view(b, meta.padded_len, kvh, d).transpose(1, 2)  # [B, kv_heads, L, d]
    v = meta.v_buf.view(b, meta.padded_len, kvh, d).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=meta.mask, scale=scale, enable_gqa=q.shape[1] != kvh
    )  # [B, heads, 1, d]
    return out.squeeze(2)


def paged_prefill_attention(
    q: torch.Tensor,  # [n, heads, head_dim] new tokens' queries
    k: torch.Tensor,  # [n, kv_heads, head_dim] new tokens' keys (already written to the cache)
    v: torch.Tensor,  # [n, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [>= ceil((start_pos + n) / block_size)] int64
    start_pos: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of ``n`` new tokens over ``start_pos`` cached tokens plus themselves."""
    n, heads, d = q.shape
    kvh = k.shape[1]
    gqa = heads != kvh
    qh = q.transpose(0, 1)  # [heads, n, d]
    if start_pos == 0:  # no cached prefix: the fresh K/V are the whole context
        out = F.scaled_dot_product_attention(qh, k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                             scale=scale, enable_gqa=gqa)
        return out.transpose(0, 1)
    ctx = start_pos + n
    block_size = k_cache.shape[1]
    blocks = block_table[: (ctx + block_size - 1) // block_size]
    keys = k_cache.index_select(0, blocks).view(-1, kvh, d)[:ctx]  # [ctx, kv_heads, d]
    values = v_cache.index_select(0, blocks).view(-1, kvh, d)[:ctx]
    mask = torch.arange(ctx).view(1, ctx) <= (torch.arange(n) + start_pos).view(n, 1)  # [n, ctx]
    out = F.scaled_dot_product_attention(qh, keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask,
                                         scale=scale, enable_gqa=gqa)
    return out.transpose(0, 1)  # [n, heads, d]
