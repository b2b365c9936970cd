"""Why a prompt missed the prefix cache (``memory/miss_reasons.py``): every reason, from the
memory core, and never another tenant's cache state in what a caller sees."""

from __future__ import annotations

from pathlib import Path

from pagedkv.memory import KVCacheManager
from pagedkv.memory.prefix_hash import chain_hashes, root_hash
from pagedkv.memory.tiers.disk_store import DiskStore

B = 4


def _run(kv: KVCacheManager, seq_id: str, tokens: list[int], salt: str | None = None):
    """Allocate, compute and free a whole prompt; returns its CacheDetails."""
    kv.allocate_prompt(seq_id, tokens, salt=salt, tenant=salt)
    details = kv.cache_details(seq_id, salt)
    kv.mark_computed(seq_id, len(tokens) - kv.num_computed(seq_id))
    kv.free(seq_id)
    kv.check_integrity()
    return details


def test_never_seen_then_none() -> None:
    kv = KVCacheManager(32, B)
    prompt = list(range(1, 14))  # 3 full blocks + 1 token
    d = _run(kv, "a", prompt)
    assert (d.reason, d.miss_block, d.hit_tokens) == ("never_seen", 0, 0)
    assert d.for_caller() == {"hit_tokens": 0, "tier_hits": {"device": 0, "host": 0, "disk": 0},
                              "first_miss": {"reason": "never_seen", "block": 0}}
    d = _run(kv, "b", prompt)
    assert (d.reason, d.hit_tokens, d.tier_hits["device"]) == ("none", 12, 12)
    assert d.for_caller()["first_miss"] is None
    assert kv.stats().first_misses == {"never_seen": {"default": 1}, "none": {"default": 1}}


def test_evicted_names_the_tier_and_the_policy() -> None:
    for policy in ("lru", "lrc"):
        kv = KVCacheManager(8, B, eviction_policy=policy)
        _run(kv, "a", list(range(1, 14)))
        _run(kv, "flood", list(range(100, 132)))  # 8 blocks: everything cached before goes
        d = _run(kv, "b", list(range(1, 14)))
        assert (d.reason, d.miss_block, d.evicted_from, d.evicted_by) == ("evicted", 0, "device", policy)
        assert d.for_caller()["first_miss"] == {"reason": "evicted", "block": 0, "tier": "device", "policy": policy}
    # with a host tier too small to keep it: it left the host tier last
    kv = KVCacheManager(8, B, num_host_blocks=4, offload_to_host=True)
    _run(kv, "a", list(range(1, 14)))
    for i in range(3):
        _run(kv, f"flood{i}", list(range(100 + 40 * i, 132 + 40 * i)))
        kv.take_tier_copies()
        kv.finish_step()
    d = _run(kv, "b", list(range(1, 14)))
    assert (d.reason, d.evicted_from, d.evicted_by) == ("evicted", "host", "lru")


def test_evicted_by_a_quota() -> None:
    kv = KVCacheManager(16, B, tenant_quotas={"noisy": 0.5})
    _run(kv, "a", list(range(1, 14)), salt="noisy")
    for i in range(3):
        _run(kv, f"n{i}", list(range(100 + 40 * i, 125 + 40 * i)), salt="noisy")
    d = _run(kv, "b", list(range(1, 14)), salt="noisy")
    assert (d.reason, d.evicted_by) == ("evicted", "quota")


def test_partial_block_counts_the_shared_tokens() -> None:
    kv = KVCacheManager(32, B)
    _run(kv, "a", list(range(1, 14)))
    d = _run(kv, "b", [1, 2, 3, 4, 5, 6, 99, 98, 97, 96, 95])  # shares block 0 and half of block 1
    assert (d.reason, d.miss_block, d.shared_tokens, d.hit_tokens) == ("partial_block", 1, 2, 4)
    assert d.for_caller()["first_miss"] == {"reason": "partial_block", "block": 1, "shared_tokens": 2}


def test_another_tenants_cache_is_never_revealed() -> None:
    kv = KVCacheManager(32, B)
    prompt = list(range(1, 14))
    _run(kv, "a", prompt, salt="team-a")
    d = _run(kv, "b", prompt, salt="team-b")
    assert (d.reason, d.hit_tokens) == ("different_tenant", 0)  # the true reason, for the counters
    assert d.for_caller()["first_miss"] == {"reason": "never_seen", "block": 0}  # what team-b sees
    assert kv.stats().first_misses["different_tenant"] == {"team-b": 1}
    # an unsalted request seeing content only a salted tenant cached: the same
    d = _run(kv, "c", list(range(1, 14)))
    assert d.reason == "different_tenant" and d.for_caller()["first_miss"]["reason"] == "never_seen"


def test_fingerprint_mismatch_on_disk(tmp_path: Path) -> None:
    prompt = list(range(1, 14))
    keys = chain_hashes(root_hash(None, None), prompt, B, 0, 3)
    with DiskStore(tmp_path, 1 << 20, {"model": "old"}) as disk:
        for key in keys:
            assert disk.put(key, b"x" * 64)
    disk = DiskStore(tmp_path, 1 << 20, {"model": "new"})  # another model: its blocks are removed
    assert disk.discarded_keys == set(keys)
    kv = KVCacheManager(32, B, num_host_blocks=8, offload_to_host=True, disk=disk)
    try:
        d = _run(kv, "a", prompt)
        assert (d.reason, d.miss_block) == ("fingerprint_mismatch", 0)
    finally:
        kv.disk.close()
