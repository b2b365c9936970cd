"""KV cache events: which prefix blocks a tier holds, as they come and go (vLLM's event kinds).

KV-aware routers (llm-d's KV indexer, Dynamo, Ray Serve's KV-aware router) keep a model of each
replica's prefix cache from these events and route a prompt to the replica that holds most of
its blocks. The memory core records them in a ``KVEventLog`` (cheap appends during the step);
the server takes them after each step (``LLMEngine.take_kv_events()``) and publishes them off the
step's path (``server/kv_events.py``: vLLM's wire format over ZMQ).

A top-level module, not part of ``memory/``: the events are the vocabulary the memory core, the
engine and the server share, and the server must not import the memory core.

- ``BlockStored``: blocks entered a tier's prefix cache (their hashes, the parent hash of the
  first, their token ids, the medium). On the device: full computed blocks; in the host tier
  ("CPU"): blocks offloaded or read back from disk; on disk ("DISK"): blocks written through,
  and at start every block an earlier run left there (``memory/tiers/disk.py``).
- ``BlockRemoved``: hashes a tier forgot (evicted, cleared, dropped after a failed step).
- ``AllBlocksCleared``: everything, on every tier, was forgotten.

Only KV group 0's blocks are reported (a hybrid model's other groups follow its prefix; its disk
tier, whose keys mix the groups, is not reported). A
request's cache salt (a tenant's isolation) is never sent: ``extra_keys`` carries the root hash
the salt produced (SHA-256), so equal salts group together without revealing them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MEDIUMS = {"device": "GPU", "host": "CPU", "disk": "DISK",  # vLLM's names (the "GPU" may be a CPU here)
           "remote": "REMOTE"}  # a server shared by replicas (memory/tiers/remote.py)


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    medium: str
    extra_keys: list[str] | None = None
    lora_name: str | None = None  # the LoRA adapter that computed them (its key: name and weights digest)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventLog:
    """Events since the last :meth:`take`, in the order they happened."""

    block_size: int
    events: list[KVEvent] = field(default_factory=list)
    total: int = 0

    def stored(self, hashes: list[bytes], parent: bytes | None, token_ids: list[int], medium: str,
               extra_keys: list[str] | None = None, lora_name: str | None = None) -> None:
        if hashes:
            self.events.append(BlockStored(hashes, parent, token_ids, self.block_size, medium, extra_keys,
                                           lora_name))
            self.total += 1

    def removed(self, block_hash: bytes, medium: str) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(block_hash)  # evictions of one allocation: one event
        else:
            self.events.append(BlockRemoved([block_hash], medium))
            self.total += 1

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())
        self.total += 1

    def take(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
