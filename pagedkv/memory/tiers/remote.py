"""The remote tier of the prefix cache: a ``LowerTier`` over a
:class:`~pagedkv.memory.tiers.remote_store.RemoteStore` (a Redis server every replica shares), with
a background worker, a bounded write queue and read-ahead into the host tier.

    device pool -> host tier -> (disk tier) -> remote tier        what one replica computed,
                                                ^ shared by       the others load instead of
                                                  every replica   recomputing it

Writes: a block is offered when it becomes cached on the device (``on_cached``: full and computed),
so the other replicas can use it while it is still hot here, and again when it is evicted (a
second chance for one dropped before). Unless the tier knows the server has it, or the queue is
full (dropped, counted: the step never waits), it is listed in this step's ``TierCopies.to_disk``
(the runner serializes those blocks before anything in the step can overwrite them) and the
engine hands its payload back (:meth:`RemoteTier.offer_payload`); the worker writes it, and only
where the server lacks it. At a clean shutdown the engine writes the cached blocks the server
lacks (``persistable_blocks``, :meth:`write_now`).

Reads: a waiting prompt whose hash chain continues past the local tiers asks here
(``prepare_load``): the worker asks the server which of those blocks exist (one pipelined EXISTS)
and reads the run of them from the first in bounded batches (MGET, ``read_batch_bytes``); the
engine thread waits a few milliseconds for the answer, so a prompt the server knows nothing of is
admitted at once. Read blocks land in the host tier (``complete_loads``) and the prompt is then
admitted with them as host hits. Whether to read at all is the measured reload-or-recompute rule,
with the remote read's cost (``TierCosts``, ``REMOTE_READ``). As with the disk tier, each block is
read at most once per admission attempt, and a read that failed is a miss for good (recomputed).

What the tier knows of the server's keys is a hint, never trusted for correctness: keys it wrote or
read (``_present``, bounded) skip a write; keys found missing skip a lookup for ``ABSENT_TTL_S``
(another replica may write them meanwhile). A reconnection (a restart, a flush) forgets both.

Faults: the server down, slow, restarting or flushed makes misses and dropped writes (counted),
never a failed request; while it is backing off (``RemoteStore.available``) lookups answer
nothing at once and no block is serialized for it.

KV events (medium "REMOTE"): blocks this replica wrote, and blocks found gone or bad when read.

Threads: the engine thread calls everything but ``_work``; one condition variable guards the
queues, the hints and the worker's counters. What this tier shares with the disk tier (the read
admission, the queues, flush, close) is ``BackgroundTier`` (``tiers/background.py``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from typing import Any

from pagedkv.kv_events import MEDIUMS, KVEventLog
from pagedkv.memory.block import Block
from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.errors import IntegrityError
from pagedkv.memory.tiers.background import BackgroundTier, TierIOStats
from pagedkv.memory.tiers.base import REMOTE, StepCopies
from pagedkv.memory.tiers.costs import TierCosts
from pagedkv.memory.tiers.host import HostTier
from pagedkv.memory.tiers.remote_store import RemoteStore

logger = logging.getLogger(__name__)

READ_TIMEOUT_S = 5.0  # a request stops waiting for reads older than this
LOOKUP_WAIT_S = 0.005  # the engine thread waits this long for the EXISTS answer of a new prompt
ABSENT_TTL_S = 1.0  # a key found missing is not looked up again for this long
KNOWN_KEYS = 1 << 16  # keys remembered as present on the server, at most
WRITE_BATCH = 16  # blocks per EXISTS + SET NX pair of round trips


RemoteIOStats = TierIOStats  # (the name this module had for it)


class RemoteTier(BackgroundTier):
    """The remote tier: ``store`` (a Redis server shared by replicas) below ``host``.

    Args:
        store: the server (``RemoteStore``); closed by :meth:`close`.
        host: the host tier, where finished reads land.
        costs: the measured costs that decide read against recompute.
        block_size: tokens per block.
        max_queued_writes: blocks waiting for the worker at most; more are dropped (counted).
        read_batch_bytes: about how many bytes one MGET reads at most (at least one block).
        events: where blocks written (and found gone) go as KV events (None: not recorded).
    """

    name = REMOTE
    read_timeout_s = READ_TIMEOUT_S

    def __init__(self, store: RemoteStore, *, host: HostTier, costs: TierCosts, block_size: int,
                 max_queued_writes: int = 64, read_batch_bytes: int = 16 << 20,
                 events: KVEventLog | None = None) -> None:
        if read_batch_bytes < 1:
            raise ValueError(f"read_batch_bytes must be >= 1, got {read_batch_bytes}")
        super().__init__(store, host=host, costs=costs, block_size=block_size,
                         max_queued_writes=max_queued_writes)
        self.store = store
        self.read_batch = max(1, read_batch_bytes // max(store.payload_bytes or 1 << 20, 1))
        self.events = events
        # the engine thread's side
        self._to_write: dict[bytes, int] = {}  # key -> device block, offered since the last step
        self._serializing: set[bytes] = set()  # keys this step's copies serialize for this tier
        # shared with the worker, under self._cv
        self._present: OrderedDict[bytes, None] = OrderedDict()  # hints: on the server
        self._absent: dict[bytes, float] = {}  # hints: found missing at (monotonic time)
        self._epoch = store.epoch
        self._checks: deque[list[bytes]] = deque()  # runs of keys to look up (then read)
        self._checking: set[bytes] = set()
        self._changes: deque[tuple[str, bytes]] = deque()  # ("stored" | "removed", key) for KV events
        self._start_worker("pagedkv-remote-tier")

    # ------------------------------------------------------------------ LowerTier
    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the server may hold: up to the first one found
        missing lately (no I/O; ``prepare_load`` asks the server). 0 while it is unreachable."""
        if not self.store.available():
            return 0
        now = time.monotonic()
        with self._cv:
            self._sync_epoch()
            for n, key in enumerate(keys):
                if now - self._absent.get(key, -ABSENT_TTL_S) < ABSENT_TTL_S:
                    return n
        return len(keys)

    def holds(self, key: bytes) -> bool:
        return self.lookup((key,)) == 1

    def on_cached(self, blocks: Sequence[Block]) -> None:
        """Blocks just cached on the device: write those the server may lack (this step)."""
        for block in blocks:
            self.offer(block)

    def offer(self, block: Block) -> None:
        key = block.block_hash
        assert key is not None
        if key in self._to_write or key in self._serializing:
            return
        with self._cv:
            if key in self._present or key in self._queued:
                return
            room = len(self._writes) + len(self._to_write) < self.max_queued_writes
            if not room or not self.store.available():
                self.writes_dropped += 1
                return
        self._to_write[key] = block.block_id

    def take_copies(self, copies: StepCopies) -> None:
        """This step's blocks to serialize for the server, handed over once; a new step begins."""
        if self._to_write:
            copies.to_disk += [(b, k) for k, b in self._to_write.items()]
            self._serializing.update(self._to_write)
            self._to_write = {}
        self._load_failed.clear()
        self.take_events()

    def finish_step(self, copied: bool) -> None:
        self._serializing.clear()  # (a payload not handed back by now never will be)

    def take_events(self) -> None:
        events = self.events
        with self._cv:
            changes, self._changes = self._changes, deque()
        if events is None:
            return
        medium = MEDIUMS[REMOTE]
        for kind, key in changes:
            if kind == "stored":
                events.stored([key], None, [], medium)
            else:
                events.removed(key, medium)

    def prepare_load(self, seq_id: Hashable, keys: list[bytes], query_tokens: int, count: bool,
                     tokens_of: dict[bytes, int] | None = None) -> bool:
        """Look ``keys`` up on the server and read the run of them it holds, if reloading beats
        recomputing; True while some are on their way. Waits up to ``LOOKUP_WAIT_S`` for the
        lookup, so a prompt the server knows nothing of is admitted in this step."""
        fresh = self._keys_to_read(seq_id, keys, query_tokens, count, tokens_of)
        if fresh is None:
            return False
        now = time.monotonic()
        with self._cv:
            fresh = [k for k in fresh if k not in self._pending and k not in self._done]
            if fresh:
                for key in fresh:
                    self._pending[key] = now
                self._checking.update(fresh)
                self._checks.append(fresh)
                self._cv.notify_all()
                deadline = now + LOOKUP_WAIT_S
                while not self._checking.isdisjoint(fresh) and (left := deadline - time.monotonic()) > 0:
                    self._cv.wait(left)
        return self.reading(keys) > 0

    def stats(self) -> dict[str, Any]:
        s, io = self.store.stats(), self.io_stats()
        return dict(remote_enabled=True, remote_connected=s.connected, remote_query_tokens=self.query_tokens,
                    remote_hit_tokens=self.hit_tokens, remote_blocks_read=s.blocks_read,
                    remote_blocks_written=s.blocks_written, remote_bytes_read=s.bytes_read,
                    remote_bytes_written=s.bytes_written, remote_already_present=s.already_present,
                    remote_misses=s.misses, remote_corrupt_discarded=s.corrupt_discarded,
                    remote_errors=s.errors, remote_reconnects=s.reconnects,
                    remote_queue_depth=io.queued_writes, remote_writes_dropped=io.writes_dropped)

    def check_integrity(self) -> None:
        with self._cv:
            queued = {k for k, _ in self._writes}
            if queued != self._queued:
                raise IntegrityError(f"remote tier: {len(self._queued)} keys marked queued, "
                                     f"{len(queued)} in the write queue")
            if len(self._writes) > self.max_queued_writes:
                raise IntegrityError(f"remote tier: {len(self._writes)} queued writes > "
                                     f"{self.max_queued_writes}")
            if not self._checking <= self._pending.keys():
                raise IntegrityError("remote tier: a key is being looked up that no read waits for")

    # ------------------------------------------------------------------ writes
    def offer_payload(self, key: bytes, payload: bytes) -> bool:
        """A block this step serialized for this tier (``take_copies``): queue it for the worker.
        False when ``key`` was not serialized for this tier (it is another tier's); True when it
        is queued or dropped (queue full: counted)."""
        if key not in self._serializing:
            return False
        self._serializing.discard(key)
        with self._cv:
            self._queue_write(key, payload)  # (dropped when the queue is full: counted)
        return True

    def persistable_blocks(self, device: BlockPool) -> list[tuple[str, int, bytes]]:
        """``(tier, block id, key)`` of every cached block, host then ``device``, that the server
        lacks (one EXISTS round trip on the calling thread; empty when it is unreachable)."""
        blocks = [(pool.name, block.block_id, key) for pool in (self.host.pool, device)
                  for key, block in pool.cached.items()]
        present = self.store.exists([k for _, _, k in blocks])
        if present is None:
            return []
        return [b for b, there in zip(blocks, present) if not there]

    def write_now(self, blocks: list[tuple[bytes, bytes]]) -> int:
        """Write ``(key, payload)`` blocks on the calling thread (shutdown); how many are there now."""
        done = self.store.put_missing(blocks)
        if done is None:
            return 0
        with self._cv:
            for (key, _), ok in zip(blocks, done):
                if ok:
                    self._remember(key)
        return sum(done)

    # ------------------------------------------------------------------ lifetime
    def close(self, flush: bool = True, timeout: float | None = 30.0) -> None:
        """Stop the worker (after writing the queue, with ``flush``) and close the connection."""
        super().close(flush, timeout)

    # ------------------------------------------------------------------ hints (under self._cv)
    def _sync_epoch(self) -> None:
        if self._epoch != self.store.epoch:  # reconnected: the server may have restarted or been flushed
            self._epoch = self.store.epoch
            self._present.clear()
            self._absent.clear()

    def _remember(self, key: bytes) -> None:
        self._present[key] = None
        self._present.move_to_end(key)
        self._absent.pop(key, None)
        if len(self._present) > KNOWN_KEYS:
            self._present.popitem(last=False)

    def _missing(self, key: bytes, now: float) -> None:
        self._present.pop(key, None)
        self._absent[key] = now
        if len(self._absent) > KNOWN_KEYS:  # drop the hints that expired
            self._absent = {k: t for k, t in self._absent.items() if now - t < ABSENT_TTL_S}

    # ------------------------------------------------------------------ the worker
    def _work(self) -> None:
        while True:
            with self._cv:
                while not (self._checks or self._reads or self._writes or self._closing):
                    self._cv.wait()
                if self._closing:
                    return
                # lookups first, then reads (a request waits on both), then writes
                check = self._checks.popleft() if self._checks else None
                reads: list[bytes] = []
                if check is None and self._reads:
                    while self._reads and len(reads) < self.read_batch:
                        reads.append(self._reads.popleft())
                writes = [] if check is not None or reads else [self._writes[i] for i in
                                                                 range(min(WRITE_BATCH, len(self._writes)))]
                self._busy = True
            try:
                if check is not None:
                    self._check(check)
                elif reads:
                    self._read(reads)
                else:
                    self._write(writes)
            except Exception:  # the worker never dies: what it held becomes misses
                logger.exception("KV remote tier: the worker failed a round trip")
                with self._cv:
                    for key in (check or reads):
                        self._finish_read(key, None)
            finally:
                with self._cv:
                    for _ in writes:
                        key, _ = self._writes.popleft()
                        self._queued.discard(key)
                    self._busy = False
                    self._cv.notify_all()

    def _check(self, keys: list[bytes]) -> None:
        """Which of ``keys`` the server holds (one round trip); queue the run of them from the
        first for reading, and finish the rest as misses."""
        found = self.store.exists(keys)
        now = time.monotonic()
        with self._cv:
            self._checking.difference_update(keys)
            self._sync_epoch()
            run = 0
            if found is not None:
                for key, there in zip(keys, found):
                    if not there:
                        self._missing(key, now)
                while run < len(keys) and found[run]:
                    run += 1
            for key in keys[run:]:
                self._finish_read(key, None)
            self._reads.extend(keys[:run])
            self._cv.notify_all()

    def _read(self, keys: list[bytes]) -> None:
        start = time.perf_counter()
        payloads = self.store.get(keys)
        took = time.perf_counter() - start
        now = time.monotonic()
        with self._cv:
            if payloads is None:
                self.read_errors += len(keys)
                payloads = [None] * len(keys)
            got = sum(p is not None for p in payloads)
            if got:
                self.read_blocks += got
                self.read_seconds += took
            for key, payload in zip(keys, payloads):
                if payload is not None:
                    self._remember(key)
                elif self.store.available():  # gone (evicted, flushed) or bad: the others learn it too
                    self._missing(key, now)
                    self._changes.append(("removed", key))
                self._finish_read(key, payload)

    def _finish_read(self, key: bytes, payload: bytes | None) -> None:
        super()._finish_read(key, payload)
        self._checking.discard(key)

    def _write(self, writes: list[tuple[bytes, bytes]]) -> None:
        done = self.store.put_missing(writes)
        with self._cv:
            if done is None:
                self.write_failures += len(writes)
                return
            self._sync_epoch()
            for (key, _), ok in zip(writes, done):
                if ok:
                    self._remember(key)
                    self._changes.append(("stored", key))
                else:
                    self.write_failures += 1
