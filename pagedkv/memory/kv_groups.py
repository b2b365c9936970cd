"""KV groups: layers that share one block table, and the few things in which kinds of group differ.

A model keeps its layers' KV in groups (``model_shape.kv_groups``); a block of the one pool belongs
to one group, and every sequence has a table per group, all as long as the sequence
(``SeqState.tables``). A hybrid model (Gemma 3: five sliding-window layers to one full-attention
layer) has a full group and a sliding one::

    group 0 (full):       [ b4  b9  b2  b7  b5 ]     every block kept: the prefix-cache anchor
    group 1 (window 8):   [ -1  -1  b3  b8  b6 ]     blocks no later query can see are released
                            ^^^^^^ released: -1      (B = 4, 18 tokens computed: the next query,
                                                      position 18, sees 11..18)

What a kind of group decides (the ``KVGroup`` protocol), and nothing else:

- ``hit_start(k)``: which blocks of a k-block cached prefix it needs for a hit (the blocks the
  first uncached token sees): a full group all of them, a sliding group its window's;
- ``max_blocks(n, chunk)``: the most blocks it holds for a sequence of n tokens;
- ``first_visible(n)``: blocks before it are out of every later query's window, to release.

Everything else (copy-on-write, swapping, freeing, caching under the group's own key
``group_hash``) treats every group's table alike. A latent (MLA) group keeps every block like a
full one: it is one more class with its own layers' block format, not an edit elsewhere.
Released blocks go back to the pool like any freed block: a cached one stays cached-free, so a
later prompt with the same prefix can still take it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pagedkv.memory.block import Block
from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.seq_state import RELEASED, SeqState, cdiv


class KVGroup(Protocol):
    @property
    def window(self) -> int | None:
        """The attention window in tokens; None: every block is kept."""
        ...

    def first_visible(self, num_tokens: int, block_size: int) -> int:
        """The first block the query at position ``num_tokens`` can see; blocks before it are out
        of every later query's window."""
        ...

    def hit_start(self, k: int, block_size: int) -> int:
        """The first of a ``k``-block cached prefix's blocks this group must hold for a hit."""
        ...

    def max_blocks(self, num_tokens: int, chunk: int | None, block_size: int) -> int:
        """The most blocks a sequence of ``num_tokens`` holds in this group (``chunk``: the most
        tokens one step computes; None: the whole sequence at once)."""
        ...


@dataclass(frozen=True, slots=True)
class FullAttention:
    """Every block kept (full attention; a latent MLA cache is kept the same way)."""

    window: None = None

    def first_visible(self, num_tokens: int, block_size: int) -> int:
        return 0

    def hit_start(self, k: int, block_size: int) -> int:
        return 0

    def max_blocks(self, num_tokens: int, chunk: int | None, block_size: int) -> int:
        return cdiv(num_tokens, block_size)


@dataclass(frozen=True, slots=True)
class SlidingWindow:
    """Only the last ``window`` positions are attended to: earlier blocks are released."""

    window: int

    def first_visible(self, num_tokens: int, block_size: int) -> int:
        if num_tokens < self.window:
            return 0
        return (num_tokens - self.window + 1) // block_size

    def hit_start(self, k: int, block_size: int) -> int:
        return self.first_visible(k * block_size, block_size)

    def max_blocks(self, num_tokens: int, chunk: int | None, block_size: int) -> int:
        return min(cdiv(num_tokens, block_size), cdiv(self.window + (chunk or num_tokens), block_size) + 1)


def make_kv_groups(windows: Sequence[int | None]) -> tuple[KVGroup, ...]:
    """One group per entry of ``kv_group_windows``: None a full group, an int a sliding one.
    Group 0 must keep every block (the prefix cache's anchor: its chain and index are group 0's)."""
    if not windows or windows[0] is not None:
        raise ValueError(f"kv_group_windows must start with None (group 0 keeps every block), got {windows!r}")
    return tuple(FullAttention() if w is None else SlidingWindow(w) for w in windows)


def release_out_of_window(pool: BlockPool, seq: SeqState, groups: Sequence[KVGroup], block_size: int) -> int:
    """Release every group's blocks that the next query (position ``num_computed``) cannot see;
    returns how many."""
    released = 0
    blocks = pool.blocks
    for g, group in enumerate(groups):
        lo = group.first_visible(seq.num_computed, block_size)
        done = seq.released[g]
        if lo > done:
            table = seq.tables[g]
            out: list[Block] = [blocks[b] for b in table[done:lo] if b != RELEASED]
            pool.free(out)
            table[done:lo] = [RELEASED] * (lo - done)
            seq.released[g] = lo
            released += len(out)
    return released
