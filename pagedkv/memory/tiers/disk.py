"""The disk tier of the prefix cache: a ``LowerTier`` over a :class:`~pagedkv.memory.tiers.disk_store.DiskStore`
(the block files), with a background I/O worker, a bounded write queue and read-ahead.

Writes: a cached device block that is evicted is offered here (``offer``); unless the disk has it
(or its write is queued) or the write queue is full, it is listed in this step's
``TierCopies.to_disk``. The runner serializes it at the start of that step (before any of the
step's writes can reuse it) and the engine hands the payload to :meth:`DiskTier.offer_write`; the
worker writes it. When the queue is full the block is dropped (counted), the step never waits. At
a clean shutdown the engine writes what the upper tiers still hold (``persistable_blocks``,
:meth:`write_now`, then :meth:`close`).

Reads: a waiting request whose prefix chain continues on disk gets its blocks read in the
background (``prepare_load``, asked by ``TierStack.prefetch``) before it is admitted, while
running requests keep decoding. Finished reads are taken on the engine thread (``complete_loads``) into the host tier,
from where the ordinary host reload copies them up. A read that fails (I/O error, checksum, the
file gone) is a miss for good (the block is dropped): those tokens are recomputed.

Reads always converge: in one admission attempt (from a sequence's arrival in the waiting queue to
its ``allocate_prompt``, or its retirement) each block is read for it at most once, and no more
blocks than the host tier has room for; a read that failed, was discarded, found no room or was
evicted again before the prompt was admitted is a miss for good, and its tokens are recomputed.
(Without that, a chain longer than the host tier, read over several steps, evicted its own first
blocks as its last ones landed, and was read again, for ever.)

KV events (medium "DISK"): blocks written, evicted or discarded, as the store's index changes on
the worker thread; ``take_events`` moves them into the log on the engine thread, once per step.

Threads: the engine thread calls everything here; the worker only runs ``_work``. What this tier
shares with the remote tier (the read admission, the queues, flush, close) is ``BackgroundTier``
(``tiers/background.py``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any

from pagedkv.kv_events import MEDIUMS, KVEventLog
from pagedkv.memory.block import Block
from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.tiers.background import BackgroundTier, TierIOStats
from pagedkv.memory.tiers.base import DISK, StepCopies
from pagedkv.memory.tiers.costs import TierCosts
from pagedkv.memory.tiers.disk_store import DiskStore
from pagedkv.memory.tiers.host import HostTier

logger = logging.getLogger(__name__)

READ_TIMEOUT_S = 10.0  # a request stops waiting for reads older than this (they stay in flight)


DiskIOStats = TierIOStats  # (the name this module had for it)


class DiskTier(BackgroundTier):
    """The disk tier: ``store`` (the block files) below ``host`` (the tier its reads load into).

    Args:
        store: the opened block files (``DiskStore``); closed by :meth:`close`.
        host: the host tier, where finished reads land.
        costs: the measured costs that decide read against recompute.
        block_size: tokens per block.
        max_queued_writes: blocks waiting for the worker at most; more are dropped (counted).
        events: where the store's changes go as KV events (None: not recorded).
    """

    name = DISK
    read_timeout_s = READ_TIMEOUT_S

    def __init__(self, store: DiskStore, *, host: HostTier, costs: TierCosts, block_size: int,
                 max_queued_writes: int = 64, events: KVEventLog | None = None) -> None:
        super().__init__(store, host=host, costs=costs, block_size=block_size,
                         max_queued_writes=max_queued_writes)
        self.store = store
        self.to_disk: list[tuple[int, bytes]] = []  # (device block, key) evicted this step
        # KV events: the store's index changes (a restart first announces what it kept)
        self.events = events
        self._changes: deque[tuple[str, bytes]] | None = store.watch_changes() if events is not None else None
        self._start_worker("pagedkv-disk-tier")

    # ------------------------------------------------------------------ LowerTier
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the store indexes (no I/O: a read may still miss)."""
        n = 0
        for key in keys:
            if key not in self.store:
                break
            n += 1
        return n

    def holds(self, key: bytes) -> bool:
        return key in self.store

    def offer(self, block: Block) -> None:
        key = block.block_hash
        assert key is not None
        if not self.has(key) and not self.queue_full():
            self.to_disk.append((block.block_id, key))

    def on_cached(self, blocks: Sequence[Block]) -> None:
        """Nothing to do: blocks are written here when evicted (``offer``)."""

    def take_copies(self, copies: StepCopies) -> None:
        """This step's evicted blocks to write, handed over once; a new step begins."""
        copies.to_disk += self.to_disk
        self.to_disk = []
        self._load_failed.clear()
        self.take_events()

    def finish_step(self, copied: bool) -> None:
        if not copied:
            self.to_disk.clear()

    def take_events(self) -> None:
        """The store's changes since the last call, as KV events (engine thread)."""
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

    def prepare_load(self, seq_id: Hashable, keys: list[bytes], query_tokens: int, count: bool,
                     tokens_of: dict[bytes, int] | None = None) -> bool:
        """Read ``keys`` (a waiting prompt's blocks only the disk holds) if reloading beats
        recomputing; True while some are being read. ``query_tokens``: the prompt tokens no
        faster tier holds; ``tokens_of``: the prompt tokens a key stands for where not the block
        size (a hybrid model's other KV groups: 0)."""
        fresh = self._keys_to_read(seq_id, keys, query_tokens, count, tokens_of)
        if fresh is None:
            return False
        self.request_reads(fresh)
        return self.reading(keys) > 0

    def persistable_blocks(self, device: BlockPool) -> list[tuple[str, int, bytes]]:
        """``(tier, block id, key)`` of every cached block, host then ``device``, not yet on disk."""
        return [(pool.name, block.block_id, key) for pool in (self.host.pool, device)
                for key, block in pool.cached.items() if not self.has(key)]

    def stats(self) -> dict[str, Any]:
        d, io = self.store.stats(), self.io_stats()
        return dict(disk_enabled=d.enabled, disk_blocks=d.blocks, disk_bytes_used=d.bytes_used,
                    disk_capacity_bytes=d.capacity_bytes, disk_query_tokens=self.query_tokens,
                    disk_hit_tokens=self.hit_tokens, disk_bytes_written=d.bytes_written,
                    disk_bytes_read=d.bytes_read, disk_evictions=d.evictions,
                    disk_corrupt_discarded=d.corrupt_discarded, disk_read_errors=io.read_errors,
                    disk_write_errors=d.write_errors, disk_queue_depth=io.queued_writes,
                    disk_writes_dropped=io.writes_dropped, disk_blocked_writes=d.blocked_writes)

    def check_integrity(self) -> None:
        self.store.check_integrity()

    # ------------------------------------------------------------------ writes
    def has(self, key: bytes) -> bool:
        """On disk or queued to be written (a further write of it would be wasted)."""
        with self._cv:
            if key in self._queued:
                return True
        return key in self.store

    def queue_full(self) -> bool:
        with self._cv:
            return len(self._writes) >= self.max_queued_writes

    def offer_write(self, key: bytes, payload: bytes) -> bool:
        """Queue a block for writing; False (dropped, counted) when the queue is full or closing."""
        with self._cv:
            return self._queue_write(key, payload)

    def write_now(self, key: bytes, payload: bytes) -> bool:
        """Write a block on the calling thread, waiting for nothing but the disk (shutdown)."""
        return self._put(key, payload)

    # ------------------------------------------------------------------ reads
    def request_reads(self, keys: list[bytes]) -> int:
        """Ask for ``keys`` to be read (those not already asked for); returns how many of
        ``keys`` are still being read and were asked for less than ``READ_TIMEOUT_S`` ago."""
        now = time.monotonic()
        waiting = 0
        with self._cv:
            for key in keys:
                asked = self._pending.get(key)
                if asked is None:
                    if key in self._done:
                        continue
                    self._pending[key] = asked = now
                    self._reads.append(key)
                    self._cv.notify()
                if now - asked < READ_TIMEOUT_S:
                    waiting += 1
        return waiting

    # ------------------------------------------------------------------ the worker
    def _work(self) -> None:
        while True:
            with self._cv:
                while not (self._reads or self._writes or self._closing):
                    self._cv.wait()
                if self._closing:
                    return
                read = self._reads.popleft() if self._reads else None  # reads first: a request waits on them
                write = None if read is not None else self._writes[0]
                self._busy = True
            try:
                if read is not None:
                    self._get(read)
                else:
                    assert write is not None
                    self._put(*write)
            finally:
                with self._cv:
                    if write is not None and self._writes and self._writes[0] is write:
                        self._writes.popleft()
                        self._queued.discard(write[0])
                    self._busy = False
                    self._cv.notify_all()

    def _put(self, key: bytes, payload: bytes) -> bool:
        try:
            stored = self.store.put(key, payload)
        except Exception:  # a write never takes serving down
            logger.exception("KV disk tier: writing a block failed")
            stored = False
        if not stored:
            with self._cv:
                self.write_failures += 1
        return stored

    def _get(self, key: bytes) -> None:
        start = time.perf_counter()
        try:
            payload = self.store.get(key)
        except Exception as e:  # noqa: BLE001 - a failed read is a miss: the tokens are recomputed
            logger.warning("KV disk tier: reading a block failed (%s); it is dropped and its tokens are "
                           "recomputed", e)
            payload = None
            with self._cv:
                self.read_errors += 1
            self.store.discard(key)  # a miss for good: no later prompt waits on it again
        took = time.perf_counter() - start
        with self._cv:
            self._finish_read(key, payload)
            if payload is not None:
                self.read_blocks += 1
                self.read_seconds += took
