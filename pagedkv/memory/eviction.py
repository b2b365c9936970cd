"""Which free block to reuse when a fresh block is needed.

The free queue keeps blocks that hold nothing (never cached, or evicted) at its head, so every
policy first takes those: reusing them loses no cached prefix. Only when the head holds a cached
block does the policy pick a victim among the cached free blocks:

- ``lru`` (default): the head of the queue, which is the least recently freed block. O(1).
  A freed sequence returns its blocks last-first, so a prefix chain is evicted from its tail.
- ``fifo``: the block cached earliest, whatever its later use. O(cached free blocks).
- ``lrc``: least-reference-count-plus-age score ``alpha * (max_ref - ref) + beta * age``, both
  terms normalised to 0..1 over the candidates; ``ref`` is how many sequences have used the block
  since it was cached and ``age`` the time since its last use. The highest score is evicted.
  O(cached free blocks).
"""

from __future__ import annotations

from typing import Protocol

from pagedkv.memory.block import Block
from pagedkv.memory.free_queue import FreeBlockQueue

EVICTION_POLICIES = ("lru", "fifo", "lrc")


class EvictionPolicy(Protocol):
    name: str

    def choose(self, queue: FreeBlockQueue, now: int) -> Block:
        """Return the victim among the (non-empty) queue's blocks without removing it."""
        ...


class LRUPolicy:
    name = "lru"

    def choose(self, queue: FreeBlockQueue, now: int) -> Block:
        block = queue.peek()
        assert block is not None
        return block


class FIFOPolicy:
    name = "fifo"

    def choose(self, queue: FreeBlockQueue, now: int) -> Block:
        head = queue.peek()
        assert head is not None
        if head.block_hash is None:
            return head
        return min(queue, key=lambda b: (b.cached_at, b.block_id))


class LRCPolicy:
    name = "lrc"

    def __init__(self, alpha: float = 0.7, beta: float = 0.3) -> None:
        if alpha < 0 or beta < 0:
            raise ValueError(f"lrc weights must be >= 0, got alpha={alpha}, beta={beta}")
        self.alpha = alpha
        self.beta = beta

    def choose(self, queue: FreeBlockQueue, now: int) -> Block:
        head = queue.peek()
        assert head is not None
        if head.block_hash is None:
            return head
        blocks = list(queue)
        max_ref = max(b.uses for b in blocks) or 1
        max_age = max(now - b.last_used for b in blocks) or 1

        def score(b: Block) -> tuple[float, int]:
            s = (self.alpha * (max_ref - b.uses) / max_ref
                 + self.beta * (now - b.last_used) / max_age)
            return (s, -b.block_id)

        return max(blocks, key=score)


def make_eviction_policy(name: str, **kwargs: float) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "fifo":
        return FIFOPolicy()
    if name == "lrc":
        return LRCPolicy(**kwargs)
    raise ValueError(f"eviction_policy must be one of {EVICTION_POLICIES}, got {name!r}")
