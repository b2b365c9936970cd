"""The manager's lower tiers, fastest first, as one object: it hears the device pool's evictions
and hands each step's verbs to every tier in turn (``tiers/base.py``).

Why a stack and not named fields: the manager calls the same verbs on every tier (offer, take
the step's copies, finish the step, take events, forget a sequence, read ahead, stats, check),
so a further tier (a store shared by replicas, loading into the host tier like the disk) is one
more entry here (``more``, built beside the host and disk tiers) and no edit to the manager's
verbs. The two things only one tier does keep their names: ``host`` (admission reloads its
blocks straight into device blocks) and ``disk`` (the engine's write queue, the wait for its
reads, and the shutdown writes).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import Any

from pagedkv.memory.block import Block
from pagedkv.memory.block_pool import DROPPED, BlockPool
from pagedkv.memory.tiers.base import LowerTier, StepCopies, TierCopies
from pagedkv.memory.tiers.disk import DiskTier
from pagedkv.memory.tiers.host import HostTier

NO_COPIES = TierCopies()


class TierStack:
    """The lower tiers of the prefix cache below the device pool, fastest first."""

    def __init__(self, host: HostTier | None = None, disk: DiskTier | None = None,
                 more: tuple[LowerTier, ...] = ()) -> None:
        if disk is not None and host is None:
            raise ValueError("the disk tier loads into the host tier: give the host tier too")
        self.host = host
        self.disk = disk
        self.tiers: tuple[LowerTier, ...] = tuple(t for t in (host, disk) if t is not None) + more

    def __iter__(self) -> Iterator[LowerTier]:
        return iter(self.tiers)

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def on_evict(self, block: Block, cause: str) -> None:
        """A cached device block is being evicted: every tier may keep a copy (an
        ``EvictionListener`` of the device pool). Not of a ``DROPPED`` one: its KV is not to be
        trusted (``BlockPool.evict_cached(keep_contents=False)``)."""
        if cause != DROPPED:
            for tier in self.tiers:
                tier.offer(block)

    def on_cached(self, blocks: Sequence[Block]) -> None:
        """Device blocks just became cached: every tier hears of them (a shared one writes them)."""
        for tier in self.tiers:
            tier.on_cached(blocks)

    def take_copies(self) -> TierCopies:
        """This step's copies between the tiers, handed over once (see ``TierCopies``)."""
        if not self.tiers:
            return NO_COPIES
        copies = StepCopies()
        for tier in self.tiers:
            tier.take_copies(copies)
        return copies.frozen()

    def wait_for_loads(self, timeout: float) -> bool:
        """Block until a tier below the host finishes a load (or none is in flight), at most
        ``timeout`` seconds (each such tier in turn); True when one is ready."""
        return any(tier.wait_for_loads(timeout) for tier in self.below_host)

    @property
    def below_host(self) -> tuple[LowerTier, ...]:
        """The tiers that load into the host tier in the background (disk, ...)."""
        return self.tiers[1:] if self.host is not None else ()

    def prefetch(self, seq_id: Hashable, hashes: list[bytes], count: bool, device: BlockPool,
                 block_size: int) -> bool:
        """A one-group prompt's read-ahead; ``hashes``: its block hashes that could be hits. Past
        the run the device and the host tier hold, each tier below the host starts loading the run
        of the next blocks it holds, no more than the host tier has room for (more would evict the
        chain's own first blocks); a tier further down is asked for the blocks past the run the
        ones above it hold. True while some are on their way (admit the prompt later)."""
        host = self.host
        if host is None:
            return False
        self.complete_loads(device)
        cached = device.cached
        first = next((i for i, h in enumerate(hashes) if h not in cached), len(hashes))
        on_host = len(host.match(hashes[first:]))
        first += on_host
        room = host.pool.num_free - on_host  # (the host hits are cached-free there too)
        window = hashes[first:first + max(room, 0)]
        query_tokens = (len(hashes) - first) * block_size
        waiting = False
        for tier in self.below_host:
            keys = window[:tier.lookup(window)]
            waiting |= tier.prepare_load(seq_id, keys, query_tokens, count)
            window = window[len(keys):]
            query_tokens -= len(keys) * block_size
        return waiting

    def complete_loads(self, device: BlockPool) -> None:
        for tier in self.tiers:
            tier.complete_loads(device)

    def finish_step(self, copied: bool) -> None:
        for tier in self.tiers:
            tier.finish_step(copied)

    def take_events(self) -> None:
        for tier in self.tiers:
            tier.take_events()

    def forget(self, seq_id: Hashable) -> None:
        for tier in self.tiers:
            tier.forget(seq_id)

    def held_blocks(self) -> list[int]:
        return [b for tier in self.tiers for b in tier.held_blocks()]

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for tier in self.tiers:
            out.update(tier.stats())
        return out

    def check_integrity(self) -> None:
        for tier in self.tiers:
            tier.check_integrity()
