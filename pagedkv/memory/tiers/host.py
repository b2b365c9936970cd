"""The host tier of the prefix cache: cached blocks evicted from the device pool live on in the
host pool, and a prompt whose prefix continues there reloads them instead of recomputing.

The host pool is shared with swapped-out sequences, which outrank cached blocks (a swap-out may
take any cached host block, least recently used first). Offloads and reloads are copies the
runner makes before the step's forward pass: :meth:`HostTier.take_copies` hands them over
(offloads go with the swap-outs, reloads with the swap-ins) and :meth:`finish_step`, once they are
done, releases the host blocks they read or wrote. Until then those blocks are held (one extra
reference), so nothing later in the same step can reuse one that a copy still reads or writes.

A ``LowerTier`` (``tiers/base.py``). It is the tier right below the device, so its hits need no
preparation: admission finds them (``match``), holds them (``hold``) and reloads them into the
prompt's fresh device blocks (``reload``) in the same step. The tier below it loads blocks into
it (``load``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from pagedkv.kv_events import KVEventLog
from pagedkv.memory.block import Block
from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.errors import IntegrityError
from pagedkv.memory.tiers.base import HOST, REMOTE, CopyPair, StepCopies


class HostTier:
    """Cached blocks evicted from the device, in the host pool (shared with swapped sequences)."""

    name = HOST

    def __init__(self, host_pool: BlockPool, events: KVEventLog | None = None) -> None:
        self.pool = host_pool
        self.events = events  # KV cache events of the blocks stored here (its pool records removals)
        self.offloaded_blocks = 0  # cached device blocks copied down on eviction
        self.offloads_dropped = 0  # evictions not copied: no host block could be taken
        self.reloaded_blocks = 0  # host blocks copied back up for a prompt's prefix
        self.hit_tokens = 0  # prompt tokens found here (part of the manager's prefix hits)
        self._out: list[CopyPair] = []  # (device, host) offloads of this step
        self._in: list[CopyPair] = []  # (host, device) reloads of this step
        self.held: list[Block] = []  # host blocks read or written by this step's copies
        self._offloaded_now: list[Block] = []  # host blocks this step's offloads or disk loads write
        self._loads: list[tuple[int, bytes]] = []  # (host block, payload) read from disk, this step
        self.disk_loaded_blocks = 0  # blocks read from the disk tier into this tier
        self.from_disk: set[bytes] = set()  # hashes loaded from disk and not yet reloaded (cache details)
        self.from_remote: set[bytes] = set()  # the same, loaded from the remote tier

    # ------------------------------------------------------------------ LowerTier
    def lookup(self, keys: Sequence[bytes]) -> int:
        return len(self.match(keys))

    def holds(self, key: bytes) -> bool:
        return key in self.pool.cached

    def prepare_load(self, seq_id: Hashable, keys: list[bytes], query_tokens: int, count: bool,
                     tokens_of: dict[bytes, int] | None = None) -> bool:
        """Nothing to prepare: host blocks are in memory, admission reloads them (``reload``)."""
        return False

    def complete_loads(self, device: BlockPool) -> None:
        """Nothing in flight: a reload is listed as it is decided."""

    def on_cached(self, blocks: Sequence[Block]) -> None:
        """Nothing to do: blocks come here when evicted from the device (``offer``)."""

    def take_events(self) -> None:
        """Nothing queued: the host pool records its removals and this tier its stores as they happen."""

    def forget(self, seq_id: Hashable) -> None:
        """No per-sequence state."""

    def wait_for_loads(self, timeout: float) -> bool:
        """Nothing loads in the background here."""
        return False

    def held_blocks(self) -> list[int]:
        return [b.block_id for b in self.held]

    def take_copies(self, copies: StepCopies) -> None:
        """This step's ``(device, host)`` offloads, ``(host, device)`` reloads and ``(host block,
        payload)`` disk loads, handed over once."""
        copies.offloads += self._out
        copies.reloads += self._in
        copies.from_disk += self._loads
        self._out, self._in, self._loads = [], [], []

    def stats(self) -> dict[str, Any]:
        return dict(host_hit_tokens=self.hit_tokens, offloaded_blocks=self.offloaded_blocks,
                    offloads_dropped=self.offloads_dropped, reloaded_blocks=self.reloaded_blocks)

    def check_integrity(self) -> None:
        """Every held block is referenced; every pending copy's host block is held."""
        held = {b.block_id for b in self.held}
        for block in self.held:
            if block.ref_count < 1:
                raise IntegrityError(f"host tier: held {block} has no reference")
        pending = [h for _, h in self._out] + [h for h, _ in self._in] + [h for h, _ in self._loads]
        if not held.issuperset(pending):
            raise IntegrityError(f"host tier: copies of this step use host blocks it does not hold: "
                                 f"{sorted(set(pending) - held)}")

    # ------------------------------------------------------------------ offloads and loads
    def offer(self, block: Block) -> None:
        """Copy a cached device block that is being evicted down here (most recently used)."""
        host = self.pool
        block_hash = block.block_hash
        assert block_hash is not None
        there = host.cached.get(block_hash)
        if there is not None:  # already here: it becomes the most recently used
            host.touch(there)
            host.free((there,))
            return
        if host.num_free == 0:
            self.offloads_dropped += 1
            return
        target = host.allocate(1)[0]  # may forget this tier's least recently used block
        host.cache((target,), (block_hash,), block.kv_group)
        if self.events is not None and block.kv_group == 0:
            self.events.stored([block_hash], None, [], host.medium)
        self.held.append(target)
        self._offloaded_now.append(target)
        self._out.append((block.block_id, target.block_id))
        self.offloaded_blocks += 1

    def load(self, block_hash: bytes, payload: bytes, source: str = "disk") -> bool:
        """Take a block read from the disk (or ``source``: remote) tier into this tier (most recently
        used); the runner writes ``payload`` into it before this step's reloads. False when no
        host block is free."""
        host = self.pool
        if block_hash in host.cached or host.num_free == 0:
            return False
        target = host.allocate(1)[0]
        host.cache((target,), (block_hash,))
        if self.events is not None:
            self.events.stored([block_hash], None, [], host.medium)
        self.held.append(target)
        self._offloaded_now.append(target)
        self._loads.append((target.block_id, payload))
        self.disk_loaded_blocks += 1
        loaded = self.from_remote if source == REMOTE else self.from_disk
        if len(loaded) > host.num_blocks:  # forget loads whose blocks left this tier unused
            loaded &= host.cached.keys()
        loaded.add(block_hash)
        return True

    # ------------------------------------------------------------------ admission (reloads)
    def match(self, block_hashes: Iterable[bytes]) -> list[Block]:
        """The blocks holding the longest run of ``block_hashes`` from its start."""
        hits = []
        for block_hash in block_hashes:
            block = self.pool.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def hold(self, blocks: Iterable[Block]) -> None:
        """Keep host blocks from reuse until :meth:`finish_step` (a copy reads them this step)."""
        for block in blocks:
            self.pool.touch(block)
            self.held.append(block)

    def reload(self, hits: list[Block], device_blocks: Iterable[Block], block_size: int) -> None:
        """Copy the (held) host ``hits`` up into ``device_blocks`` this step."""
        self._in += [(h.block_id, d.block_id) for h, d in zip(hits, device_blocks)]
        self.reloaded_blocks += len(hits)
        self.hit_tokens += len(hits) * block_size

    # ------------------------------------------------------------------ the step
    def finish_step(self, copied: bool = True) -> None:
        """The step's copies are over: release the blocks they held. With ``copied=False`` (the
        step's shared work failed) the blocks offloaded or loaded from disk in it are forgotten:
        their copy may not have happened."""
        if self._out or self._in or self._loads:
            raise RuntimeError("finish_step: this step's tier copies were never taken (take_tier_copies)")
        held, self.held = self.held, []
        offloaded, self._offloaded_now = self._offloaded_now, []
        if not copied:
            cached = self.pool.cached
            for block in offloaded:
                if block.block_hash is not None and cached.get(block.block_hash) is block:
                    del cached[block.block_hash]
                    block.block_hash = None
        self.pool.free(held)
