"""A snapshot of the KV memory's state and counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class KVStats:
    """KV-cache figures at one instant.

    Block states: ``used + free == num_blocks``; ``free`` counts every block an allocation could
    take, of which ``evictable_blocks`` still hold a cached prefix. ``cached_blocks`` counts all
    blocks holding a cached prefix, used or free. Fragmentation is the share of allocated slots
    (used blocks x block size) that hold no token: ``1 - filled_slots / allocated_slots``.
    Prefix-cache figures are in tokens: how many prompt tokens were looked up, how many were hits.
    """

    num_blocks: int
    block_size: int
    used_blocks: int
    free_blocks: int
    cached_blocks: int
    evictable_blocks: int
    num_seqs: int
    table_blocks: int  # block-table entries over device sequences: blocks needed without sharing
    filled_slots: int
    allocated_slots: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    evictions: int
    cow_copies: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    host_blocks: int
    host_used_blocks: int  # swapped-out sequences' blocks (cached host blocks are free, like the device's)
    host_cached_blocks: int = 0  # host blocks holding an offloaded prefix block
    host_hit_tokens: int = 0  # prompt tokens found in the host tier (included in prefix_hit_tokens)
    offloaded_blocks: int = 0  # cached device blocks copied down on eviction
    offloads_dropped: int = 0  # evicted cached blocks not copied (no host block free)
    reloaded_blocks: int = 0  # host blocks copied back up for a prompt's prefix
    window_released_blocks: int = 0  # a hybrid model's sliding-window blocks released as sequences advanced
    rolled_back_blocks: int = 0  # blocks released by rollback(): rejected speculative tokens' slots
    # A mixed pool (full-precision and 8-bit blocks, runner/kv_cache.py); 0 in a single-format one
    full_precision_blocks: int = 0  # device blocks whose format is full precision
    free_full_precision_blocks: int = 0  # of them, free (the rest of free_blocks are 8-bit)
    # The disk tier (0 / False without one); sizes are whole files
    disk_enabled: bool = False  # writing (False once a write failed, or without a disk tier)
    disk_blocks: int = 0
    disk_bytes_used: int = 0
    disk_capacity_bytes: int = 0
    disk_query_tokens: int = 0  # prompt tokens looked up on disk (past the device and host tiers)
    disk_hit_tokens: int = 0  # tokens read from disk into the host tier (then reloaded from there)
    disk_bytes_written: int = 0
    disk_bytes_read: int = 0
    disk_evictions: int = 0
    disk_corrupt_discarded: int = 0  # block files that failed a check: deleted, tokens recomputed
    disk_read_errors: int = 0
    disk_write_errors: int = 0
    disk_blocked_writes: int = 0  # blocks not written: their path was taken (writing goes on)
    disk_queue_depth: int = 0  # blocks waiting for the disk writer
    disk_writes_dropped: int = 0  # evicted blocks not written: the queue was full
    # The remote tier, a server shared by replicas (0 / False without one); bytes are whole values
    remote_enabled: bool = False
    remote_connected: bool = False  # its last round trip worked (False while backing off)
    remote_query_tokens: int = 0  # prompt tokens looked up there (past every local tier)
    remote_hit_tokens: int = 0  # tokens read from it into the host tier (then reloaded from there)
    remote_blocks_read: int = 0
    remote_blocks_written: int = 0
    remote_bytes_read: int = 0
    remote_bytes_written: int = 0
    remote_already_present: int = 0  # writes skipped: the server had the block (another replica's)
    remote_misses: int = 0  # blocks read that the server no longer had (evicted, flushed)
    remote_corrupt_discarded: int = 0  # values that failed a check (checksum, version, key, size): deleted
    remote_errors: int = 0  # failed round trips: the server down, slow or refusing (blocks recomputed)
    remote_reconnects: int = 0
    remote_queue_depth: int = 0  # blocks waiting for the remote writer
    remote_writes_dropped: int = 0  # blocks not written: the queue was full or the server unreachable
    # Per-tenant quotas (empty when off): {tenant: (blocks held, of them cached-free, limit or None)}
    tenants: dict[str, tuple[int, int, int | None]] = field(default_factory=dict)
    tenant_quota_waits: dict[str, int] = field(default_factory=dict)  # allocations a quota refused
    # requests by the reason their first missed block missed (memory/miss_reasons.py), then tenant
    first_misses: dict[str, dict[str, int]] = field(default_factory=dict)
    # conversation pins (memory/pins.py): held now, blocks they hold, and how pins ended
    pins: int = 0
    pinned_blocks: int = 0
    pins_expired: int = 0
    pins_replaced: int = 0
    pins_released_under_pressure: int = 0
    pins_refused: int = 0  # turns not pinned: past max_tenant_pin_fraction

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def fragmentation(self) -> float:
        return 1.0 - self.filled_slots / self.allocated_slots if self.allocated_slots else 0.0

    @property
    def sharing_saving(self) -> float:
        """Share of block-table entries served by a shared block (forks, prefix hits): the
        memory that sharing saves against every sequence owning its blocks."""
        return 1.0 - self.used_blocks / self.table_blocks if self.table_blocks else 0.0

    @property
    def tier_hit_tokens(self) -> dict[str, int]:
        """Prompt tokens found in each tier (disk and remote hits are reloaded through the host
        tier and counted there too; "remote" only with a remote tier)."""
        hits = {"device": self.prefix_hit_tokens - self.host_hit_tokens, "host": self.host_hit_tokens,
                "disk": self.disk_hit_tokens}
        if self.remote_enabled:
            hits["remote"] = self.remote_hit_tokens
        return hits

    @property
    def tier_miss_tokens(self) -> dict[str, int]:
        """Prompt tokens each tier was asked for and did not have (nor did a tier above it)."""
        device = self.prefix_query_tokens - (self.prefix_hit_tokens - self.host_hit_tokens)
        misses = {"device": device, "host": max(device - self.host_hit_tokens, 0),
                  "disk": max(self.disk_query_tokens - self.disk_hit_tokens, 0)}
        if self.remote_enabled:
            misses["remote"] = max(self.remote_query_tokens - self.remote_hit_tokens, 0)
        return misses

    @property
    def prefix_hit_rate(self) -> float:
        q = self.prefix_query_tokens
        return self.prefix_hit_tokens / q if q else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Every field and derived figure (the per-tier and per-tenant ones are dicts)."""
        d: dict[str, Any] = asdict(self)
        d.update(usage=self.usage, fragmentation=self.fragmentation,
                 prefix_hit_rate=self.prefix_hit_rate, sharing_saving=self.sharing_saving,
                 tier_hit_tokens=self.tier_hit_tokens, tier_miss_tokens=self.tier_miss_tokens)
        return d
