"""The block pool: every physical block, the free queue and the prefix-cache hash index.

A block is in exactly one of three states::

    used          ref_count > 0              referenced by block tables (and pins)
    cached-free   ref_count == 0, hashed     in the free queue, reusable by a prefix hit
    empty-free    ref_count == 0, no hash    in the free queue, at its head

Allocation takes the eviction policy's victim from the free queue; if that block is cached its
hash leaves the index (an eviction). A prefix hit on a cached-free block pulls it out of the
middle of the queue in O(1). With per-tenant quotas (``tenants``, a ``TenantLedger``) each held
block has an owner, and the ledger chooses whose cached blocks go first (``memory/tenant_ledger.py``).

A mixed pool (``num_full_blocks`` F > 0, the runner's full-precision and 8-bit blocks side by side:
``runner/kv_cache.py``) records a block's format by its id: ids below F are full precision, the rest
8-bit. One free queue still holds both, and ``allocate(full=...)`` takes, per block, the first free
block of the format asked for, or the other one when none is free (a sink block then stays 8-bit;
an 8-bit block taken at full precision only costs room), except ``strict_full`` ones (a request
that asked for full-precision KV), which fail instead. ``num_free`` counts both, so the admission
arithmetic is the same as a single-format pool's.

Who hears of an eviction is fixed when the pool is built: ``listeners``, in order (the device
pool's: the radix index, the prefix cache's miss history, the lower tiers, the tenant ledger, the
KV event log), each told ``on_evict(block, cause)`` before the block's hash is dropped. ``cause``
says why it goes: the eviction policy's name, ``quota`` (a tenant over its quota gives it up),
``cleared`` (``evict_cached``) or ``dropped`` (``evict_cached(keep_contents=False)``: its KV is not
to be trusted, so no tier copies it down).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from pagedkv.kv_events import MEDIUMS, KVEventLog
from pagedkv.memory.block import Block
from pagedkv.memory.errors import IntegrityError, OutOfBlocksError
from pagedkv.memory.eviction import EvictionPolicy, LRUPolicy
from pagedkv.memory.free_queue import FreeBlockQueue
from pagedkv.memory.tenant_ledger import DEFAULT_TENANT, TenantLedger

CLEARED = "cleared"  # evict_cached: forgotten on purpose (copied down to the lower tiers first)
DROPPED = "dropped"  # evict_cached(keep_contents=False): its KV is not to be trusted, not copied down
QUOTA = "quota"  # given up by a tenant over its quota


class EvictionListener(Protocol):
    """Told of every cached block the pool is about to forget (its hash still set)."""

    def on_evict(self, block: Block, cause: str) -> None:
        """``cause``: the eviction policy's name, ``QUOTA``, ``CLEARED`` or ``DROPPED``."""
        ...


class EvictionEvents:
    """Eviction listener: a ``BlockRemoved`` KV event for each KV group 0 block a pool forgets."""

    def __init__(self, log: KVEventLog, medium: str) -> None:
        self.log = log
        self.medium = medium

    def on_evict(self, block: Block, cause: str) -> None:
        if block.kv_group == 0:
            self.log.removed(block.block_hash, self.medium)  # type: ignore[arg-type]  # set: told before it is dropped


class BlockPool:
    """Args:
        num_blocks: blocks in the pool.
        name: the tier it is ("device", "host"): in errors and KV event mediums.
        eviction_policy: which cached-free block to reuse (default LRU).
        tenants: the per-tenant quota ledger (``memory/tenant_ledger.py``), None with quotas off; it
            decides whose cached blocks go first and counts each block's owner.
        listeners: told of each eviction, in this order (see the module docstring).
    """

    def __init__(self, num_blocks: int, *, name: str = "device",
                 eviction_policy: EvictionPolicy | None = None, tenants: TenantLedger | None = None,
                 listeners: Sequence[EvictionListener] = (), num_full_blocks: int = 0) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if not 0 <= num_full_blocks < max(num_blocks, 1):
            raise ValueError(f"num_full_blocks must be in [0, num_blocks) = [0, {num_blocks}), got {num_full_blocks}")
        self.num_full_blocks = num_full_blocks  # a mixed pool: ids below it hold full precision (0: one format)
        self.num_free_full = num_full_blocks  # of them, in the free queue
        self.name = name
        self.blocks = [Block(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, Block] = {}  # block hash -> the block holding that prefix
        self.policy = eviction_policy or LRUPolicy()
        self._lru = isinstance(self.policy, LRUPolicy)
        self.clock = 0
        self.evictions = 0
        self.tenants = tenants
        self.listeners = tuple(listeners)
        self.medium = MEDIUMS.get(name, name)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (empty-free plus cached-free)."""
        return len(self.free_queue)

    def is_full_precision(self, block: Block) -> bool:
        """Whether ``block`` holds full precision in a mixed pool (False in a single-format one)."""
        return block.block_id < self.num_full_blocks

    def allocate(self, n: int, tenant: str | None = None, *, quota: bool = True,
                 full: Sequence[bool] | None = None, strict_full: bool = False) -> list[Block]:
        """Take ``n`` blocks with ref count 1 (held by ``tenant`` when quotas are on), or raise
        OutOfBlocksError (TenantQuotaError: over the tenant's quota; ``quota=False`` skips that
        check, e.g. for work coming back from swap) and take none. In a mixed pool ``full[i]``
        asks block i to be full precision (True) or 8-bit, the other format taken when none is
        free; ``strict_full``: full-precision blocks or OutOfBlocksError (naming that pool)."""
        if n > len(self.free_queue):
            raise OutOfBlocksError(n, len(self.free_queue), self.name)
        formats = full if self.num_full_blocks else None  # a mixed pool: the format of each block
        if formats is not None and strict_full:
            wanted = sum(1 for f in formats if f)
            if wanted > self.num_free_full:
                raise OutOfBlocksError(wanted, self.num_free_full, f"{self.name} full-precision")
        ledger = self.tenants
        if ledger is not None:
            tenant = tenant or DEFAULT_TENANT
            error = ledger.allocation_error(tenant, n, len(self.free_queue)) if quota else None
            if error is not None:
                ledger.quota_waits[tenant] += 1
                raise error
            for block in ledger.victims(tenant, n, len(self.free_queue)):
                self._evict(block, QUOTA)  # emptied: to the head of the queue, taken below
        if formats is not None:
            out = [self._pop_format(f) for f in formats]
        else:
            out = self.free_queue.popleft_n(n) if self._lru else [self._pop_victim() for _ in range(n)]
            if self.num_full_blocks:
                self.num_free_full -= sum(1 for b in out if b.block_id < self.num_full_blocks)
        cause = self.policy.name
        for block in out:
            if block.block_hash is not None:
                for listener in self.listeners:
                    listener.on_evict(block, cause)
                del self.cached[block.block_hash]
                block.block_hash = None
                self.evictions += 1
            block.ref_count = 1
            if ledger is not None:
                ledger.took(block, tenant)  # type: ignore[arg-type]  # a name: set above when a ledger is on
        return out

    def _pop_victim(self) -> Block:
        block = self.policy.choose(self.free_queue, self.clock)
        self.free_queue.remove(block)
        return block

    def _pop_format(self, full: bool) -> Block:
        """A mixed pool's next block of the format asked for: the first such block from the head
        of the queue under LRU (empty blocks first, then the least recently used), the policy's
        victim otherwise unless an empty block of that format is free; the other format when the
        queue holds none of it."""
        limit = self.num_full_blocks
        have = self.num_free_full if full else len(self.free_queue) - self.num_free_full
        block = None
        if have:
            for candidate in self.free_queue:
                if (candidate.block_id < limit) == full and (self._lru or candidate.block_hash is None):
                    block = candidate
                    break
                if not self._lru and candidate.block_hash is not None:
                    break  # past the empty blocks: the policy chooses among cached ones
        if block is None:
            block = self.policy.choose(self.free_queue, self.clock)
        self.free_queue.remove(block)
        if block.block_id < limit:
            self.num_free_full -= 1
        return block

    def touch(self, block: Block) -> None:
        """Take one more reference (a prefix hit or a fork); revives a cached-free block."""
        if block.ref_count == 0:
            self.free_queue.remove(block)
            if block.block_id < self.num_full_blocks:
                self.num_free_full -= 1
            if self.tenants is not None:
                self.tenants.revived(block)
        block.ref_count += 1
        if block.block_hash is not None:
            block.uses += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block, in the given order (first freed = evicted first).

        Blocks that reach ref count 0 join the free queue: cached ones at the tail (kept as long
        as possible), empty ones at the head (reused first, losing nothing).
        """
        self.clock += 1
        now = self.clock
        queue = self.free_queue
        ledger = self.tenants
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_id < self.num_full_blocks:
                    self.num_free_full += 1
                if block.block_hash is None:
                    queue.appendleft(block)
                else:
                    block.last_used = now
                    queue.append(block)
                if ledger is not None:
                    ledger.freed(block)
            elif block.ref_count < 0:
                raise IntegrityError(f"{self.name} {block} freed more often than referenced")

    def lookup(self, block_hash: bytes) -> Block | None:
        return self.cached.get(block_hash)

    def cache(self, blocks: Iterable[Block], hashes: Iterable[bytes], kv_group: int = 0) -> list[int]:
        """Register full, computed blocks under their hashes (of KV group ``kv_group``'s layers);
        returns the positions (in ``blocks``) of those newly registered.

        A block that already has a hash (a prefix hit) keeps it; a hash another block already
        holds (two sequences computed the same prefix at once) stays with that block.
        """
        self.clock += 1
        now = self.clock
        cached = self.cached
        new = []
        for i, (block, block_hash) in enumerate(zip(blocks, hashes)):
            if block.block_hash is None and block_hash not in cached:
                block.block_hash = block_hash
                block.cached_at = block.last_used = now
                block.uses = 1
                block.kv_group = kv_group
                cached[block_hash] = block
                new.append(i)
        return new

    def evict_cached(self, max_blocks: int | None = None, *, keep_contents: bool = True) -> int:
        """Drop cached-free blocks' hashes (their KV is forgotten); returns how many. With
        ``keep_contents`` the lower tiers may copy them down first (cause ``CLEARED``); pass
        False when their contents are not to be trusted, after a failed step (``DROPPED``)."""
        victims = [b for b in self.free_queue if b.block_hash is not None]
        if max_blocks is not None:
            victims = victims[:max_blocks]
        cause = CLEARED if keep_contents else DROPPED
        for block in victims:
            self._evict(block, cause)
        return len(victims)

    def _evict(self, block: Block, cause: str) -> None:
        """Forget a cached-free block's prefix; it moves to the head of the queue, empty."""
        for listener in self.listeners:
            listener.on_evict(block, cause)
        del self.cached[block.block_hash]  # type: ignore[arg-type]  # only cached blocks are evicted
        block.block_hash = None
        self.free_queue.remove(block)
        self.free_queue.appendleft(block)  # empty blocks belong at the head of the queue
        self.evictions += 1

    def check_integrity(self) -> None:
        """Free queue links, ref counts and the hash index agree with each other."""
        seen = 0
        prev = self.free_queue._head
        for block in self.free_queue:
            if block.prev is not prev:
                raise IntegrityError(f"{self.name} free queue broken link at {block}")
            if block.ref_count != 0:
                raise IntegrityError(f"{self.name} {block} is in the free queue but referenced")
            prev = block
            seen += 1
        if seen != len(self.free_queue):
            raise IntegrityError(f"{self.name} free queue size {len(self.free_queue)} != {seen} linked")
        used = 0
        for block in self.blocks:
            if block.ref_count < 0:
                raise IntegrityError(f"{self.name} {block} has a negative ref count")
            in_queue = block.prev is not None
            if (block.ref_count == 0) != in_queue:
                raise IntegrityError(f"{self.name} {block}: free={block.ref_count == 0} but "
                                     f"in_queue={in_queue}")
            used += block.ref_count > 0
            if block.block_hash is not None and self.cached.get(block.block_hash) is not block:
                raise IntegrityError(f"{self.name} {block} has a hash the index does not map to it")
        for block_hash, block in self.cached.items():
            if block.block_hash != block_hash:
                raise IntegrityError(f"{self.name} index maps a hash to {block}, which holds another")
        free_full = sum(1 for b in self.free_queue if b.block_id < self.num_full_blocks)
        if free_full != self.num_free_full:
            raise IntegrityError(f"{self.name} counts {self.num_free_full} free full-precision blocks, the queue "
                                 f"holds {free_full}")
        if used + len(self.free_queue) != len(self.blocks):
            raise IntegrityError(f"{self.name} used {used} + free {len(self.free_queue)} != "
                                 f"total {len(self.blocks)}")
        if self.tenants is not None:
            self.tenants.check(self.blocks)
