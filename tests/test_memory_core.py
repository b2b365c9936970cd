"""Exact block ids and eviction order for the memory core's classic cases."""

import subprocess
import sys

import pytest

from pagedkv.memory import FreeBlockQueue, IntegrityError, KVCacheManager, OutOfBlocksError
from pagedkv.memory.block import Block


def computed_prompt(mgr: KVCacheManager, seq_id, tokens, **kw) -> int:
    """Allocate a prompt and mark all of it computed, as one prefill step would."""
    cached = mgr.allocate_prompt(seq_id, tokens, **kw)
    mgr.mark_computed(seq_id, len(tokens) - cached)
    mgr.check_integrity()
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
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    assert computed_prompt(mgr, "a", prompt) == 0
    assert mgr.block_table("a") == [0, 1, 2]
    # Same prompt: the two full blocks hit, the partial one is computed again.
    assert mgr.allocate_prompt("b", prompt) == 8
    assert mgr.block_table("b") == [0, 1, 3]
    assert mgr.pool.blocks[0].ref_count == 2
    # A prompt of exactly two blocks: the second must still be computed (last token's logits).
    assert mgr.allocate_prompt("c", prompt[:8]) == 4
    assert mgr.block_table("c") == [0, 4]
    s = mgr.stats()
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (28, 12)
    mgr.check_integrity()


def test_partial_last_block_is_not_cached():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    computed_prompt(mgr, "a", [1, 2, 3, 4, 5, 6])
    assert len(mgr.pool.cached) == 1
    assert mgr.pool.blocks[1].block_hash is None
    mgr.free("a")
    # Tokens 1..6 then 7: only the first block can hit.
    assert mgr.allocate_prompt("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4


def test_block_is_cached_only_once_computed():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(12))
    mgr.allocate_prompt("a", prompt)  # slots reserved, KV not written yet
    assert mgr.allocate_prompt("b", prompt) == 0  # no same-step hit on unwritten KV
    mgr.mark_computed("a", 4)
    assert mgr.allocate_prompt("c", prompt) == 4
    mgr.check_integrity()


def test_salt_isolates_tenants():
    mgr = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(9))
    computed_prompt(mgr, "a", prompt, salt="tenant-1")
    assert mgr.allocate_prompt("b", prompt, salt="tenant-2") == 0
    assert mgr.allocate_prompt("c", prompt) == 0
    assert mgr.allocate_prompt("d", prompt, salt="tenant-1") == 8


def test_eviction_order_of_a_freed_chain():
    mgr = KVCacheManager(num_blocks=6, block_size=2)
    computed_prompt(mgr, "a", [1, 2, 3, 4, 5, 6, 7])  # blocks 0,1,2 full, 3 partial
    assert mgr.block_table("a") == [0, 1, 2, 3]
    mgr.free("a")
    # Empty blocks first (never cached: 4, 5 and the partial 3), then the chain from its tail.
    assert [b.block_id for b in mgr.pool.free_queue] == [3, 4, 5, 2, 1, 0]
    computed_prompt(mgr, "b", [9, 9, 9, 9, 9, 9, 9, 9, 9])  # 5 blocks: evicts blocks 2 and 1
    assert mgr.block_table("b") == [3, 4, 5, 2, 1]
    assert mgr.pool.evictions == 2
    assert mgr.pool.blocks[0].block_hash is not None  # the chain's head survives
    mgr.free("b")
    assert mgr.allocate_prompt("c", [1, 2, 3]) == 2  # head block still hits


def test_fork_then_append_copies_on_write():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    parent = [1, 2, 3, 4, 5, 6]
    computed_prompt(mgr, "p", parent)  # blocks 0 (full), 1 (2 of 4 slots)
    child = list(parent)
    mgr.fork("p", "c", child)
    assert mgr.block_table("c") == [0, 1]
    assert mgr.pool.blocks[1].ref_count == 2
    # The child writes token 7 into the shared partial block 1: it gets a copy.
    child.append(7)
    assert mgr.allocate_slots("c", 1) == [(1, 2)]
    assert mgr.block_table("c") == [0, 2]
    assert mgr.pool.blocks[1].ref_count == 1
    # The parent now owns block 1 alone and writes in place.
    parent.append(8)
    assert mgr.allocate_slots("p", 1) == []
    assert mgr.block_table("p") == [0, 1]
    assert mgr.stats().cow_copies == 1
    mgr.mark_computed("c", 1)
    mgr.mark_computed("p", 1)
    mgr.check_integrity()


def test_manager_reads_the_callers_token_list():
    """The caller owns a sequence's tokens: the manager reads its list (tokens appended later are
    seen), never copies it, and a fork needs the child's own list agreeing on the shared prefix."""
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    tokens = [1, 2, 3, 4, 5, 6]
    computed_prompt(mgr, "p", tokens)
    assert mgr.seqs["p"].token_ids is tokens
    tokens += [7, 8]
    mgr.allocate_slots("p", 2)
    mgr.mark_computed("p", 2)  # tokens 7 and 8 fill block 1: it enters the prefix cache
    assert mgr.allocate_prompt("q", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8
    with pytest.raises(ValueError, match="own token list"):
        mgr.fork("p", "c", tokens)  # the parent's very list
    with pytest.raises(ValueError, match="own token list"):
        mgr.fork("p", "c", [1, 2, 3, 4, 5, 6, 7, 0])  # disagrees on a computed token
    child = tokens + [9]
    mgr.fork("p", "c", child)
    assert mgr.seqs["c"].token_ids is child and mgr.num_computed("c") == 8
    assert mgr.num_computed("unknown") == 0
    mgr.check_integrity()


def test_swap_round_trip_preserves_sharing_and_counts():
    mgr = KVCacheManager(num_blocks=8, block_size=4, num_host_blocks=8)
    computed_prompt(mgr, "p", [1, 2, 3, 4, 5, 6])
    mgr.fork("p", "c", [1, 2, 3, 4, 5, 6])
    out = mgr.swap_out(["p", "c"])
    assert out == [(0, 0), (1, 1)]
    assert mgr.block_table("p") == mgr.block_table("c") == [0, 1]
    assert mgr.is_swapped("p") and mgr.host_pool.blocks[0].ref_count == 2
    assert mgr.stats().used_blocks == 0
    mgr.check_integrity()
    with pytest.raises(ValueError):
        mgr.allocate_slots("p", 1)
    back = mgr.swap_in(["p", "c"])
    assert [h for h, _ in back] == [0, 1]
    assert mgr.block_table("p") == mgr.block_table("c") == [d for _, d in back]
    assert mgr.host_pool.num_free == 8
    s = mgr.stats()
    assert (s.swapped_out_blocks, s.swapped_in_blocks) == (2, 2)
    mgr.check_integrity()


def test_allocation_is_transactional():
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    tokens = list(range(8))
    computed_prompt(mgr, "a", tokens)
    before = (mgr.pool.num_free, dict(mgr.pool.cached), mgr.stats())
    with pytest.raises(OutOfBlocksError) as err:
        mgr.allocate_prompt("b", list(range(100, 120)))
    assert err.value.needed == 5 and err.value.available == 2
    assert "b" not in mgr
    assert (mgr.pool.num_free, dict(mgr.pool.cached), mgr.stats()) == before
    tokens += [1] * 9
    with pytest.raises(OutOfBlocksError):
        mgr.allocate_slots("a", 9)
    assert mgr.block_table("a") == [0, 1]
    mgr.check_integrity()


def test_watermark_keeps_blocks_for_running_sequences():
    mgr = KVCacheManager(num_blocks=10, block_size=4, watermark=0.2)
    tokens = list(range(32))
    mgr.allocate_prompt("a", tokens)  # 8 blocks leaves exactly 2 = watermark
    with pytest.raises(OutOfBlocksError):
        mgr.allocate_prompt("b", [1])
    mgr.mark_computed("a", 32)
    tokens.append(5)
    mgr.allocate_slots("a", 1)  # growth may use the watermark


def test_fifo_and_lrc_policies_choose_other_victims():
    def survivors(policy):
        mgr = KVCacheManager(num_blocks=4, block_size=2, eviction_policy=policy)
        computed_prompt(mgr, "old", [1, 2, 0])  # block 0 cached first
        computed_prompt(mgr, "new", [3, 4, 0])  # block 2 cached second
        mgr.free("new")
        mgr.free("old")
        for i in range(3):  # "new"'s prefix is reused often ...
            computed_prompt(mgr, f"n{i}", [3, 4, 9])
            mgr.free(f"n{i}")
        computed_prompt(mgr, "o", [1, 2, 9])  # ... "old"'s once, but most recently
        mgr.free("o")
        computed_prompt(mgr, "x", [7] * 6)  # 3 blocks: two empty ones and one eviction
        mgr.check_integrity()
        assert mgr.pool.evictions == 1
        return {0, 2} - set(mgr.block_table("x"))  # the cached prefix block x did not take

    assert survivors("lru") == {0}   # block 2 was used least recently
    assert survivors("fifo") == {2}  # block 0 was cached first
    assert survivors("lrc") == {2}   # block 0 has fewer uses, outweighing its recency
    with pytest.raises(ValueError, match="eviction_policy"):
        KVCacheManager(4, 4, eviction_policy="random")


def test_integrity_check_catches_corruption():
    mgr = KVCacheManager(num_blocks=4, block_size=4)
    computed_prompt(mgr, "a", list(range(6)))
    mgr.pool.blocks[0].ref_count += 1
    with pytest.raises(IntegrityError):
        mgr.check_integrity()
    mgr.pool.blocks[0].ref_count -= 1
    mgr.seqs["a"].tables[0].append(3)
    with pytest.raises(IntegrityError):
        mgr.check_integrity()


def test_stats_fragmentation_and_evict_cached():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    computed_prompt(mgr, "a", list(range(6)))  # 2 blocks, 6 of 8 slots filled
    s = mgr.stats()
    assert (s.used_blocks, s.free_blocks, s.filled_slots, s.allocated_slots) == (2, 6, 6, 8)
    assert s.fragmentation == pytest.approx(0.25) and s.usage == pytest.approx(0.25)
    mgr.free("a")
    assert mgr.stats().evictable_blocks == 1
    assert mgr.evict_cached() == 1
    assert mgr.stats().cached_blocks == 0 and mgr.stats().evictions == 1
    mgr.check_integrity()


def test_pinned_block_is_never_evicted():
    mgr = KVCacheManager(num_blocks=3, block_size=2)
    computed_prompt(mgr, "sys", [1, 2, 3])
    mgr.pin(0)
    mgr.free("sys")
    mgr.check_integrity()
    with pytest.raises(OutOfBlocksError):
        mgr.allocate_prompt("x", [5, 5, 5, 5, 5, 5])
    computed_prompt(mgr, "y", [9, 9, 9, 9])
    mgr.free("y")
    assert mgr.allocate_prompt("z", [1, 2, 3]) == 2
    mgr.unpin(0)
    mgr.check_integrity()


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
