"""The host tier of the prefix cache: cached blocks evicted from the device pool are copied down to
the host pool, and a prompt whose prefix continues there reloads them instead of recomputing.

The memory core against the rule (offload pairs on eviction, reload pairs on a lookup, LRU and
capacity in the host pool shared with swapped sequences, held blocks released by finish_step,
check_integrity after every operation), and the engine end to end: eviction -> offload -> hit ->
reload gives bit-identical KV and identical greedy outputs.
"""

from __future__ import annotations

import random

import torch

from pagedkv import LLM, SamplingParams
from pagedkv.memory import KVCacheManager
from pagedkv_testing.hf_checkpoints import make_hf_checkpoint

B = 4


def _mgr(device: int = 8, host: int = 4, **kw) -> KVCacheManager:
    return KVCacheManager(device, B, num_host_blocks=host, offload_to_host=True, **kw)


def _compute(kv: KVCacheManager, seq_id: str, tokens: list[int]) -> int:
    cached = kv.allocate_prompt(seq_id, tokens)
    kv.mark_computed(seq_id, len(tokens) - cached)
    return cached


def _take(kv: KVCacheManager) -> tuple[list, list]:
    copies = kv.take_tier_copies()
    return list(copies.offloads), list(copies.reloads)


def _end_step(kv: KVCacheManager) -> tuple[list, list]:
    copies = kv.take_tier_copies()
    kv.finish_step()
    kv.check_integrity()
    return list(copies.offloads), list(copies.reloads)


def test_evicted_cached_blocks_are_offloaded_and_reloaded():
    kv = _mgr()
    a = list(range(100, 113))  # 13 tokens: 3 full blocks cached, the 4th partial
    _compute(kv, "a", a)
    kv.free("a")
    _end_step(kv)
    assert kv.stats().evictable_blocks == 3
    _compute(kv, "b", list(range(200, 232)))  # 8 blocks: every cached block of "a" is evicted
    offloads, reloads = _take(kv)
    assert len(offloads) == 3 and reloads == [] and kv.stats().offloaded_blocks == 3
    assert len({h for _, h in offloads}) == 3  # three distinct host blocks
    kv.check_integrity()  # the host blocks written this step are held until finish_step
    kv.finish_step()
    kv.check_integrity()
    assert kv.stats().host_cached_blocks == 3 and kv.stats().host_used_blocks == 0
    kv.free("b")
    _end_step(kv)
    cached = kv.allocate_prompt("a2", list(a))  # the chain continues in the host tier
    assert cached == 12 and kv.stats().host_hit_tokens == 12 and kv.stats().reloaded_blocks == 3
    offloads, reloads = _take(kv)
    # a2's own allocation evicted some of b's cached blocks: one more fits below (a's are held)
    assert len(offloads) == 1 and kv.stats().offloads_dropped == 3
    assert [h for h, _ in reloads] == [h for _, h in offloads_of(kv, a)]  # in prompt order
    assert [d for _, d in reloads] == kv.block_table("a2")[:3]
    # the reloaded device blocks are cached prefix blocks again: another prompt hits them on the device
    kv.mark_computed("a2", 1)
    assert kv.allocate_prompt("a3", list(a)) == 12 and kv.stats().host_hit_tokens == 12
    _end_step(kv)


def offloads_of(kv: KVCacheManager, tokens: list[int]) -> list[tuple[int, int]]:
    """(block index in the prompt, host block) of the prompt's blocks in the host tier."""
    from pagedkv.memory.prefix_hash import chain_hashes, root_hash

    hashes = chain_hashes(root_hash(None, None), tokens, B, 0, len(tokens) // B)
    return [(i, kv.host_pool.cached[h].block_id) for i, h in enumerate(hashes) if h in kv.host_pool.cached]


def test_host_tier_is_lru_and_yields_to_swapped_sequences():
    """Against a naive model: the host keeps the last ``host`` distinct blocks offloaded."""
    kv = _mgr(device=6, host=3)
    offloaded: list[bytes] = []  # hashes in offload order

    def end_step() -> None:
        offloads, _ = _take(kv)
        offloaded.extend(kv.host_pool.blocks[h].block_hash for _, h in offloads)
        kv.finish_step()
        kv.check_integrity()
        expected = list(dict.fromkeys(reversed(offloaded)))[:3]  # most recent first, distinct
        assert set(kv.host_pool.cached) == set(expected)

    for base in (10, 50, 90, 130, 170):  # 9 tokens each: 2 cached blocks (3 allocated)
        _compute(kv, f"p{base}", [base + i for i in range(9)])
        kv.free(f"p{base}")
        end_step()
    _compute(kv, "big", list(range(300, 320)))  # 5 blocks: evicts most cached blocks
    end_step()
    assert kv.stats().offloaded_blocks == len(offloaded) >= 6 and kv.stats().host_cached_blocks == 3
    # a swap-out takes host blocks from the cached ones (a swapped sequence outranks a cached prefix)
    kv.free("big")
    _compute(kv, "small", list(range(400, 409)))  # 3 blocks
    _end_step(kv)
    kv.swap_out(["small"])
    _end_step(kv)
    assert kv.stats().host_cached_blocks == 0 and kv.stats().host_used_blocks == 3
    assert kv.is_swapped("small")


def test_randomized_operations_keep_integrity():
    rng = random.Random(7)
    kv = _mgr(device=10, host=5)
    live: dict[str, list[int]] = {}
    swapped: set[str] = set()
    for step in range(400):
        op = rng.random()
        try:
            if op < 0.4:
                sid = f"s{step}"
                tokens = [rng.randrange(3) for _ in range(rng.randint(1, 14))]  # small alphabet: shared prefixes
                cached = kv.allocate_prompt(sid, tokens)
                kv.mark_computed(sid, len(tokens) - cached)
                live[sid] = tokens
            elif op < 0.7 and live:
                sid = rng.choice(sorted(live))
                kv.free(sid)
                live.pop(sid)
                swapped.discard(sid)
            elif op < 0.8:
                kv.evict_cached(rng.choice([None, 1, 2]))
            elif op < 0.9 and live:
                sid = rng.choice(sorted(live))
                if sid in swapped:
                    kv.swap_in([sid])
                    swapped.discard(sid)
                else:
                    kv.swap_out([sid])
                    swapped.add(sid)
        except Exception as exc:  # noqa: BLE001 - out of blocks is a normal outcome
            assert type(exc).__name__ == "OutOfBlocksError", exc
        kv.check_integrity()
        offloads, reloads = _end_step(kv)
        assert len({d for _, d in offloads}) == len(offloads) and len({d for _, d in reloads}) == len(reloads)
    s = kv.stats()
    assert s.offloaded_blocks > 0 and s.reloaded_blocks > 0 and s.host_hit_tokens > 0


def test_engine_reload_gives_bit_identical_kv_and_outputs(tmp_path):
    folder = make_hf_checkpoint(tmp_path, "llama", seed=3)
    llm = LLM(str(folder), block_size=B, num_kv_blocks=24, swap_space=0.001, debug_integrity=True)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [5 + (i * 7) % 200 for i in range(37)]  # 9 full blocks
    first = llm.generate([prompt], params)[0]
    kv, cache = engine.kv, engine.runner.cache
    table = list(kv.pool.cached.items())
    snapshot = {h: cache.kv[:, :, b.block_id].clone() for h, b in table}
    assert len(snapshot) >= 9
    others = [[100 + j + i % 50 for i in range(60)] for j in range(3)]  # push it out of the device
    llm.generate(others, params)
    stats = engine.stats().kv
    assert stats.offloaded_blocks >= 9
    again = llm.generate([prompt], params)[0]
    stats = engine.stats().kv
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert stats.host_hit_tokens >= 32 and again.num_cached_tokens >= 32
    # the blocks the second run reloaded (its first host-hit blocks) hold exactly the first run's
    # bytes (blocks recomputed after them may differ in the last bits: another batch, another kernel)
    from pagedkv.memory.prefix_hash import chain_hashes, root_hash
    hashes = chain_hashes(root_hash(None, None), prompt, B, 0, stats.host_hit_tokens // B)
    for h in hashes:
        assert torch.equal(cache.kv[:, :, kv.pool.cached[h].block_id], snapshot[h])
    assert stats.used_blocks == 0


def test_kv_offloading_size_sizes_the_host_tier(tmp_path):
    from pagedkv.engine import LLMEngine

    folder = make_hf_checkpoint(tmp_path, "llama", seed=3)
    off = LLMEngine.from_options(str(folder), block_size=B, num_kv_blocks=24, kv_offloading_size=0)
    assert off.runner.num_host_blocks == 0 and off.kv.host_tier is None
    on = LLMEngine.from_options(str(folder), block_size=B, num_kv_blocks=24, kv_offloading_size=0.001)
    alias = LLMEngine.from_options(str(folder), block_size=B, num_kv_blocks=24, swap_space=0.001)
    assert on.runner.num_host_blocks == alias.runner.num_host_blocks > 0 and on.kv.host_tier is not None


def test_hybrid_groups_offload_and_reload_every_groups_window() -> None:
    """A hybrid model (group 0 full, group 1 with a window of 3 tokens): evicted blocks of both
    groups go down under their own keys; the same prompt then hits in the host tier, group 0
    for the whole prefix and group 1 for the blocks the first uncached token sees, and every
    reloaded block lands where that group's table expects it (contents tracked per slot)."""
    kv = KVCacheManager(40, B, num_host_blocks=40, offload_to_host=True, kv_group_windows=(None, 3))
    device: dict[int, tuple] = {}
    host: dict[int, tuple] = {}
    tokens = list(range(10, 30))  # 5 full blocks

    def tables(seq_id):
        return [kv.block_table(seq_id), *kv.group_tables(seq_id)]

    kv.allocate_prompt("a", tokens)
    for g, table in enumerate(tables("a")):
        for i, block in enumerate(table):
            device[block] = (g, i)  # group g's block i of this prefix
    kv.mark_computed("a", len(tokens))
    assert kv.group_tables("a")[0][:4] == [-1] * 4  # out of the window of position 20
    kv.free("a")
    assert kv.evict_cached() > 0
    offloads, _ = _end_step(kv)
    for d, h in offloads:
        host[h] = device[d]
    kv.check_integrity()
    cached = kv.allocate_prompt("b", tokens + [99])
    assert cached == 20
    copies = kv.take_tier_copies()
    for h, d in copies.reloads:
        device[d] = host[h]
    kv.finish_step()
    kv.check_integrity()
    table0, table1 = tables("b")
    assert [device[b] for b in table0[:5]] == [(0, i) for i in range(5)]
    first = (20 - 3 + 1) // B  # the first block position 20 can see: block 4
    assert table1[:first] == [-1] * first
    assert [device[b] for b in table1[first:5]] == [(1, i) for i in range(first, 5)]
    assert len(copies.reloads) == 5 + (5 - first)
    assert kv.stats().host_hit_tokens == 20
