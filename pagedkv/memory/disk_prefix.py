"""The disk tier of the prefix cache, as the engine uses it: a background I/O worker over a
:class:`~pagedkv.memory.disk_tier.DiskTier`.

Writes: a cached device block that is evicted is written through to disk (as well as copied to the
host tier). The engine serializes the block at the start of the step that evicts it (before any
of the step's writes can reuse it) and hands the payload to :meth:`DiskPrefixTier.offer_write`;
the worker writes it. The write queue is bounded: when it is full the block is dropped (counted),
the step never waits. At a clean shutdown the engine writes what the upper tiers still hold
(:meth:`write_now`, then :meth:`close`).

Reads: a waiting request whose prefix chain continues on disk gets its blocks read in the
background (:meth:`request_reads`) before it is admitted, while running requests keep decoding.
Finished reads are collected on the engine thread (:meth:`poll`) and promoted into the host tier,
from where the ordinary host reload copies them up. A read that fails (I/O error, checksum, the
file gone) is a miss for good (the block is dropped): those tokens are recomputed.

Threads: the engine thread calls everything here; the worker only runs ``_work``. One condition
variable guards the queues and counters.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from pagedkv.memory.disk_tier import DiskTier

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


class DiskPrefixTier:
    """A :class:`DiskTier` with a background worker, a bounded write queue and read-ahead."""

    def __init__(self, disk: DiskTier, *, max_queued_writes: int = 64) -> None:
        if max_queued_writes < 1:
            raise ValueError(f"max_queued_writes must be >= 1, got {max_queued_writes}")
        self.disk = disk
        self.max_queued_writes = max_queued_writes
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

    # ------------------------------------------------------------------ writes
    def has(self, key: bytes) -> bool:
        """On disk or queued to be written (a further write of it would be wasted)."""
        with self._cv:
            if key in self._queued:
                return True
        return key in self.disk

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
        self.disk.close()

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
            stored = self.disk.put(key, payload)
        except Exception:  # noqa: BLE001 - a write never takes serving down
            logger.exception("KV disk tier: writing a block failed")
            stored = False
        if not stored:
            with self._cv:
                self.write_failures += 1
        return stored

    def _get(self, key: bytes) -> None:
        start = time.perf_counter()
        try:
            payload = self.disk.get(key)
        except Exception as e:  # noqa: BLE001 - a failed read is a miss: the tokens are recomputed
            logger.warning("KV disk tier: reading a block failed (%s); it is dropped and its tokens are "
                           "recomputed", e)
            payload = None
            with self._cv:
                self.read_errors += 1
            self.disk.discard(key)  # a miss for good: no later prompt waits on it again
        took = time.perf_counter() - start
        with self._cv:
            self._pending.pop(key, None)
            self._done[key] = payload
            if payload is not None:
                self.read_blocks += 1
                self.read_seconds += took
