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

Threads: the engine thread calls everything here; the worker only runs ``_work``. One condition
variable guards the queues and the worker's counters.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.kv_events import MEDIUMS, KVEventLog
from pagedkv.memory.block import Block
from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.tiers.base import DISK, StepCopies
from pagedkv.memory.tiers.costs import TierCosts
from pagedkv.memory.tiers.disk_store import DiskStore
from pagedkv.memory.tiers.host import HostTier

logger = logging.getLogger(__name__)

READ_TIMEOUT_S = 10.0  # a request stops waiting for reads older than this (they stay in flight)


@dataclass(frozen=True, slots=True)
class DiskIOStats:
    queued_writes: int  # offload queue depth now
    max_queued_writes: int
    writes_dropped: int  # offloads not queued: the queue was full
    write_failures: int  # puts that stored nothing (tier disabled, block too big, I/O error)
    reads_pending: int
    read_errors: int  # reads that raised (counted as misses)
    read_blocks: int  # reads finished with a payload
    read_seconds: float  # worker time spent in reads that returned a payload


class DiskTier:
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

    def __init__(self, store: DiskStore, *, host: HostTier, costs: TierCosts, block_size: int,
                 max_queued_writes: int = 64, events: KVEventLog | None = None) -> None:
        if max_queued_writes < 1:
            raise ValueError(f"max_queued_writes must be >= 1, got {max_queued_writes}")
        self.store = store
        self.host = host
        self.costs = costs
        self.block_size = block_size
        self.max_queued_writes = max_queued_writes
        # the engine thread's side: what to write, what waiting prompts asked to read
        self.query_tokens = 0  # prompt tokens looked up on disk (past the device and host tiers)
        self.hit_tokens = 0  # tokens read from disk into the host tier
        self.to_disk: list[tuple[int, bytes]] = []  # (device block, key) evicted this step
        self._looked_up: set[Hashable] = set()  # waiting sequences whose lookup was counted
        self._asked: dict[Hashable, set[bytes]] = {}  # per waiting sequence: blocks read for it, this attempt
        self._load_failed: set[bytes] = set()  # reads of this step the host tier had no room for
        self._tokens_of: dict[bytes, int] = {}  # prompt tokens a requested key stands for, when not B
        # KV events: the store's index changes (a restart first announces what it kept)
        self.events = events
        self._changes: deque[tuple[str, bytes]] | None = store.watch_changes() if events is not None else None
        # the worker's side, under self._cv
        self._cv = threading.Condition()
        self._writes: deque[tuple[bytes, bytes]] = deque()
        self._queued: set[bytes] = set()  # keys in self._writes
        self._reads: deque[bytes] = deque()
        self._pending: dict[bytes, float] = {}  # key -> when its read was asked for
        self._done: dict[bytes, bytes | None] = {}  # finished reads, until poll()
        self._busy = False  # the worker is inside a put or a get
        self._closing = False
        self.writes_dropped = 0
        self.write_failures = 0
        self.read_errors = 0
        self.read_blocks = 0
        self.read_seconds = 0.0
        self._worker = threading.Thread(target=self._work, name="pagedkv-disk-tier", daemon=True)
        self._worker.start()

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

    def complete_loads(self, device: BlockPool) -> None:
        """Take the blocks read since the last call into the host tier (not those ``device`` holds)."""
        for key, payload in self.poll():
            tokens = self._tokens_of.pop(key, self.block_size)
            if key in device.cached:
                continue
            if self.host.load(key, payload):
                self.hit_tokens += tokens
            else:  # no host block free this step: whoever waits for it recomputes instead
                self._load_failed.add(key)

    def prepare_load(self, seq_id: Hashable, keys: list[bytes], query_tokens: int, count: bool,
                     tokens_of: dict[bytes, int] | None = None) -> bool:
        """Read ``keys`` (a waiting prompt's blocks only the disk holds) if reloading beats
        recomputing; True while some are being read. ``query_tokens``: the prompt tokens no
        faster tier holds; ``tokens_of``: the prompt tokens a key stands for where not the block
        size (a hybrid model's other KV groups: 0)."""
        cheaper = bool(keys) and self.costs.reload_cheaper(DISK, len(keys), record=False)
        if count and seq_id not in self._looked_up:
            self._looked_up.add(seq_id)
            self.query_tokens += query_tokens
            if keys:
                self.costs.record(DISK, reload=cheaper)
        if not cheaper or not self._load_failed.isdisjoint(keys):
            return False  # nothing to read, recomputing is cheaper, or no room in the host tier
        asked = self._asked.setdefault(seq_id, set())
        fresh = [k for k in keys if k not in asked]
        asked.update(fresh)
        if tokens_of:
            self._tokens_of.update((k, tokens_of[k]) for k in fresh if k in tokens_of)
        # read once per attempt: keys read before and not in the host tier now are misses for good
        self.request_reads(fresh)
        return self.reading(keys) > 0

    def forget(self, seq_id: Hashable) -> None:
        """The sequence left the queue (admitted or retired): its admission attempt is over."""
        self._looked_up.discard(seq_id)
        self._asked.pop(seq_id, None)

    def held_blocks(self) -> list[int]:
        return []

    def wait_for_loads(self, timeout: float) -> bool:
        return self.wait_for_reads(timeout)

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
            if key in self._queued:
                return True
            if self._closing or len(self._writes) >= self.max_queued_writes:
                self.writes_dropped += 1
                return False
            self._writes.append((key, payload))
            self._queued.add(key)
            self._cv.notify()
            return True

    def write_now(self, key: bytes, payload: bytes) -> bool:
        """Write a block on the calling thread, waiting for nothing but the disk (shutdown)."""
        return self._put(key, payload)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the write queue is empty and the worker idle; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._writes or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

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

    def reading(self, keys: list[bytes]) -> int:
        """How many of ``keys`` are being read (asked for less than ``READ_TIMEOUT_S`` ago) or read
        and not yet polled; asks for nothing."""
        now = time.monotonic()
        with self._cv:
            return sum(1 for k in keys if k in self._done or (
                (asked := self._pending.get(k)) is not None and now - asked < READ_TIMEOUT_S))

    def wait_for_reads(self, timeout: float) -> bool:
        """Block until a read finishes (or none is pending), at most ``timeout`` seconds: an engine
        with nothing to run but requests waiting for the disk sleeps here instead of spinning
        (which would also starve the worker of the GIL). True if a read is ready to poll."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not self._done and self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            return bool(self._done)

    def poll(self) -> list[tuple[bytes, bytes]]:
        """The reads finished since the last poll that found a block: ``(key, payload)`` pairs."""
        with self._cv:
            done, self._done = self._done, {}
        return [(k, p) for k, p in done.items() if p is not None]

    # ------------------------------------------------------------------ lifetime
    def close(self, flush: bool = True, timeout: float | None = 60.0) -> None:
        """Stop the worker (after writing the queue, with ``flush``) and close the directory."""
        if flush:
            self.flush(timeout)
        with self._cv:
            self._closing = True
            self._writes.clear()
            self._queued.clear()
            self._cv.notify_all()
        self._worker.join(timeout=5.0)
        self.store.close()

    def io_stats(self) -> DiskIOStats:
        with self._cv:
            return DiskIOStats(len(self._writes), self.max_queued_writes, self.writes_dropped,
                               self.write_failures, len(self._pending), self.read_errors, self.read_blocks,
                               self.read_seconds)

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
            self._pending.pop(key, None)
            self._done[key] = payload
            if payload is not None:
                self.read_blocks += 1
                self.read_seconds += took
