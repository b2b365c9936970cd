"""Tiers: the pools a sequence's blocks can live in, and moving whole sequences between them.

Each tier is a ``BlockPool`` named for where its blocks live: ``"device"`` (the pool attention
reads) and ``"host"`` (swap space in CPU memory). A sequence lives in exactly one tier at a time
(``SeqState.tier``) and its block table holds block ids of that tier's pool. Moving sequences
allocates their blocks in the destination, frees them in the source and rewrites the tables in
one go, returning the ``(source block, destination block)`` pairs whose data the runner copies.

Block tables never say which tier or format a block has: a further tier (disk) is one more named
pool in ``KVCacheManager.tiers`` with the runner copying its pairs, and a block format (int8, fp8
with per-block scales) is a property of the runner's storage (``KVCache.kv`` and ``KVCache.scales``,
both indexed by block id, so a pair copy moves the scales too), not of the tables that point at
blocks.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.errors import OutOfBlocksError
from pagedkv.memory.kv_groups import RELEASED

if TYPE_CHECKING:
    from pagedkv.memory.seq_state import SeqState

DEVICE = "device"
HOST = "host"
DISK = "disk"


@dataclass(frozen=True, slots=True)
class TierCopies:
    """One step's copies between the tiers of the prefix cache, made by the runner before the
    forward pass, in this order: ``to_disk`` (serialize evicted device blocks, before anything in
    the step can overwrite them), ``from_disk`` (payloads read from disk into host blocks),
    ``offloads`` (with the swap-outs), ``reloads`` (with the swap-ins)."""

    offloads: tuple[tuple[int, int], ...] = ()  # (device block, host block)
    reloads: tuple[tuple[int, int], ...] = ()  # (host block, device block)
    to_disk: tuple[tuple[int, bytes], ...] = ()  # (device block, key)
    from_disk: tuple[tuple[int, bytes], ...] = ()  # (host block, payload)


def move_sequences(seqs: list[SeqState], src: BlockPool, dst: BlockPool) -> dict[int, int]:
    """Move every block of ``seqs`` from ``src`` to ``dst``; returns ``{src block: dst block}``.

    Blocks shared among the given sequences move once and stay shared (the destination block
    takes the same reference count). The sequences (one request's) share a tenant, which holds the
    destination blocks when that pool keeps a tenant ledger. Raises OutOfBlocksError (naming ``dst``), changing nothing,
    when ``dst`` lacks free blocks.
    """
    refs = Counter(b for seq in seqs for b in seq.block_ids())  # every KV group's blocks
    if len(refs) > dst.num_free:
        raise OutOfBlocksError(len(refs), dst.num_free, dst.name)
    mapping = {}
    for src_id, block in zip(refs, dst.allocate(len(refs), seqs[0].tenant if seqs else None, quota=False)):
        block.ref_count = refs[src_id]
        mapping[src_id] = block.block_id
    src_blocks = src.blocks
    for seq in seqs:
        src.free(src_blocks[i] for i in reversed(seq.block_ids()))
        for table in seq.tables():  # a sliding group's released entries stay released
            table[:] = [mapping[i] if i != RELEASED else RELEASED for i in table]
        seq.tier = dst.name
    return mapping
