"""What the disk and remote tiers share: a lower tier below the host tier whose blocks a background
worker writes and reads, so the engine's step never waits on I/O.

    engine thread                          the worker (one thread per tier)
    offer ... take_copies ─ payloads ─>    _writes (bounded: a full queue drops, counted)
    prepare_load ─ keys ──────────────>    the tier's reads (``_pending``: asked at)
    complete_loads <─ poll <──────────     _done (key -> payload, None for a miss)

The engine-thread half of a read is the same in both tiers and lives here: whether a waiting
prompt's blocks are worth reading (the measured reload-or-recompute rule, counted once per
admission attempt), which of them were not yet read for it (each block at most once per attempt:
reads converge), and moving finished reads into the host tier. How the worker talks to its store
(one file at a time, or batched round trips to a server) is each tier's own ``_work``.

One condition variable (``_cv``) guards the queues and the worker's counters.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.tiers.costs import TierCosts
from pagedkv.memory.tiers.host import HostTier


class ClosableStore(Protocol):
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class TierIOStats:
    queued_writes: int  # write queue depth now
    max_queued_writes: int
    writes_dropped: int  # blocks not queued: the queue was full (or the server unreachable)
    write_failures: int  # blocks the worker could not store (tier disabled, too big, I/O error, server down)
    reads_pending: int
    read_errors: int  # reads that failed (counted as misses)
    read_blocks: int  # reads finished with a payload
    read_seconds: float  # worker time spent in reads that returned a payload


class BackgroundTier:
    """The shared half of a tier served by a background worker (``DiskTier``, ``RemoteTier``).

    A subclass sets ``name`` and ``read_timeout_s``, keeps its store in ``self.store``, implements
    ``_work`` (the worker's loop) and calls :meth:`_start_worker` at the end of its ``__init__``.
    """

    name: str
    read_timeout_s: float  # a request stops waiting for reads asked for longer ago than this

    def __init__(self, store: ClosableStore, *, host: HostTier, costs: TierCosts, block_size: int,
                 max_queued_writes: int) -> None:
        if max_queued_writes < 1:
            raise ValueError(f"max_queued_writes must be >= 1, got {max_queued_writes}")
        self.host = host
        self.costs = costs
        self.block_size = block_size
        self.max_queued_writes = max_queued_writes
        self._store = store
        # the engine thread's side: what waiting prompts asked to read
        self.query_tokens = 0  # prompt tokens looked up here (past the faster tiers)
        self.hit_tokens = 0  # tokens read from here into the host tier
        self._looked_up: set[Hashable] = set()  # waiting sequences whose lookup was counted
        self._asked: dict[Hashable, set[bytes]] = {}  # per waiting sequence: blocks read for it, this attempt
        self._load_failed: set[bytes] = set()  # reads of this step the host tier had no room for
        self._tokens_of: dict[bytes, int] = {}  # prompt tokens a requested key stands for, when not B
        # the worker's side, under self._cv
        self._cv = threading.Condition()
        self._writes: deque[tuple[bytes, bytes]] = deque()
        self._queued: set[bytes] = set()  # keys in self._writes
        self._reads: deque[bytes] = deque()
        self._pending: dict[bytes, float] = {}  # key -> when its read was asked for
        self._done: dict[bytes, bytes | None] = {}  # finished reads, until poll()
        self._busy = False  # the worker is inside a store call
        self._closing = False
        self.writes_dropped = 0
        self.write_failures = 0
        self.read_errors = 0
        self.read_blocks = 0
        self.read_seconds = 0.0
        self._worker: threading.Thread | None = None

    def _start_worker(self, thread_name: str) -> None:
        self._worker = threading.Thread(target=self._work, name=thread_name, daemon=True)
        self._worker.start()

    def _work(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ reads, engine thread
    def complete_loads(self, device: BlockPool) -> None:
        """Take the blocks read since the last call into the host tier (not those ``device`` holds)."""
        for key, payload in self.poll():
            tokens = self._tokens_of.pop(key, self.block_size)
            if key in device.cached:
                continue
            if self.host.load(key, payload, self.name):
                self.hit_tokens += tokens
            else:  # no host block free this step: whoever waits for it recomputes instead
                self._load_failed.add(key)

    def _keys_to_read(self, seq_id: Hashable, keys: list[bytes], query_tokens: int, count: bool,
                      tokens_of: dict[bytes, int] | None) -> list[bytes] | None:
        """The first half of ``prepare_load``: count the lookup (once per attempt), decide reload
        against recompute, and return the keys not yet read for ``seq_id`` in this attempt (keys
        read before and not in the host tier now are misses for good); None when nothing is to be
        read (no keys, recomputing is cheaper, or no room in the host tier)."""
        cheaper = bool(keys) and self.costs.reload_cheaper(self.name, len(keys), record=False)
        if count and seq_id not in self._looked_up:
            self._looked_up.add(seq_id)
            self.query_tokens += query_tokens
            if keys:
                self.costs.record(self.name, reload=cheaper)
        if not cheaper or not self._load_failed.isdisjoint(keys):
            return None
        asked = self._asked.setdefault(seq_id, set())
        fresh = [k for k in keys if k not in asked]
        asked.update(fresh)
        if tokens_of:
            self._tokens_of.update((k, tokens_of[k]) for k in fresh if k in tokens_of)
        return fresh

    def forget(self, seq_id: Hashable) -> None:
        """The sequence left the queue (admitted or retired): its admission attempt is over."""
        self._looked_up.discard(seq_id)
        self._asked.pop(seq_id, None)

    def held_blocks(self) -> list[int]:
        return []

    def wait_for_loads(self, timeout: float) -> bool:
        """Block until a read finishes (or none is pending), at most ``timeout`` seconds: an engine
        with nothing to run but requests waiting for reads sleeps here instead of spinning (which
        would also starve the worker of the GIL). True if a read is ready to poll."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not self._done and self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            return bool(self._done)

    def reading(self, keys: list[bytes]) -> int:
        """How many of ``keys`` are on their way (asked for less than ``read_timeout_s`` ago) or
        read and not yet polled; asks for nothing."""
        now = time.monotonic()
        with self._cv:
            return sum(1 for k in keys if self._done.get(k) is not None or (
                (asked := self._pending.get(k)) is not None and now - asked < self.read_timeout_s))

    def poll(self) -> list[tuple[bytes, bytes]]:
        """The reads finished since the last poll that found a block: ``(key, payload)`` pairs."""
        with self._cv:
            done, self._done = self._done, {}
        return [(k, p) for k, p in done.items() if p is not None]

    def _finish_read(self, key: bytes, payload: bytes | None) -> None:
        """(Under ``_cv``, worker thread.) A read is over: ``payload``, or None for a miss."""
        self._pending.pop(key, None)
        self._done[key] = payload

    # ------------------------------------------------------------------ writes
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

    def _queue_write(self, key: bytes, payload: bytes) -> bool:
        """(Under ``_cv``.) Queue a block for the worker; False (dropped, counted) when the queue is
        full or the tier is closing. A key already queued counts as queued."""
        if key in self._queued:
            return True
        if self._closing or len(self._writes) >= self.max_queued_writes:
            self.writes_dropped += 1
            return False
        self._writes.append((key, payload))
        self._queued.add(key)
        self._cv.notify_all()  # the worker, not only a flush() waiting on the same condition
        return True

    # ------------------------------------------------------------------ lifetime
    def close(self, flush: bool = True, timeout: float | None = 60.0) -> None:
        """Stop the worker (after writing the queue, with ``flush``) and close the store."""
        if flush:
            self.flush(timeout)
        with self._cv:
            self._closing = True
            self._writes.clear()
            self._queued.clear()
            self._cv.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=5.0)
        self._store.close()

    def io_stats(self) -> TierIOStats:
        with self._cv:
            return TierIOStats(len(self._writes), self.max_queued_writes, self.writes_dropped,
                               self.write_failures, len(self._pending), self.read_errors, self.read_blocks,
                               self.read_seconds)
