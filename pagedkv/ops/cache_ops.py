"""KV-cache writes, copy-on-write block copies and host <-> device block swaps (plain PyTorch).

Layout of one layer's cache (K and V each)::

    [num_blocks, block_size, kv_heads, head_dim]
     block b, offset o  <->  slot b * block_size + o

The runner keeps all layers in one tensor ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``
so a block copy or swap moves every layer's K and V in one indexed copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64 slot of each new token
) -> None:
    """Store new tokens' K and V at their slots (``slot = block_id * block_size + offset``)."""
    kvh, d = k_cache.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)


def _pairs_to_index(pairs: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.tensor([p[0] for p in pairs], dtype=torch.long)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.long)
    return src, dst


def copy_blocks(kv: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> None:
    """Copy-on-write: block ``src`` -> block ``dst`` for every (src, dst) pair, in every layer.

    ``kv`` is ``[num_layers, 2, num_blocks, ...]``. All sources are read before any destination is
    written, so a block may be both a source and (of another pair) a destination.
    """
    if not pairs:
        return
    src, dst = _pairs_to_index(pairs)
    if len(set(dst.tolist())) != len(dst):
        raise ValueError("copy_blocks: a destination block appears twice")
    kv.index_copy_(2, dst, kv.index_select(2, src))


def swap_blocks(src_kv: torch.Tensor, dst_kv: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> None:
    """Move blocks between two pools (device -> host or back): ``dst_kv[..., d, ...] = src_kv[..., s, ...]``.

    Both tensors are ``[num_layers, 2, num_blocks_of_that_pool, block_size, kv_heads, head_dim]``.
    """
    if not pairs:
        return
    src, dst = _pairs_to_index(pairs)
    if len(set(dst.tolist())) != len(dst):
        raise ValueError("swap_blocks: a destination block appears twice")
    moved = src_kv.index_select(2, src).to(dst_kv.device, non_blocking=False)
    dst_kv.index_copy_(2, dst.to(dst_kv.device), moved)
