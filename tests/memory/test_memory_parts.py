"""The memory core's parts, each on its own: the pool's eviction listeners, KV groups, the config,
the miss history's bulk puts, the prefix cache's chain walk, admission outcomes and tenancy."""

import random

import pytest

from pagedkv.memory import BlockPool, KVCacheConfig, KVCacheManager, chain_hashes, root_hash
from pagedkv.memory.block import Block
from pagedkv.memory.block_pool import CLEARED, DROPPED, QUOTA
from pagedkv.memory.kv_groups import FullAttention, SlidingWindow, make_kv_groups
from pagedkv.memory.miss_reasons import _Bounded
from pagedkv.memory.seq_state import AdmissionOutcome
from pagedkv.memory.tenant_ledger import TenantLedger


class Recorder:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def on_evict(self, block: Block, cause: str) -> None:
        assert block.block_hash is not None  # told before the hash is dropped
        self.log.append((self.name, block.block_id, cause))


def test_pool_tells_its_listeners_in_order_with_the_cause():
    log: list = []
    pool = BlockPool(3, listeners=[Recorder("a", log), Recorder("b", log)])
    blocks = pool.allocate(3)
    pool.cache(blocks, [b"x", b"y", b"z"])
    pool.free(blocks)
    pool.allocate(1)  # evicts the least recently freed cached block (lru)
    assert log == [("a", 0, "lru"), ("b", 0, "lru")]
    log.clear()
    assert pool.evict_cached(1) == 1
    assert log == [("a", 1, CLEARED), ("b", 1, CLEARED)]
    log.clear()
    assert pool.evict_cached(keep_contents=False) == 1
    assert log == [("a", 2, DROPPED), ("b", 2, DROPPED)]


def test_quota_victims_are_evicted_with_the_quota_cause():
    log: list = []
    ledger = TenantLedger(4, {"a": 0.5})
    pool = BlockPool(4, tenants=ledger, listeners=[Recorder("r", log), ledger])
    blocks = pool.allocate(2, "a")
    pool.cache(blocks, [b"p", b"q"])
    pool.free(blocks)  # a holds 2 cached-free blocks, its limit
    pool.allocate(1, "a")  # over its limit: its own oldest cached block goes first
    assert log == [("r", 0, QUOTA)]
    pool.check_integrity()


def test_kv_groups_differ_only_in_their_arithmetic():
    full, window = FullAttention(), SlidingWindow(8)
    B = 4
    assert (full.first_visible(18, B), window.first_visible(18, B)) == (0, 2)  # 18 sees 11..18
    assert (full.hit_start(5, B), window.hit_start(5, B)) == (0, 3)  # position 20 sees 13..20
    assert window.first_visible(7, B) == 0  # inside the first window: every block visible
    assert (full.max_blocks(100, None, B), window.max_blocks(100, 16, B)) == (25, 7)
    assert make_kv_groups((None, 8)) == (FullAttention(), SlidingWindow(8))
    with pytest.raises(ValueError, match="kv_group_windows must start with None"):
        make_kv_groups((8, None))


def test_config_validates_once_and_options_override_it():
    with pytest.raises(ValueError, match="watermark"):
        KVCacheConfig(watermark=1.0)
    with pytest.raises(ValueError, match="num_host_blocks"):
        KVCacheConfig(num_host_blocks=-1)
    with pytest.raises(ValueError, match="max_tenant_pin_fraction"):
        KVCacheConfig(max_tenant_pin_fraction=0.0)
    kv = KVCacheManager(16, 4, KVCacheConfig(num_host_blocks=8), prefix_index="radix")
    assert kv.config == KVCacheConfig(num_host_blocks=8, prefix_index="radix") and kv.host_pool.num_blocks == 8
    with pytest.raises(TypeError, match="bogus"):
        KVCacheManager(16, 4, bogus=1)


def test_bounded_put_many_equals_sequential_puts():
    rng = random.Random(0)
    for _ in range(200):
        capacity = rng.randint(1, 12)
        one, bulk = _Bounded(capacity), _Bounded(capacity)
        for _ in range(20):
            keys = rng.sample(range(30), rng.randint(0, 16))
            values = [rng.random() for _ in keys]
            for key, value in zip(keys, values):
                one.put(key, value)
            bulk.put_many(keys, iter(values))
            assert list(one.items()) == list(bulk.items())


def test_the_chain_walk_hashes_lazily_what_chain_hashes_gives():
    kv = KVCacheManager(16, 4)
    tokens = list(range(23))
    root = root_hash("t", None)
    assert list(kv.prefix.walk(root, tokens, 5)) == chain_hashes(root, tokens, 4, 0, 5)
    assert kv.prefix.hashes(root, tokens, 5) == chain_hashes(root, tokens, 4, 0, 5)


def test_admission_outcome_names_where_the_hits_came_from():
    B = 4
    kv = KVCacheManager(12, B, num_host_blocks=8, offload_to_host=True)
    prompt = list(range(4 * B + 1))
    kv.allocate_prompt("a", prompt)
    kv.mark_computed("a", len(prompt))
    kv.free("a")
    assert kv.evict_cached(2) == 2  # the chain's tail (blocks 3, 2) goes down to the host tier
    kv.allocate_prompt("b", list(prompt))
    assert kv.seqs["b"].hits == AdmissionOutcome(device=2, host=2, disk=0, max_hits=4, reload_skipped=False)
    assert kv.seqs["b"].hits.hits == 4
    kv.take_tier_copies()
    kv.finish_step()
    kv.check_integrity()


def test_tenancy_answers_with_quotas_off():
    kv = KVCacheManager(16, 4)
    assert not kv.quotas_on and not kv.tenant_over_quota("a") and not kv.tenant_under_quota("a")
    assert kv.quota_admits("a", 1000) and kv.tenancy.limit("a") is None and kv.tenancy.in_use("a") == 0
    assert kv.seqs == {} and kv.expire_pins(0.0) == 0


class RemoteStandIn:
    """A lower tier the manager was never edited for (a store shared by replicas, say): it keeps
    the hashes offered to it and loads nothing."""

    name = "remote"

    def __init__(self, host) -> None:
        self.host, self.kept, self.cached, self.steps = host, [], [], 0

    def lookup(self, keys):
        return 0

    def holds(self, key):
        return key in self.kept

    def prepare_load(self, seq_id, keys, query_tokens, count, tokens_of=None):
        return False

    def complete_loads(self, device):
        pass

    def offer(self, block):
        self.kept.append(block.block_hash)

    def on_cached(self, blocks):
        self.cached.extend(b.block_hash for b in blocks)

    def take_copies(self, copies):
        pass

    def finish_step(self, copied):
        self.steps += 1

    def take_events(self):
        pass

    def forget(self, seq_id):
        pass

    def wait_for_loads(self, timeout):
        return False

    def held_blocks(self):
        return []

    def stats(self):
        return {}

    def check_integrity(self):
        pass


def test_a_new_lower_tier_plugs_in_without_an_edit_to_the_manager():
    B = 4
    made = []

    def remote(host):
        made.append(RemoteStandIn(host))
        return made[-1]

    kv = KVCacheManager(6, B, num_host_blocks=4, offload_to_host=True, more_tiers=[remote])
    (tier,) = made
    assert tier.host is kv.host_tier and kv.loads_in_background and not kv.wait_for_loads(0.0)
    prompt = list(range(3 * B + 1))
    kv.allocate_prompt("a", prompt)
    kv.mark_computed("a", len(prompt))
    assert len(tier.cached) == 3  # told of each block as it became cached (full, computed)
    kv.free("a")
    assert kv.evict_cached() == 3
    assert len(tier.kept) == 3  # every evicted block was offered to it too
    kv.take_tier_copies()
    kv.finish_step()
    assert tier.steps == 1
    kv.check_integrity()
    assert not KVCacheManager(6, B).loads_in_background
