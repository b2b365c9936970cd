"""Looking at a KVCacheManager from outside: its stats snapshot, its integrity check and a dump.

Kept beside the manager rather than in it, so that the manager's file holds only the operations
that change state. ``check_integrity`` also proves the two prefix indexes agree.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from pagedkv.memory.errors import IntegrityError
from pagedkv.memory.kv_groups import RELEASED, first_visible_block
from pagedkv.memory.prefix_hash import group_hash
from pagedkv.memory.stats import KVStats
from pagedkv.memory.tenancy import DEFAULT_TENANT

if TYPE_CHECKING:
    from pagedkv.memory.kv_cache_manager import KVCacheManager
    from pagedkv.memory.seq_state import SeqState


def kv_stats(mgr: KVCacheManager) -> KVStats:
    """Fill and fragmentation over the device blocks the sequences hold, plus the counters."""
    B = mgr.block_size
    filled: dict[int, int] = {}
    table_blocks = 0
    for seq in mgr.seqs.values():
        if not seq.on_device:
            continue
        for table in seq.tables():  # every KV group's (a hybrid model's released entries skipped)
            n = min(len(seq.token_ids), len(table) * B)
            for i, block_id in enumerate(table):
                fill = min(B, n - i * B)
                if fill <= 0:
                    break
                if block_id == RELEASED:
                    continue
                table_blocks += 1
                if fill > filled.get(block_id, 0):
                    filled[block_id] = fill
    pool = mgr.pool
    tier = mgr.host_tier
    used = pool.num_blocks - pool.num_free
    evictable = sum(1 for b in pool.free_queue if b.block_hash is not None)
    return KVStats(
        num_blocks=pool.num_blocks, block_size=B, used_blocks=used, free_blocks=pool.num_free,
        cached_blocks=len(pool.cached), evictable_blocks=evictable, num_seqs=len(mgr.seqs), table_blocks=table_blocks,
        filled_slots=sum(filled.values()), allocated_slots=used * B,
        prefix_query_tokens=mgr.prefix_query_tokens, prefix_hit_tokens=mgr.prefix_hit_tokens,
        evictions=pool.evictions, cow_copies=mgr.cow_copies, window_released_blocks=mgr.released_blocks,
        rolled_back_blocks=mgr.rolled_back_blocks,
        swapped_out_blocks=mgr.swapped_out_blocks, swapped_in_blocks=mgr.swapped_in_blocks,
        host_blocks=mgr.host_pool.num_blocks,
        host_used_blocks=mgr.host_pool.num_blocks - mgr.host_pool.num_free,
        host_cached_blocks=len(mgr.host_pool.cached),
        **({} if tier is None else dict(host_hit_tokens=tier.hit_tokens, offloaded_blocks=tier.offloaded_blocks,
                                        offloads_dropped=tier.offloads_dropped,
                                        reloaded_blocks=tier.reloaded_blocks)),
        **({} if pool.tenants is None else dict(tenants=pool.tenants.snapshot(),
                                                tenant_quota_waits=dict(pool.tenants.quota_waits))),
        first_misses=_first_misses(mgr), pins=len(mgr.pins), pinned_blocks=len(mgr.pins.refs()),
        pins_expired=mgr.pins.expired, pins_replaced=mgr.pins.replaced,
        pins_released_under_pressure=mgr.pins.released_under_pressure, pins_refused=mgr.pins.refused,
        **_disk_stats(mgr))


def _first_misses(mgr: KVCacheManager) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for (reason, tenant), n in mgr.first_misses.items():
        per = out.setdefault(reason, {})
        per[tenant or DEFAULT_TENANT] = per.get(tenant or DEFAULT_TENANT, 0) + n
    return out


def _disk_stats(mgr: KVCacheManager) -> dict[str, int | bool]:
    if mgr.disk is None or mgr.disk_lookup is None:
        return {}
    d, io = mgr.disk.disk.stats(), mgr.disk.io_stats()
    return dict(disk_enabled=d.enabled, disk_blocks=d.blocks, disk_bytes_used=d.bytes_used,
                disk_capacity_bytes=d.capacity_bytes, disk_query_tokens=mgr.disk_lookup.query_tokens,
                disk_hit_tokens=mgr.disk_lookup.hit_tokens, disk_bytes_written=d.bytes_written,
                disk_bytes_read=d.bytes_read, disk_evictions=d.evictions,
                disk_corrupt_discarded=d.corrupt_discarded, disk_read_errors=io.read_errors,
                disk_write_errors=d.write_errors, disk_queue_depth=io.queued_writes,
                disk_writes_dropped=io.writes_dropped, disk_blocked_writes=d.blocked_writes)


def check_integrity(mgr: KVCacheManager) -> None:
    """Raise IntegrityError unless every structure agrees with every other.

    Checks every tier's pool (free queue, ref counts, hash index), that each block's ref count
    equals the block-table references to it (plus one if pinned), and that every cached
    block a sequence holds carries the hash of that sequence's prefix.
    """
    for pool in mgr.tiers.values():
        pool.check_integrity()
    if mgr.disk is not None:
        mgr.disk.disk.check_integrity()
    B = mgr.block_size
    refs = {tier: Counter[int]() for tier in mgr.tiers}
    if mgr.host_tier is not None:  # held for this step's tier copies
        refs["host"].update(b.block_id for b in mgr.host_tier.held)
    refs["device"].update(mgr.pins.refs())  # conversation pins (memory/pins.py)
    for seq in mgr.seqs.values():
        table = seq.block_table
        held = seq.block_ids()
        if len(set(held)) != len(held):
            raise IntegrityError(f"sequence {seq.seq_id!r} maps one block twice: {seq.tables()}")
        _check_groups(mgr, seq)
        if not seq.num_computed <= len(seq.token_ids):
            raise IntegrityError(f"sequence {seq.seq_id!r} computed more tokens than it has")
        if seq.num_computed > len(table) * B:
            raise IntegrityError(f"sequence {seq.seq_id!r} computed tokens have no slots")
        if len(seq.block_hashes) * B > len(seq.token_ids):
            raise IntegrityError(f"sequence {seq.seq_id!r} hashed blocks past its tokens")
        if seq.num_cached_blocks > seq.num_computed // B:
            raise IntegrityError(f"sequence {seq.seq_id!r} cached a block before computing it")
        refs[seq.tier].update(held)
        if seq.on_device:
            for g, group_table in enumerate(seq.tables()):
                for i in range(seq.num_cached_blocks):
                    if group_table[i] == RELEASED:
                        continue
                    h = mgr.pool.blocks[group_table[i]].block_hash
                    if h is not None and h != group_hash(seq.block_hashes[i], g):
                        raise IntegrityError(f"sequence {seq.seq_id!r} block {i} of group {g} holds "
                                             f"another prefix's hash")
    mgr.index.check()
    for tier, pool in mgr.tiers.items():
        counts = refs[tier]
        for block in pool.blocks:
            expected = counts[block.block_id] + block.pinned
            if block.ref_count != expected:
                raise IntegrityError(f"{pool.name} {block}: ref count {block.ref_count} but "
                                     f"{expected} references")


def _check_groups(mgr: KVCacheManager, seq: SeqState) -> None:
    """A hybrid model's group tables: as long as group 0's, released entries exactly the leading
    ones out of the window of the next query."""
    if len(seq.group_tables) != mgr.num_groups - 1 or len(seq.released) != len(seq.group_tables):
        raise IntegrityError(f"sequence {seq.seq_id!r} has {len(seq.group_tables)} group tables "
                             f"for {mgr.num_groups} KV groups")
    B = mgr.block_size
    for g, table in enumerate(seq.group_tables, start=1):
        lo = seq.released[g - 1]
        if len(table) != len(seq.block_table):
            raise IntegrityError(f"sequence {seq.seq_id!r} group {g} table has {len(table)} blocks, "
                                 f"group 0 {len(seq.block_table)}")
        if any(b != RELEASED for b in table[:lo]) or RELEASED in table[lo:]:
            raise IntegrityError(f"sequence {seq.seq_id!r} group {g} released entries are not the first {lo}")
        if lo > first_visible_block(seq.num_computed, mgr.group_windows[g], B):
            raise IntegrityError(f"sequence {seq.seq_id!r} group {g} released a block still in the window")


def pretty_print(mgr: KVCacheManager) -> str:
    """A readable dump of every sequence's block table and the cached blocks."""
    lines = [f"KVCacheManager: {mgr.num_blocks} blocks x {mgr.block_size} slots, "
             f"{mgr.pool.num_free} free, {len(mgr.pool.cached)} cached"]
    for seq in mgr.seqs.values():
        lines.append(f"  seq {seq.seq_id!r} [{seq.tier}] tokens={len(seq.token_ids)} "
                     f"computed={seq.num_computed} table={seq.block_table}")
        for g, table in enumerate(seq.group_tables, start=1):
            lines.append(f"    group {g} (window {mgr.group_windows[g]}) table={table}")
    return "\n".join(lines)
