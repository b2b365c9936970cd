"""How a new prompt finds the cached blocks it can reuse: one protocol, two implementations.

The block pool's hash map (chained block hash -> block) always names the cached blocks: a block
becomes cached by ``BlockPool.cache`` and stops being cached when it is evicted. A prefix index
answers "which cached blocks does this prompt start with?":

- :class:`HashChainIndex` looks each of the prompt's chained block hashes up in that map;
- :class:`RadixIndex` walks a radix tree over token ids (per tenant root) kept in step with the
  map, and its ``check`` proves the tree and the map name exactly the same blocks.

Both find the same blocks (a differential test and ``check_integrity`` say so). An index is built
before the pool (the radix tree hears of the pool's evictions: it is one of the pool's eviction
listeners), so the pool comes with each call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagedkv.memory.block import Block
from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.errors import IntegrityError
from pagedkv.memory.prefix_hash import chain_hashes
from pagedkv.memory.radix_index import RadixPrefixIndex

PREFIX_INDEXES = ("hash", "radix")


class PrefixIndex(Protocol):
    listens: bool  # whether it keeps state of its own (then it is one of the pool's eviction listeners)

    def match(self, pool: BlockPool, root: bytes, token_ids: Sequence[int], block_hashes: Sequence[bytes],
              max_blocks: int) -> list[Block]:
        """The cached blocks of ``pool`` the prompt starts with, at most ``max_blocks``."""
        ...

    def on_cached(self, pool: BlockPool, root: bytes, token_ids: Sequence[int], block_table: Sequence[int],
                  block_hashes: Sequence[bytes], num_full: int) -> None:
        """The pool just cached the sequence's first ``num_full`` blocks (those it took)."""
        ...

    def on_evict(self, block: Block, cause: str) -> None:
        """The pool is about to forget ``block``'s hash."""
        ...

    def check(self, pool: BlockPool) -> None:
        """Raise IntegrityError if the index disagrees with the pool's hash map."""
        ...


class HashChainIndex:
    """Lookups straight in the pool's hash map; nothing of its own to keep in step."""

    listens = False

    def match(self, pool: BlockPool, root: bytes, token_ids: Sequence[int], block_hashes: Sequence[bytes],
              max_blocks: int) -> list[Block]:
        hits = []
        cached = pool.cached
        for block_hash in block_hashes[:max_blocks]:
            block = cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def on_cached(self, pool: BlockPool, root: bytes, token_ids: Sequence[int], block_table: Sequence[int],
                  block_hashes: Sequence[bytes], num_full: int) -> None:
        pass

    def on_evict(self, block: Block, cause: str) -> None:
        pass

    def check(self, pool: BlockPool) -> None:
        pass


class RadixIndex:
    """A radix tree over token ids beside the pool's hash map, holding the same blocks."""

    listens = True

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.tree = RadixPrefixIndex(block_size)

    def match(self, pool: BlockPool, root: bytes, token_ids: Sequence[int], block_hashes: Sequence[bytes],
              max_blocks: int) -> list[Block]:
        return [pool.blocks[i] for i in self.tree.match(root, token_ids, max_blocks)]

    def on_cached(self, pool: BlockPool, root: bytes, token_ids: Sequence[int], block_table: Sequence[int],
                  block_hashes: Sequence[bytes], num_full: int) -> None:
        # Index only the blocks the hash map took, so that both name the same blocks.
        blocks = pool.blocks
        ids = [b if blocks[b].block_hash == h else None
               for b, h in zip(block_table[:num_full], block_hashes[:num_full])]
        self.tree.insert(root, token_ids[:num_full * self.block_size], ids)

    def on_evict(self, block: Block, cause: str) -> None:
        self.tree.remove(block.block_id)

    def check(self, pool: BlockPool) -> None:
        """Every block the tree holds sits at the path whose chained hash the map gives it."""
        problems = self.tree.check_integrity()
        if problems:
            raise IntegrityError("; ".join(problems))
        paths = self.tree.paths()
        cached = pool.cached
        # the tree indexes group 0's blocks (a hybrid model's other groups are found by hash)
        num_cached = sum(1 for block in cached.values() if block.kv_group == 0)
        if len(paths) != num_cached:
            raise IntegrityError(f"radix tree holds {len(paths)} blocks, hash index {num_cached}")
        B = self.block_size
        for tenant, tokens, block_id in paths:
            h = chain_hashes(tenant, list(tokens), B, 0, len(tokens) // B)[-1]  # type: ignore[arg-type]  # roots are chain roots (bytes)
            if cached.get(h) is not pool.blocks[block_id]:
                raise IntegrityError(f"radix tree puts block {block_id} where the hash index does not")


def make_prefix_index(kind: str, block_size: int) -> PrefixIndex:
    """The index named ``kind`` ("hash" or "radix"); one that ``listens`` must be one of the
    pool's eviction listeners."""
    if kind not in PREFIX_INDEXES:
        raise ValueError(f"prefix_index must be one of {PREFIX_INDEXES}, got {kind!r}")
    return HashChainIndex() if kind == "hash" else RadixIndex(block_size)
