"""Admitting a prompt: its cached prefix found in the device, host and disk tiers, fresh blocks
for the rest, all or nothing (``KVCacheManager.allocate_prompt`` calls these).

A prompt's blocks, as allocation sees them::

    [ device hits | host hits (reloaded) | fresh: the first chunk's new tokens ]
      touched       copied into fresh      need = blocks for cached + new - device hits
                    device blocks

The block holding the last prompt token is never a hit (its logits must be computed). Before
anything changes, pins give way for the blocks needed (``unstarve``), the tenant's quota is
checked (``check_quota``) and the watermark is kept free; short of blocks, ``OutOfBlocksError``
is raised with nothing changed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.memory.block import Block
from pagedkv.memory.errors import OutOfBlocksError
from pagedkv.memory.kv_groups import RELEASED, prefix_hit
from pagedkv.memory.prefix_caching import cache_full_blocks, hash_full_blocks
from pagedkv.memory.prefix_hash import chain_hashes
from pagedkv.memory.seq_state import SeqState, cdiv

if TYPE_CHECKING:
    from pagedkv.memory.kv_cache_manager import KVCacheManager


def allocate_single(kv: KVCacheManager, seq: SeqState, num_new_tokens: int | None, owner: str) -> int:
    B, token_ids = kv.block_size, seq.token_ids
    hits: list[Block] = []
    host_hits: list[Block] = []
    found: list[Block] = []
    max_hits = 0
    if kv.enable_prefix_caching:
        hash_full_blocks(seq, kv.block_size, len(token_ids) // B)
        # The block holding the last prompt token is never a hit: it must be computed.
        max_hits = (len(token_ids) - 1) // B
        hits = kv.index.match(seq.root, token_ids, seq.block_hashes, max_hits)
        if kv.host_tier is not None:  # the chain may go on in the host tier
            found = kv.host_tier.match(seq.block_hashes[len(hits):max_hits])
            if found and kv.costs.reload_cheaper("host", len(found), record=False):
                host_hits = found  # else recomputing them is cheaper here
    num_cached = (len(hits) + len(host_hits)) * B
    remaining = len(token_ids) - num_cached
    num_new = remaining if num_new_tokens is None else max(1, min(num_new_tokens, remaining))
    need = cdiv(num_cached + num_new, B) - len(hits)
    fresh = take_blocks(kv, seq, need, hits, host_hits, owner)
    seq.block_table = [b.block_id for b in hits] + [b.block_id for b in fresh]
    if host_hits:
        kv.host_tier.reload(host_hits, fresh, B)  # type: ignore[union-attr]
    seq.hits = (len(hits), len(host_hits), from_disk(kv, host_hits), max_hits, bool(found) and not host_hits)
    seq.num_computed = num_cached
    seq.num_cached_blocks = len(hits)
    kv.seqs[seq.seq_id] = seq
    if host_hits:  # the reloaded blocks are cached prefix blocks again, on the device
        cache_full_blocks(kv, seq)
    if found:
        kv.costs.record("host", reload=bool(host_hits))
    return num_cached


def allocate_groups(kv: KVCacheManager, seq: SeqState, num_new_tokens: int | None, owner: str) -> int:
    """``allocate_prompt`` for a hybrid model: a table per KV group, the hit served by every
    group from the device or the host tier (``memory/kv_groups.py``)."""
    B, G, token_ids, pool = kv.block_size, kv.num_groups, seq.token_ids, kv.pool
    host = kv.host_tier
    hit = prefix_hit(pool, None, kv.group_windows, [], 0, B)
    reload: bool | None = None  # the reload-or-recompute decision, when the host held some
    if kv.enable_prefix_caching:
        hash_full_blocks(seq, kv.block_size, len(token_ids) // B)
        max_hits = (len(token_ids) - 1) // B  # the last prompt token is always computed
        hit = prefix_hit(pool, host.pool if host is not None else None, kv.group_windows,
                         seq.block_hashes, max_hits, B)
        if hit.num_host:  # (per block: a hybrid block holds fewer layers, so a cheaper copy)
            reload = kv.costs.reload_cheaper("host", hit.num_host, record=False)
            if not reload:  # recomputing is cheaper here: what only the host holds is a miss
                hit = prefix_hit(pool, None, kv.group_windows, seq.block_hashes, max_hits, B)
    k = hit.k
    num_cached = k * B
    remaining = len(token_ids) - num_cached
    num_new = remaining if num_new_tokens is None else max(1, min(num_new_tokens, remaining))
    per_group = cdiv(num_cached + num_new, B) - k  # new blocks in each group
    pairs = [(b, h) for blocks, flags in zip(hit.blocks, hit.on_host) for b, h in zip(blocks, flags)]
    on_device = [b for b, h in pairs if not h]
    on_host = [b for b, h in pairs if h]
    need = per_group * G + len(on_host)
    fresh = iter(take_blocks(kv, seq, need, on_device, on_host, owner))
    for g, (blocks, flags) in enumerate(zip(hit.blocks, hit.on_host)):
        released = k - len(blocks)  # before the window of the first uncached token
        table = [RELEASED] * released
        reloads: list[tuple[Block, Block]] = []
        for block, from_host in zip(blocks, flags):
            if from_host:
                reloads.append((block, next(fresh)))
                table.append(reloads[-1][1].block_id)
            else:
                table.append(block.block_id)
        table += [next(fresh).block_id for _ in range(per_group)]
        if reloads:  # (hit tokens counted once, by group 0)
            host.reload([s for s, _ in reloads], [d for _, d in reloads], B if g == 0 else 0)  # type: ignore
        if g == 0:
            seq.block_table = table
        else:
            seq.group_tables.append(table)
            seq.released.append(released)
    seq.num_computed = num_cached
    host0 = [b for b, h in zip(hit.blocks[0], hit.on_host[0]) if h] if hit.blocks else []
    seq.hits = (k - len(host0), len(host0), from_disk(kv, host0), (len(token_ids) - 1) // B, reload is False)
    seq.num_cached_blocks = 0 if on_host else k  # reloaded blocks are cached again below
    kv.seqs[seq.seq_id] = seq
    if on_host:
        cache_full_blocks(kv, seq)
    if reload is not None:
        kv.costs.record("host", reload=reload)
    return num_cached


def take_blocks(kv: KVCacheManager, seq: SeqState, need: int, device_hits: list[Block],
                host_hits: list[Block], owner: str) -> list[Block]:
    """Touch the device hits, hold the host hits and allocate ``need`` fresh blocks; or raise,
    changing nothing: TenantQuotaError first (a tenant at its quota waits, not the line), then
    OutOfBlocksError. Pins give way first (other tenants' before ``owner``'s; never those
    holding the prompt's own hits), when that admits it; the watermark stays free."""
    pool = kv.pool
    revived = sum(1 for b in device_hits if b.ref_count == 0)
    kv.unstarve(need + revived + kv.watermark_blocks, admission=True, tenant=owner,
                keep=frozenset(b.block_id for b in device_hits))
    kv.check_quota(seq.tenant, need, device_hits)
    available = pool.num_free - revived - kv.watermark_blocks
    if need > available:
        raise OutOfBlocksError(need, max(available, 0))
    for block in device_hits:
        pool.touch(block)
    if host_hits:  # held until the reload is done, before any allocation could evict them
        kv.host_tier.hold(host_hits)  # type: ignore[union-attr]
    return pool.allocate(need, seq.tenant, quota=False)  # (check_quota decided)


def blocks_to_admit(kv: KVCacheManager, token_ids: list[int], num_new_tokens: int | None, root: bytes) -> int:
    """``KVCacheManager.blocks_to_admit`` (``root``: the prompt's chain root, salt and adapter)."""
    B, pool = kv.block_size, kv.pool
    hits = revived = 0
    if kv.enable_prefix_caching:
        parent = root
        for i in range((len(token_ids) - 1) // B):
            parent = chain_hashes(parent, token_ids, B, i, i + 1)[0]
            block = pool.cached.get(parent)
            if block is None:
                break
            hits += 1
            revived += block.ref_count == 0
    remaining = len(token_ids) - hits * B
    num_new = remaining if num_new_tokens is None else max(1, min(num_new_tokens, remaining))
    return (cdiv(hits * B + num_new, B) - hits) * kv.num_groups + revived


def from_disk(kv: KVCacheManager, host_hits: list[Block]) -> int:
    """Of these host blocks about to be reloaded, how many came from the disk tier."""
    from_disk = kv.host_tier.from_disk if kv.host_tier is not None else None
    if not from_disk:
        return 0
    keys = [b.block_hash for b in host_hits if b.block_hash in from_disk]
    from_disk.difference_update(keys)
    return len(keys)
