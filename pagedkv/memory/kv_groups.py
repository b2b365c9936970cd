"""A hybrid model's KV groups in the memory core: one block table per group, windows released.

A hybrid model (Gemma 3: five sliding-window layers to one full-attention layer) keeps its layers'
KV in groups (``model_shape.kv_groups``); a block of the one pool belongs to one group. Every
sequence has a table per group, all as long as the sequence::

    group 0 (full):       [ b4  b9  b2  b7  b5 ]     every block kept: the prefix-cache anchor
    group 1 (window 8):   [ -1  -1  b3  b8  b6 ]     blocks no later query can see are released
                            ^^^^^^ released: -1      (B = 4, 18 tokens computed: the next query,
                                                      position 18, sees 11..18)

- Released blocks go back to the pool like any freed block: a cached one stays cached-free, so a
  later prompt with the same prefix can still take it.
- Prefix caching: each group caches its blocks under its own key (``group_hash``). A prefix of k
  blocks is a hit only when group 0 holds all k and every other group holds the blocks the
  first uncached token can see (the window before position k * B); its earlier entries are -1.
  Each of those blocks may be on the device or in the host tier (evicted blocks of every group
  are offloaded under their keys); host ones are reloaded (``prefix_hit``).
- Copy-on-write, swapping and freeing treat every group's blocks alike (``SeqState.tables``).

The functions here hold that arithmetic; ``KVCacheManager`` calls them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.memory.block import Block
from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.prefix_hash import group_hash

if TYPE_CHECKING:
    from pagedkv.memory.seq_state import SeqState

RELEASED = -1  # a table entry whose block is out of every query's window


def first_visible_block(num_tokens: int, window: int | None, block_size: int) -> int:
    """The first block the query at position ``num_tokens`` can see (keys after position
    ``num_tokens - window``); blocks before it are out of every later query's window."""
    if window is None or num_tokens < window:
        return 0
    return (num_tokens - window + 1) // block_size


@dataclass(slots=True)
class GroupHit:
    """A prefix hit of ``k`` blocks for every KV group: ``blocks[g]`` are group g's blocks for
    positions ``k - len(blocks[g]) .. k - 1`` (group 0: all k), ``on_host[g]`` says which of them
    are host-tier blocks to reload."""

    k: int
    blocks: list[list[Block]]
    on_host: list[list[bool]]

    @property
    def num_host(self) -> int:
        return sum(sum(flags) for flags in self.on_host)


def prefix_hit(device: BlockPool, host: BlockPool | None, windows: Sequence[int | None],
               block_hashes: Sequence[bytes], max_hits: int, block_size: int) -> GroupHit:
    """The longest prefix of at most ``max_hits`` blocks that every group can serve from the
    device pool or (given ``host``) the host tier: group 0 all its blocks, the others the blocks
    the first uncached token sees."""
    def find(g: int, i: int) -> tuple[Block, bool] | None:
        key = group_hash(block_hashes[i], g)
        block = device.lookup(key)
        if block is not None:
            return block, False
        block = host.lookup(key) if host is not None else None
        return (block, True) if block is not None else None

    chain = 0
    while chain < max_hits and find(0, chain) is not None:
        chain += 1
    found = [[find(g, i) for i in range(chain)] for g in range(len(windows))]
    for k in range(chain, 0, -1):
        parts = [found[g][first_visible_block(k * block_size, windows[g], block_size):k]
                 for g in range(len(windows))]
        if all(entry is not None for part in parts for entry in part):
            return GroupHit(k, [[e[0] for e in part] for part in parts],  # type: ignore[index]
                            [[e[1] for e in part] for part in parts])  # type: ignore[index]
    return GroupHit(0, [[] for _ in windows], [[] for _ in windows])


def disk_reads(device: BlockPool, host: BlockPool, on_disk: Callable[[bytes], bool],
               windows: Sequence[int | None], block_hashes: Sequence[bytes], max_hits: int,
               block_size: int) -> tuple[int, list[bytes], dict[bytes, int]]:
    """What a waiting prompt of a hybrid model should read from disk: ``(query tokens, keys,
    tokens of each key)`` for the longest prefix every group can serve from the device, the host
    tier or the disk, the keys of it only the disk holds (group 0's stand for a block of prompt
    tokens, the others' for none), and the prompt tokens past what the device and host serve."""
    def where(g: int, i: int) -> str | None:
        key = group_hash(block_hashes[i], g)
        if key in device.cached or key in host.cached:
            return "mem"
        return "disk" if on_disk(key) else None

    near = prefix_hit(device, host, windows, block_hashes, max_hits, block_size).k
    chain = 0
    while chain < max_hits and where(0, chain) is not None:
        chain += 1
    found = [[where(g, i) for i in range(chain)] for g in range(len(windows))]
    for k in range(chain, near, -1):
        lows = [first_visible_block(k * block_size, windows[g], block_size) for g in range(len(windows))]
        if all(found[g][i] is not None for g in range(len(windows)) for i in range(lows[g], k)):
            keys = {group_hash(block_hashes[i], g): block_size if g == 0 else 0
                    for g in range(len(windows)) for i in range(lows[g], k) if found[g][i] == "disk"}
            return (max_hits - near) * block_size, list(keys), keys
    return (max_hits - near) * block_size, [], {}


def cache_group_blocks(pool: BlockPool, seq: SeqState, start: int, full: int) -> None:
    """Offer groups 1.. blocks ``start .. full - 1`` (computed, full) to the prefix cache."""
    blocks = pool.blocks
    for g, table in enumerate(seq.group_tables, start=1):
        pairs = [(blocks[table[i]], group_hash(seq.block_hashes[i], g))
                 for i in range(start, full) if table[i] != RELEASED]
        pool.cache((b for b, _ in pairs), (h for _, h in pairs), kv_group=g)


def release_out_of_window(pool: BlockPool, seq: SeqState, windows: Sequence[int | None],
                          block_size: int) -> int:
    """Release every group's blocks that the next query (position ``num_computed``) cannot see;
    returns how many."""
    released = 0
    blocks = pool.blocks
    for g, table in enumerate(seq.group_tables, start=1):
        lo = first_visible_block(seq.num_computed, windows[g], block_size)
        done = seq.released[g - 1]
        if lo > done:
            out = [blocks[b] for b in table[done:lo] if b != RELEASED]
            pool.free(out)
            table[done:lo] = [RELEASED] * (lo - done)
            seq.released[g - 1] = lo
            released += len(out)
    return released
