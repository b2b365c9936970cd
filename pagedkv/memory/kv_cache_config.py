"""The memory core's options, validated once when made (``KVCacheManager`` takes one)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """Args:
        num_host_blocks: blocks in the host pool (swap space and the host tier); 0: none.
        enable_prefix_caching: reuse full computed blocks across sequences by hash.
        eviction_policy: "lru" (default), "fifo" or "lrc" (``lrc_alpha``, ``lrc_beta``: its
            weights); see ``memory/eviction.py``.
        watermark: fraction of device blocks a new prompt must leave free, so running
            sequences can keep growing without immediate preemption (avoids thrash).
        prefix_index: "hash" (the pool's hash map) or "radix" (a radix tree kept beside it).
        offload_to_host: keep cached blocks evicted from the device in the host pool and reload
            them on a hit (the host tier, ``memory/tiers/host.py``); the scheduler takes the
            step's copies with ``take_tier_copies()`` and calls ``finish_step()`` once they are done.
        disk_write_queue: evicted blocks waiting to be written to the disk tier, at most (more
            are dropped).
        kv_group_windows: one entry per KV group of a hybrid model (``model_shape.kv_groups``):
            its attention window, or None for a group that keeps every block. Group 0 must be
            None (the prefix cache's anchor; the radix index holds group 0's blocks). The host
            and disk tiers keep every group's blocks under the group's own keys.
        tenant_quotas, default_tenant_quota: per-tenant limits on device blocks held (used plus
            cached), as fractions of the pool, by tenant name and for the others; either turns
            quotas on (``memory/tenancy.py``): a sequence's tenant is ``allocate_prompt``'s.
        kv_events: record KV cache events (``pagedkv/kv_events.py``) in ``KVCacheManager.events``:
            prefix blocks entering and leaving each tier's cache, for KV-aware routers.
        max_tenant_pin_fraction: the largest share of the device pool one tenant's conversation
            pins may hold (``pin_prefix`` refuses a pin past it); None: no limit but the pool.
        num_full_blocks: a mixed pool (``runner/kv_cache.py``): device block ids below it hold full
            precision, the others 8-bit (``memory/block_pool.py``); 0: one format.
        kv_sink_blocks: in a mixed pool, the first blocks of every sequence asked at full
            precision (the attention sinks); a sequence whose salt holds ``FULL_PRECISION_SALT``
            asks for every block at full precision, strictly.
    """

    num_host_blocks: int = 0
    enable_prefix_caching: bool = True
    eviction_policy: str = "lru"
    lrc_alpha: float = 0.7
    lrc_beta: float = 0.3
    watermark: float = 0.0
    prefix_index: str = "hash"
    offload_to_host: bool = False
    disk_write_queue: int = 64
    kv_group_windows: tuple[int | None, ...] = (None,)
    tenant_quotas: dict[str, float] | None = None
    default_tenant_quota: float | None = None
    kv_events: bool = False
    max_tenant_pin_fraction: float | None = None
    num_full_blocks: int = 0
    kv_sink_blocks: int = 0

    def __post_init__(self) -> None:
        if self.num_full_blocks < 0 or self.kv_sink_blocks < 0:
            raise ValueError(f"num_full_blocks and kv_sink_blocks must be >= 0, got {self.num_full_blocks} and "
                             f"{self.kv_sink_blocks}")
        if not self.kv_group_windows or self.kv_group_windows[0] is not None:
            raise ValueError(f"kv_group_windows must start with None (group 0 keeps every block), "
                             f"got {self.kv_group_windows!r}")
        if self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {self.num_host_blocks}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        fraction = self.max_tenant_pin_fraction
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise ValueError(f"max_tenant_pin_fraction must be in (0, 1] or None, got {fraction!r}")

    @property
    def quotas_on(self) -> bool:
        return bool(self.tenant_quotas) or self.default_tenant_quota is not None
