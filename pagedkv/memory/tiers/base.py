"""The lower tiers of the prefix cache: one protocol, and what a step hands the runner.

The prefix cache is a stack of tiers, fastest first::

    device pool  ->  host tier  ->  disk tier  ->  remote tier (a Redis server shared by replicas)
    BlockPool        HostTier       DiskTier         RemoteTier
                     tiers/host.py  tiers/disk.py    tiers/remote.py (over tiers/remote_store.py)
                                    (disk_store.py)

A cached device block that is evicted is offered to every lower tier (``offer``); each keeps it
or not by its own rules. A prompt whose hash chain continues below the device is served from
the tier that holds it: the host tier's blocks are reloaded straight into device blocks while
the prompt is admitted (its admission verbs: ``HostTier.match`` / ``hold`` / ``reload``); a
deeper tier first loads them into the tier above it, in the background, while the prompt waits
(``prepare_load``, then ``complete_loads`` on a later step). A tier shared by replicas also hears
of each block as it becomes cached (``on_cached``), to share it while it is hot. The bytes move in the runner, before
the step's forward pass: each tier adds its copies to the step's ``TierCopies`` (``take_copies``)
and is told when they are done, or failed (``finish_step``).

The manager holds the lower tiers as a list (``tiers/stack.py``: ``TierStack``) and calls these
verbs on each in turn, so a new tier is a new class here and no edit to the manager.

Moving a whole sequence out of the device and back (swap, preemption by swap) is not a tier of
the prefix cache: see ``memory/swap.py``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedkv.memory.block import Block
from pagedkv.memory.block_pool import BlockPool

DEVICE = "device"
HOST = "host"
DISK = "disk"
REMOTE = "remote"

CopyPair = tuple[int, int]  # (source block id, destination block id)


@dataclass(frozen=True, slots=True)
class TierCopies:
    """One step's copies between the tiers of the prefix cache, made by the runner before the
    forward pass, in this order: ``to_disk`` (serialize evicted device blocks, before anything in
    the step can overwrite them), ``from_disk`` (payloads read from disk into host blocks),
    ``offloads`` (with the swap-outs), ``reloads`` (with the swap-ins)."""

    offloads: tuple[tuple[int, int], ...] = ()  # (device block, host block)
    reloads: tuple[tuple[int, int], ...] = ()  # (host block, device block)
    to_disk: tuple[tuple[int, bytes], ...] = ()  # (device block, key): serialized for the disk or remote tier
    from_disk: tuple[tuple[int, bytes], ...] = ()  # (host block, payload)


@dataclass(slots=True)
class StepCopies:
    """The step's copies as the tiers add them (``LowerTier.take_copies``); frozen into a
    ``TierCopies`` for the plan."""

    offloads: list[CopyPair] = field(default_factory=list)
    reloads: list[CopyPair] = field(default_factory=list)
    to_disk: list[tuple[int, bytes]] = field(default_factory=list)
    from_disk: list[tuple[int, bytes]] = field(default_factory=list)

    def frozen(self) -> TierCopies:
        return TierCopies(tuple(self.offloads), tuple(self.reloads), tuple(self.to_disk), tuple(self.from_disk))


class LowerTier(Protocol):
    """A tier of the prefix cache below the device pool. Called on the engine thread only.

    Keys are block hashes (``prefix_hash``: chained, tenant salt and adapter mixed in; a hybrid
    model's other KV groups under ``group_hash``)."""

    name: str  # "host", "disk": KVStats fields and KV event mediums follow it

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, this tier holds now; no I/O, changes nothing."""
        ...

    def holds(self, key: bytes) -> bool:
        """Whether this tier holds ``key`` now; no I/O, changes nothing."""
        ...

    def prepare_load(self, seq_id: Hashable, keys: list[bytes], query_tokens: int, count: bool,
                     tokens_of: dict[bytes, int] | None = None) -> bool:
        """Start bringing ``keys`` (a waiting prompt's blocks only this tier holds) up to the tier
        above, if that beats recomputing them; True while some are still on their way (admit the
        prompt later). ``query_tokens``: the prompt's tokens no faster tier holds (counted once
        per admission attempt when ``count``); ``tokens_of``: prompt tokens a key stands for where
        not one block's."""
        ...

    def complete_loads(self, device: BlockPool) -> None:
        """Take the loads finished since the last call into the tier above (a step's copies);
        a block ``device`` has cached meanwhile needs none."""
        ...

    def offer(self, block: Block) -> None:
        """A cached device block is being evicted: keep a copy of it, or not (this tier's rules)."""
        ...

    def on_cached(self, blocks: Sequence[Block]) -> None:
        """Device blocks just became cached (full, computed): a tier shared by replicas lists them
        to write now (``take_copies``), while they are hot; the others do nothing."""
        ...

    def take_copies(self, copies: StepCopies) -> None:
        """Add this step's copies to ``copies``, handed over once; a new step begins."""
        ...

    def finish_step(self, copied: bool) -> None:
        """The step's copies are done (``copied=False``: the step's shared work failed, so what it
        copied into this tier may be missing and is forgotten)."""
        ...

    def take_events(self) -> None:
        """Move this tier's KV cache events since the last call into the manager's event log."""
        ...

    def forget(self, seq_id: Hashable) -> None:
        """The sequence left the waiting queue (admitted or retired): forget its load attempt."""
        ...

    def wait_for_loads(self, timeout: float) -> bool:
        """Block until a load in flight finishes (or none is), at most ``timeout`` seconds; True
        when one is ready for ``complete_loads``. An engine with nothing to run but prompts
        waiting for loads sleeps here instead of spinning."""
        ...

    def held_blocks(self) -> list[int]:
        """Host block ids this tier holds a reference to for the step's copies (integrity check)."""
        ...

    def stats(self) -> dict[str, Any]:
        """This tier's ``KVStats`` fields (named ``{name}_...``, and the host tier's own names)."""
        ...

    def check_integrity(self) -> None:
        """Raise IntegrityError unless this tier's own structures agree."""
        ...
