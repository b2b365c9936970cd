"""Swap: moving whole sequences out of the device pool into host blocks and back.

Not a tier of the prefix cache (``memory/tiers/``): a swapped-out sequence keeps its blocks, its
tables and its computed count, only elsewhere; preemption by swap and ``KVCacheManager.swap_out``
/ ``swap_in`` use it. Each pool is a ``BlockPool`` named for where its blocks live: ``"device"``
(the pool attention reads) and ``"host"`` (CPU memory, shared with the host tier of the prefix
cache, whose cached blocks swapped sequences outrank). A sequence lives in exactly one pool at a
time (``SeqState.tier``) and its block tables hold block ids of that pool. Moving sequences
allocates their blocks in the destination, frees them in the source and rewrites the tables in
one go, returning the ``(source block, destination block)`` pairs whose data the runner copies.

Block tables never say which pool or format a block has: a block format (int8, fp8 with
per-block scales) is a property of the runner's storage (``KVCache.kv`` and ``KVCache.scales``,
both indexed by block id, so a pair copy moves the scales too), not of the tables that point at
blocks. In a mixed device pool the format is the block id's range (``BlockPool.num_full_blocks``):
a swap-in asks each block's format from its position, and the runner converts a block whose host
copy is in the other format.
"""

from __future__ import annotations

from collections import Counter

from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.errors import OutOfBlocksError
from pagedkv.memory.seq_state import RELEASED, SeqState


def move_sequences(seqs: list[SeqState], src: BlockPool, dst: BlockPool, full: dict[int, bool] | None = None,
                   strict_full: bool = False) -> dict[int, int]:
    """Move every block of ``seqs`` from ``src`` to ``dst``; returns ``{src block: dst block}``.

    Blocks shared among the given sequences move once and stay shared (the destination block
    takes the same reference count). The sequences (one request's) share a tenant, which holds the
    destination blocks when that pool keeps a tenant ledger. Raises OutOfBlocksError (naming ``dst``), changing nothing,
    when ``dst`` lacks free blocks. Into a mixed pool, ``full[b]`` asks source block ``b``'s new block
    at full precision (``BlockPool.allocate``'s ``full`` and ``strict_full``).
    """
    refs = Counter(b for seq in seqs for b in seq.block_ids())  # every KV group's blocks
    if len(refs) > dst.num_free:
        raise OutOfBlocksError(len(refs), dst.num_free, dst.name)
    mapping = {}
    formats = [full[b] for b in refs] if full is not None else None
    taken = dst.allocate(len(refs), seqs[0].tenant if seqs else None, quota=False, full=formats,
                         strict_full=strict_full)
    for src_id, block in zip(refs, taken):
        block.ref_count = refs[src_id]
        mapping[src_id] = block.block_id
    src_blocks = src.blocks
    for seq in seqs:
        src.free(src_blocks[i] for i in reversed(seq.block_ids()))
        for table in seq.tables:  # a sliding group's released entries stay released
            table[:] = [mapping[i] if i != RELEASED else RELEASED for i in table]
        seq.tier = dst.name
    return mapping
