"""The memory core's side of the disk tier: which evicted blocks to write, and the read-ahead of
waiting prompts' blocks into the host tier (the bytes move in the engine, ``engine/kv_tiers.py``).

Owned by ``KVCacheManager`` (as ``disk_lookup``) when it has a disk tier:

- ``on_evict(block)``: a cached device block is being evicted; unless the disk has it (or its
  write is queued) or the write queue is full, it is listed for this step's ``to_disk``.
- ``prefetch(...)``: a waiting prompt's hash chain, past its device and host hits, continues on
  disk: ask the worker to read those blocks and say whether the prompt should wait for them.
  Blocks read since the last call are taken into the host tier first.
- ``report_to(events)``: KV events for the disk tier (medium "DISK"): blocks written, evicted or
  discarded, as the disk's index changes on the worker thread; ``take_events`` moves them into
  the log on the engine thread, once per step.

Reads always converge: in one admission attempt (from a sequence's arrival in the waiting queue to
its ``allocate_prompt``, or its retirement) each block is read for it at most once, and no more
blocks than the host tier has room for; a read that failed, was discarded, found no room or was
evicted again before the prompt was admitted is a miss for good, and its tokens are recomputed.
(Without that, a chain longer than the host tier, read over several steps, evicted its own first
blocks as its last ones landed, and was read again, for ever.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

from pagedkv.memory.block import Block
from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.disk_prefix import DiskPrefixTier
from pagedkv.memory.host_tier import HostPrefixTier
from pagedkv.memory.kv_events import MEDIUMS, KVEventLog
from pagedkv.memory.tier_costs import TierCosts


class DiskLookup:
    def __init__(self, disk: DiskPrefixTier, device: BlockPool, host_tier: HostPrefixTier,
                 costs: TierCosts, block_size: int) -> None:
        self.disk = disk
        self.device = device
        self.host_tier = host_tier
        self.costs = costs
        self.block_size = block_size
        self.query_tokens = 0  # prompt tokens looked up on disk (past the device and host tiers)
        self.hit_tokens = 0  # tokens read from disk into the host tier
        self.to_disk: list[tuple[int, bytes]] = []  # (device block, key) evicted this step
        self._looked_up: set[Hashable] = set()  # waiting sequences whose lookup was counted
        self._asked: dict[Hashable, set[bytes]] = {}  # per waiting sequence: blocks read for it, this attempt
        self._load_failed: set[bytes] = set()  # reads of this step the host tier had no room for
        self._tokens_of: dict[bytes, int] = {}  # prompt tokens a requested key stands for, when not B
        self.events: KVEventLog | None = None
        self._changes: deque[tuple[str, bytes]] | None = None

    def on_evict(self, block: Block) -> None:
        key = block.block_hash
        assert key is not None
        if not self.disk.has(key) and not self.disk.queue_full():
            self.to_disk.append((block.block_id, key))

    def take_to_disk(self) -> list[tuple[int, bytes]]:
        """This step's evicted blocks to write, handed over once; a new step begins."""
        to_disk, self.to_disk = self.to_disk, []
        self._load_failed.clear()
        self.take_events()
        return to_disk

    def report_to(self, events: KVEventLog) -> None:
        """Send the disk tier's changes to ``events`` from now on, beginning with the blocks it
        already holds (a restart announces what it kept)."""
        self.events = events
        self._changes = self.disk.disk.watch_changes()

    def take_events(self) -> None:
        """The disk's changes since the last call, as KV events (engine thread)."""
        changes, events = self._changes, self.events
        if changes is None or events is None:
            return
        medium = MEDIUMS["disk"]
        while changes:
            kind, key = changes.popleft()
            if kind == "stored":
                events.stored([key], None, [], medium)
            else:
                events.removed(key, medium)

    def prefetch(self, seq_id: Hashable, hashes: list[bytes], count: bool) -> bool:
        """``hashes``: the prompt's block hashes that could be hits. True while some of the
        blocks its chain continues with on disk are being read (see KVCacheManager.prefetch)."""
        self.take_reads()
        cached = self.device.cached
        first = next((i for i, h in enumerate(hashes) if h not in cached), len(hashes))
        on_host = len(self.host_tier.match(hashes[first:]))
        first += on_host
        room = self.host_tier.pool.num_free - on_host  # (the host hits are cached-free there too)
        keys = []
        for key in hashes[first:first + max(room, 0)]:  # more would evict the chain's own first blocks
            if key not in self.disk.disk:
                break
            keys.append(key)
        return self.request(seq_id, keys, (len(hashes) - first) * self.block_size, count)

    def take_reads(self) -> None:
        """Take the blocks read since the last call into the host tier."""
        for key, payload in self.disk.poll():
            tokens = self._tokens_of.pop(key, self.block_size)
            if key in self.device.cached:
                continue
            if self.host_tier.load(key, payload):
                self.hit_tokens += tokens
            else:  # no host block free this step: whoever waits for it recomputes instead
                self._load_failed.add(key)

    def request(self, seq_id: Hashable, keys: list[bytes], query_tokens: int, count: bool,
                tokens_of: dict[bytes, int] | None = None) -> bool:
        """Read ``keys`` (a waiting prompt's blocks only the disk holds) if reloading beats
        recomputing; True while some are being read. ``query_tokens``: the prompt tokens no
        faster tier holds; ``tokens_of``: the prompt tokens a key stands for where not the block
        size (a hybrid model's other KV groups: 0)."""
        cheaper = bool(keys) and self.costs.reload_cheaper("disk", len(keys), record=False)
        if count and seq_id not in self._looked_up:
            self._looked_up.add(seq_id)
            self.query_tokens += query_tokens
            if keys:
                self.costs.record("disk", reload=cheaper)
        if not cheaper or not self._load_failed.isdisjoint(keys):
            return False  # nothing to read, recomputing is cheaper, or no room in the host tier
        asked = self._asked.setdefault(seq_id, set())
        fresh = [k for k in keys if k not in asked]
        asked.update(fresh)
        if tokens_of:
            self._tokens_of.update((k, tokens_of[k]) for k in fresh if k in tokens_of)
        # read once per attempt: keys read before and not in the host tier now are misses for good
        self.disk.request_reads(fresh)
        return self.disk.reading(keys) > 0

    def persistable_blocks(self) -> list[tuple[str, int, bytes]]:
        """``(tier, block id, key)`` of every cached block, host then device, not yet on disk."""
        return [(pool.name, block.block_id, key) for pool in (self.host_tier.pool, self.device)
                for key, block in pool.cached.items() if not self.disk.has(key)]

    def forget(self, seq_id: Hashable) -> None:
        """The sequence left the queue (admitted or retired): its admission attempt is over."""
        self._looked_up.discard(seq_id)
        self._asked.pop(seq_id, None)

    def step_failed(self) -> None:
        self.to_disk.clear()
