"""Full computed blocks entering the prefix cache: the hash chain, the index, the miss history,
a hybrid model's other groups and the KV events (``KVCacheManager.mark_computed`` and the
allocations call ``cache_full_blocks``).

Only blocks whose tokens are settled are hashed and only computed ones are cached, so a block is
never served to another request before its KV exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.memory.kv_events import MEDIUMS
from pagedkv.memory.kv_groups import cache_group_blocks
from pagedkv.memory.miss_reasons import UNSALTED_ROOT
from pagedkv.memory.prefix_hash import chain_hashes
from pagedkv.memory.seq_state import SeqState
from pagedkv.memory.tiers import DEVICE

if TYPE_CHECKING:
    from pagedkv.memory.kv_cache_manager import KVCacheManager

DEVICE_MEDIUM = MEDIUMS[DEVICE]


def hash_full_blocks(seq: SeqState, block_size: int, full: int) -> None:
    """Extend the sequence's hash chain to its first ``full`` blocks (all full of tokens).

    Only blocks whose tokens are settled are hashed: the prompt's, or computed ones. A block
    the caller is still filling with sampled tokens is not, so a fork taken later carries
    only hashes of the tokens it shares with its parent."""
    done = len(seq.block_hashes)
    if full > done:
        parent = seq.block_hashes[-1] if done else seq.root
        seq.block_hashes.extend(chain_hashes(parent, seq.token_ids, block_size, done, full))


def cache_full_blocks(kv: KVCacheManager, seq: SeqState) -> None:
    full = seq.num_computed // kv.block_size
    hash_full_blocks(seq, kv.block_size, full)
    blocks = kv.pool.blocks
    start = seq.num_cached_blocks
    content = None
    if seq.root != UNSALTED_ROOT:  # the same tokens' unsalted chain (another tenant's view)
        done = len(seq.content_hashes)
        if full > done:
            seq.content_hashes += chain_hashes(seq.content_hashes[-1] if done else UNSALTED_ROOT,
                                               seq.token_ids, kv.block_size, done, full)
        content = seq.content_hashes
    kv.history.on_cached(seq.root, seq.block_hashes, seq.token_ids, start, full, content)
    new = kv.pool.cache((blocks[i] for i in seq.block_table[start:full]), seq.block_hashes[start:full])
    if new and kv.events is not None:
        stored_events(kv, seq, [start + i for i in new])
    kv.index.on_cached(seq.root, seq.token_ids, seq.block_table, seq.block_hashes, full)
    if seq.group_tables:
        cache_group_blocks(kv.pool, seq, start, full)
    seq.num_cached_blocks = full


def stored_events(kv: KVCacheManager, seq: SeqState, new: list[int]) -> None:
    """BlockStored events for the sequence's blocks ``new`` (indices, ascending), one per run
    of consecutive blocks; the salt travels only as the root hash it made."""
    B, hashes = kv.block_size, seq.block_hashes
    extra = None if seq.root == UNSALTED_ROOT else [seq.root.hex()]
    run = [new[0]]
    for i in new[1:] + [-1]:
        if i == run[-1] + 1:
            run.append(i)
            continue
        first, last = run[0], run[-1] + 1
        kv.events.stored(hashes[first:last], hashes[first - 1] if first else None,  # type: ignore[union-attr]
                           seq.token_ids[first * B:last * B], DEVICE_MEDIUM, extra, seq.adapter)
        run = [i]
