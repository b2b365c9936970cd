"""Why a prompt missed the prefix cache: a bounded history of what the cache held, and the reason
for a request's first missed block.

``CacheHistory`` remembers, for the most recent events only (``capacity`` entries per map, oldest
forgotten first):

- blocks evicted, by hash: from which tier (device, host) and why (the eviction policy's name,
  ``quota`` for a tenant over its quota, ``cleared`` for a cache reset or a failed step);
- for each cached block, the tokens of the block that followed its parent, so a prompt that shares
  a prefix ending inside a block can be told apart (``partial_block``);
- for each cached block, its tokens' unsalted hash and the salted root (tenant) that cached them,
  so a miss on content another tenant holds is seen (``different_tenant``);
- the keys of disk blocks removed at start for a changed fingerprint (``fingerprint_mismatch``);
- for each chain root seen, its salt and LoRA adapter, so a miss on content the same tenant cached
  under another adapter (or the base model) is told apart (``different_adapter``).

``explain`` gives the reason for the first block of a prompt that was not a hit, in this order:
``none`` (every block that could be a hit was: the one holding the last prompt token is always
computed), ``reload_skipped`` (the host tier holds it, but recomputing was measured cheaper),
``evicted``, ``different_adapter``, ``different_tenant``, ``partial_block``, ``fingerprint_mismatch``,
``never_seen``. ``different_adapter`` is the caller's to see (the same tenant's cache, another adapter).
A caller never sees ``different_tenant``: it gets the reason its own tenant's history gives
(``partial_block``, ``fingerprint_mismatch`` or ``never_seen``), so another tenant's cache state
is never revealed; the true reason goes only to aggregate counters. Pure Python.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from pagedkv.memory.block import Block
from pagedkv.memory.prefix_hash import chain_hashes, root_hash

REASONS = ("none", "reload_skipped", "evicted", "partial_block", "different_adapter", "different_tenant",
           "fingerprint_mismatch", "never_seen")
UNSALTED_ROOT = root_hash(None, None)


@dataclass(slots=True)
class CacheDetails:
    """One request's prefix-cache outcome at its first admission."""

    prompt_tokens: int
    hit_tokens: int
    tier_hits: dict[str, int]  # hit tokens per tier: device, host, disk (and remote, when it served any)
    reason: str  # of the first missed block (REASONS), the true one (aggregate counters only)
    caller_reason: str  # the same as its caller may see it: never "different_tenant"
    miss_block: int | None = None  # its index in the prompt, None for "none"
    evicted_from: str | None = None  # "evicted": the tier it left last
    evicted_by: str | None = None  # "evicted": the policy (lru, fifo, lrc), "quota" or "cleared"
    shared_tokens: int = 0  # "partial_block": tokens of the block shared with a cached one
    extra: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # for the caller, e.g. a conversation pin refused

    def for_caller(self) -> dict[str, Any]:
        """What the request's own caller may see: another tenant's cache is "never_seen"."""
        reason = self.caller_reason
        out: dict[str, Any] = {"hit_tokens": self.hit_tokens, "tier_hits": dict(self.tier_hits),
                               "first_miss": None}
        if reason != "none":
            miss: dict[str, Any] = {"reason": reason, "block": self.miss_block}
            if reason == "evicted":
                miss.update(tier=self.evicted_from, policy=self.evicted_by)
            if reason == "partial_block":
                miss["shared_tokens"] = self.shared_tokens
            out["first_miss"] = miss
        if self.warnings:
            out["warnings"] = list(self.warnings)
        return out


class _Bounded(OrderedDict):
    """The ``capacity`` keys put last, oldest first."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        if len(self) > self.capacity:
            self.popitem(last=False)

    def put_many(self, keys: list[Any], values: Iterable[Any]) -> None:
        """``put`` each of ``keys`` (distinct) in order, in bulk: the keys already here leave
        first, so all of them end up newest, in order (a block run's entries in C loops: this is
        on every cached block's path)."""
        for key in self.keys() & keys:
            del self[key]
        self.update(zip(keys, values))
        for _ in range(len(self) - self.capacity):
            self.popitem(last=False)


class EvictionHistory:
    """A pool's eviction listener: records each forgotten block's tier and cause in ``history``
    (a block dropped after a failed step is recorded as ``cleared``)."""

    def __init__(self, history: CacheHistory, tier: str) -> None:
        self.history = history
        self.tier = tier

    def on_evict(self, block: Block, cause: str) -> None:
        self.history.evicted.put(block.block_hash, (self.tier, "cleared" if cause == "dropped" else cause))


class CacheHistory:
    def __init__(self, block_size: int, capacity: int = 4096) -> None:
        self.block_size = block_size
        self.evicted: _Bounded = _Bounded(capacity)  # block hash -> (tier, cause)
        self.children: _Bounded = _Bounded(capacity)  # parent hash -> tokens of a cached next block
        self.content: _Bounded = _Bounded(capacity)  # unsalted hash -> the salted root that cached it
        self.fingerprint_discarded: set[bytes] = set()  # disk keys removed for another fingerprint
        self.roots: _Bounded = _Bounded(capacity)  # chain root -> (salt, adapter id) it was made of

    def on_root(self, root: bytes, salt: str | None, adapter_id: str | None) -> None:
        """A prompt was allocated under ``root`` = ``root_hash(salt, adapter_id)``."""
        self.roots.put(root, (salt, adapter_id))

    # ------------------------------------------------------------------ events
    def on_evicted(self, block_hash: bytes, tier: str, cause: str) -> None:
        self.evicted.put(block_hash, (tier, cause))

    def on_cached(self, root: bytes, block_hashes: list[bytes], token_ids: list[int], start: int, end: int,
                  content_hashes: list[bytes] | None) -> None:
        """Blocks ``start .. end-1`` of a sequence were cached (``block_hashes``: its chain from
        ``root``); ``content_hashes``: the same tokens' unsalted chain when ``root`` is salted."""
        B = self.block_size
        if end - start == 1:  # (a decode filled one block: two plain puts beat the bulk path)
            self.children.put(block_hashes[start - 1] if start else root, tuple(token_ids[start * B:end * B]))
            self.content.put(content_hashes[start] if content_hashes is not None else block_hashes[start], root)
            return
        if end <= start:
            return
        parents = block_hashes[start - 1:end - 1] if start else [root, *block_hashes[:end - 1]]
        self.children.put_many(parents, zip(*[iter(token_ids[start * B:end * B])] * B))  # a tuple per block
        self.content.put_many((content_hashes if content_hashes is not None else block_hashes)[start:end],
                              repeat(root))

    # ------------------------------------------------------------------ the question
    def explain(self, root: bytes, token_ids: list[int], block_hashes: list[bytes], hits: int, max_hits: int,
                *, in_host: bool) -> tuple[str, str, dict[str, Any]]:
        """Why block ``hits`` (the first not served) of the prompt missed: the true reason, the
        reason its caller may see (never another tenant's cache), and details for both."""
        if hits >= max_hits:
            return "none", "none", {}
        h = block_hashes[hits]
        if in_host:
            return "reload_skipped", "reload_skipped", {}
        if h in self.evicted:
            tier, cause = self.evicted[h]
            return "evicted", "evicted", {"evicted_from": tier, "evicted_by": cause}
        B = self.block_size
        own = "fingerprint_mismatch" if h in self.fingerprint_discarded else "never_seen"
        extra: dict[str, Any] = {}
        sibling = self.children.get(block_hashes[hits - 1] if hits else root)
        if sibling is not None:
            mine = token_ids[hits * B:(hits + 1) * B]
            shared = next((k for k, (a, b) in enumerate(zip(mine, sibling)) if a != b), min(len(mine), len(sibling)))
            if shared == len(mine):  # the very block was cached once; its eviction is forgotten
                return "evicted", "evicted", {}
            if shared:
                own, extra = "partial_block", {"shared_tokens": shared}
        unsalted = h if root == UNSALTED_ROOT else chain_hashes(UNSALTED_ROOT, token_ids, B, 0, hits + 1)[-1]
        owner = self.content.get(unsalted)
        if owner is not None and owner != root:
            mine_of, theirs = self.roots.get(root), self.roots.get(owner, (None, None))
            if mine_of is not None and mine_of[0] == theirs[0] and mine_of[1] != theirs[1]:
                return "different_adapter", "different_adapter", extra
            return "different_tenant", own, extra
        return own, own, extra
