"""Exact block ids and eviction order for the memory core's classic cases."""

import subprocess
import sys

import pytest

from pagedkv.memory import FreeBlockQueue, IntegrityError, KVCacheManager, OutOfBlocksError
from pagedkv.memory.block import Block


def computed_prompt(kv: KVCacheManager, seq_id, tokens, **kw) -> int:
    """Allocate a prompt and mark all of it computed, as one prefill step would."""
    cached = kv.allocate_prompt(seq_id, tokens, **kw)
    kv.mark_computed(seq_id, len(tokens) - cached)
    kv.check_integrity()
    return cached


def test_free_queue_removes_from_middle_and_keeps_order():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    q.appendleft(blocks[2])
    assert q.popleft() is blocks[2]
    q.append(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4, 2]
    assert len(q) == 5 and blocks[2] in q
    while len(q):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_prefix_hit_reuses_exact_blocks_and_skips_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    assert computed_prompt(kv, "a", prompt) == 0
    assert kv.block_table("a") == [0, 1, 2]
    # Same prompt: the two full blocks hit, the partial one is computed again.
    assert kv.allocate_prompt("b", prompt) == 8
    assert kv.block_table("b") == [0, 1, 3]
    assert kv.pool.blocks[0].ref_count == 2
    # A prompt of exactly two blocks: the second must still be computed (last token's logits).
    assert kv.allocate_prompt("c", prompt[:8]) == 4
    assert kv.block_table("c") == [0, 4]
    s = kv.stats()
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (28, 12)
    kv.check_integrity()


def test_partial_last_block_is_not_cached():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    computed_prompt(kv, "a", [1, 2, 3, 4, 5, 6])
    assert len(kv.pool.cached) == 1
    assert kv.pool.blocks[1].block_hash is None
    kv.free("a")
    # Tokens 1..6 then 7: only the first block can hit.
    assert kv.allocate_prompt("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4


def test_block_is_cached_only_once_computed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(12))
    kv.allocate_prompt("a", prompt)  # slots reserved, KV not written yet
    assert kv.allocate_prompt("b", prompt) == 0  # no same-step hit on unwritten KV
    kv.mark_computed("a", 4)
    assert kv.allocate_prompt("c", prompt) == 4
    kv.check_integrity()


def test_salt_isolates_tenants():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(9))
    computed_prompt(kv, "a", prompt, salt="tenant-1")
    assert kv.allocate_prompt("b", prompt, salt="tenant-2") == 0
    assert kv.allocate_prompt("c", prompt) == 0
    assert kv.allocate_prompt("d", prompt, salt="tenant-1") == 8


def test_eviction_order_of_a_freed_chain():
    kv = KVCacheManager(num_blocks=6, block_size=2)
    computed_prompt(kv, "a", [1, 2, 3, 4, 5, 6, 7])  # blocks 0,1,2 full, 3 partial
    assert kv.block_table("a") == [0, 1, 2, 3]
    kv.free("a")
    # Empty blocks first (never cached: 4, 5 and the partial 3), then the chain from its tail.
    assert [b.block_id for b in kv.pool.free_queue] == [3, 4, 5, 2, 1, 0]
    computed_prompt(kv, "b", [9, 9, 9, 9, 9, 9, 9, 9, 9])  # 5 blocks: evicts blocks 2 and 1
    assert kv.block_table("b") == [3, 4, 5, 2, 1]
    assert kv.pool.evictions == 2
    assert kv.pool.blocks[0].block_hash is not None  # the chain's head survives
    kv.free("b")
    assert kv.allocate_prompt("c", [1, 2, 3]) == 2  # head block still hits


def test_fork_then_append_copies_on_write():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = [1, 2, 3, 4, 5, 6]
    computed_prompt(kv, "p", parent)  # blocks 0 (full), 1 (2 of 4 slots)
    child = list(parent)
    kv.fork("p", "c", child)
    assert kv.block_table("c") == [0, 1]
    assert kv.pool.blocks[1].ref_count == 2
    # The child writes token 7 into the shared partial block 1: it gets a copy.
    child.append(7)
    assert kv.allocate_slots("c", 1) == [(1, 2)]
    assert kv.block_table("c") == [0, 2]
    assert kv.pool.blocks[1].ref_count == 1
    # The parent now owns block 1 alone and writes in place.
    parent.append(8)
    assert kv.allocate_slots("p", 1) == []
    assert kv.block_table("p") == [0, 1]
    assert kv.stats().cow_copies == 1
    kv.mark_computed("c", 1)
    kv.mark_computed("p", 1)
    kv.check_integrity()


def test_manager_reads_the_callers_token_list():
    """The caller owns a sequence's tokens: the manager reads its list (tokens appended later are
    seen), never copies it, and a fork needs the child's own list agreeing on the shared prefix."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = [1, 2, 3, 4, 5, 6]
    computed_prompt(kv, "p", tokens)
    assert kv.seqs["p"].token_ids is tokens
    tokens += [7, 8]
    kv.allocate_slots("p", 2)
    kv.mark_computed("p", 2)  # tokens 7 and 8 fill block 1: it enters the prefix cache
    assert kv.allocate_prompt("q", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8
    with pytest.raises(ValueError, match="own token list"):
        kv.fork("p", "c", tokens)  # the parent's very list
    with pytest.raises(ValueError, match="own token list"):
        kv.fork("p", "c", [1, 2, 3, 4, 5, 6, 7, 0])  # disagrees on a computed token
    child = tokens + [9]
    kv.fork("p", "c", child)
    assert kv.seqs["c"].token_ids is child and kv.num_computed("c") == 8
    assert kv.num_computed("unknown") == 0
    kv.check_integrity()


def test_swap_round_trip_preserves_sharing_and_counts():
    kv = KVCacheManager(num_blocks=8, block_size=4, num_host_blocks=8)
    computed_prompt(kv, "p", [1, 2, 3, 4, 5, 6])
    kv.fork("p", "c", [1, 2, 3, 4, 5, 6])
    out = kv.swap_out(["p", "c"])
    assert out == [(0, 0), (1, 1)]
    assert kv.block_table("p") == kv.block_table("c") == [0, 1]
    assert kv.is_swapped("p") and kv.host_pool.blocks[0].ref_count == 2
    assert kv.stats().used_blocks == 0
    kv.check_integrity()
    with pytest.raises(ValueError):
        kv.allocate_slots("p", 1)
    back = kv.swap_in(["p", "c"])
    assert [h for h, _ in back] == [0, 1]
    assert kv.block_table("p") == kv.block_table("c") == [d for _, d in back]
    assert kv.host_pool.num_free == 8
    s = kv.stats()
    assert (s.swapped_out_blocks, s.swapped_in_blocks) == (2, 2)
    kv.check_integrity()


def test_allocation_is_transactional():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    tokens = list(range(8))
    computed_prompt(kv, "a", tokens)
    before = (kv.pool.num_free, dict(kv.pool.cached), kv.stats())
    with pytest.raises(OutOfBlocksError) as err:
        kv.allocate_prompt("b", list(range(100, 120)))
    assert err.value.needed == 5 and err.value.available == 2
    assert "b" not in kv
    assert (kv.pool.num_free, dict(kv.pool.cached), kv.stats()) == before
    tokens += [1] * 9
    with pytest.raises(OutOfBlocksError):
        kv.allocate_slots("a", 9)
    assert kv.block_table("a") == [0, 1]
    kv.check_integrity()


def test_watermark_keeps_blocks_for_running_sequences():
    kv = KVCacheManager(num_blocks=10, block_size=4, watermark=0.2)
    tokens = list(range(32))
    kv.allocate_prompt("a", tokens)  # 8 blocks leaves exactly 2 = watermark
    with pytest.raises(OutOfBlocksError):
        kv.allocate_prompt("b", [1])
    kv.mark_computed("a", 32)
    tokens.append(5)
    kv.allocate_slots("a", 1)  # growth may use the watermark


def test_fifo_and_lrc_policies_choose_other_victims():
    def survivors(policy):
        kv = KVCacheManager(num_blocks=4, block_size=2, eviction_policy=policy)
        computed_prompt(kv, "old", [1, 2, 0])  # block 0 cached first
        computed_prompt(kv, "new", [3, 4, 0])  # block 2 cached second
        kv.free("new")
        kv.free("old")
        for i in range(3):  # "new"'s prefix is reused often ...
            computed_prompt(kv, f"n{i}", [3, 4, 9])
            kv.free(f"n{i}")
        computed_prompt(kv, "o", [1, 2, 9])  # ... "old"'s once, but most recently
        kv.free("o")
        computed_prompt(kv, "x", [7] * 6)  # 3 blocks: two empty ones and one eviction
        kv.check_integrity()
        assert kv.pool.evictions == 1
        return {0, 2} - set(kv.block_table("x"))  # the cached prefix block x did not take

    assert survivors("lru") == {0}   # block 2 was used least recently
    assert survivors("fifo") == {2}  # block 0 was cached first
    assert survivors("lrc") == {2}   # block 0 has fewer uses, outweighing its recency
    with pytest.raises(ValueError, match="eviction_policy"):
        KVCacheManager(4, 4, eviction_policy="random")


def test_integrity_check_catches_corruption():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    computed_prompt(kv, "a", list(range(6)))
    kv.pool.blocks[0].ref_count += 1
    with pytest.raises(IntegrityError):
        kv.check_integrity()
    kv.pool.blocks[0].ref_count -= 1
    kv.seqs["a"].tables[0].append(3)
    with pytest.raises(IntegrityError):
        kv.check_integrity()


def test_stats_fragmentation_and_evict_cached():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    computed_prompt(kv, "a", list(range(6)))  # 2 blocks, 6 of 8 slots filled
    s = kv.stats()
    assert (s.used_blocks, s.free_blocks, s.filled_slots, s.allocated_slots) == (2, 6, 6, 8)
    assert s.fragmentation == pytest.approx(0.25) and s.usage == pytest.approx(0.25)
    kv.free("a")
    assert kv.stats().evictable_blocks == 1
    assert kv.evict_cached() == 1
    assert kv.stats().cached_blocks == 0 and kv.stats().evictions == 1
    kv.check_integrity()


def test_pinned_block_is_never_evicted():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    computed_prompt(kv, "sys", [1, 2, 3])
    kv.pin(0)
    kv.free("sys")
    kv.check_integrity()
    with pytest.raises(OutOfBlocksError):
        kv.allocate_prompt("x", [5, 5, 5, 5, 5, 5])
    computed_prompt(kv, "y", [9, 9, 9, 9])
    kv.free("y")
    assert kv.allocate_prompt("z", [1, 2, 3]) == 2
    kv.unpin(0)
    kv.check_integrity()


def test_memory_core_does_not_import_torch():
    code = ("import sys, pagedkv.memory, pagedkv.sampling_params, pagedkv.outputs; "
            "m = pagedkv.memory.KVCacheManager(4, 4); "
            "print('torch' in sys.modules, 'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_scheduler_config_flags_and_cli_parsers_do_not_import_torch():
    code = ("import sys, pagedkv.engine.scheduler, pagedkv.engine.flags, pagedkv.engine.input_processor; "
            "from pagedkv.cli import build_parser; build_parser(); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]
