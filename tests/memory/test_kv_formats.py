"""A mixed pool in the memory core: a block's format is its id's range (ids below
``num_full_blocks`` full precision, the rest 8-bit), allocation asks per block, and the policies on
top (sink blocks, full-precision requests) keep their blocks where they belong."""

from __future__ import annotations

import pytest

from pagedkv.memory import FULL_PRECISION_SALT, BlockPool, IntegrityError, KVCacheManager, OutOfBlocksError


def test_pool_takes_the_format_asked_for_and_spills_when_one_runs_out():
    pool = BlockPool(8, num_full_blocks=2)
    blocks = pool.allocate(3, full=[True, False, False])
    assert [pool.is_full_precision(b) for b in blocks] == [True, False, False]
    assert pool.num_free_full == 1
    more = pool.allocate(2, full=[True, True])  # one full block left: the second spills to 8-bit
    assert [pool.is_full_precision(b) for b in more] == [True, False]
    assert pool.num_free_full == 0
    pool.check_integrity()
    pool.free(more)
    assert pool.num_free_full == 1
    rest = pool.allocate(5, full=[False] * 5)  # 8-bit ones first, then the full-precision one
    assert [pool.is_full_precision(b) for b in rest] == [False, False, False, False, True]
    pool.check_integrity()


def test_strict_full_precision_fails_without_taking_anything():
    pool = BlockPool(6, num_full_blocks=2)
    with pytest.raises(OutOfBlocksError, match="full-precision"):
        pool.allocate(3, full=[True] * 3, strict_full=True)
    assert pool.num_free == 6 and pool.num_free_full == 2
    assert all(pool.is_full_precision(b) for b in pool.allocate(2, full=[True] * 2, strict_full=True))


def test_a_cached_full_block_is_counted_when_a_hit_revives_it():
    pool = BlockPool(4, num_full_blocks=1)
    [block] = pool.allocate(1, full=[True])
    pool.cache([block], [b"h"])
    pool.free([block])
    assert pool.num_free_full == 1
    pool.touch(block)
    assert pool.num_free_full == 0
    pool.check_integrity()
    pool.num_free_full = 1  # a miscount is found
    with pytest.raises(IntegrityError, match="free full-precision"):
        pool.check_integrity()


def test_single_format_pools_are_untouched():
    pool = BlockPool(4)
    assert [b.block_id for b in pool.allocate(2)] == [0, 1]
    assert pool.num_full_blocks == 0 and pool.num_free_full == 0
    with pytest.raises(ValueError, match="num_full_blocks"):
        BlockPool(4, num_full_blocks=4)


def _manager(**kw) -> KVCacheManager:
    return KVCacheManager(24, 4, num_full_blocks=6, kv_sink_blocks=1, **kw)


def test_sink_blocks_are_full_precision_the_rest_8bit():
    kv = _manager()
    tokens = list(range(14))
    kv.allocate_prompt("a", tokens)
    table = kv.block_table("a")
    assert table[0] < 6 and all(b >= 6 for b in table[1:])
    kv.mark_computed("a", 14)
    for _ in range(6):  # decode into new blocks: 8-bit
        tokens.append(1)
        kv.allocate_slots("a", 1)
        kv.mark_computed("a", 1)
    assert kv.block_table("a")[0] < 6 and all(b >= 6 for b in kv.block_table("a")[1:])
    kv.check_integrity()
    s = kv.stats()
    assert s.full_precision_blocks == 6 and s.free_full_precision_blocks == 5


def test_a_full_precision_request_holds_only_full_blocks_and_shares_nothing_with_8bit_ones():
    kv = _manager()
    prompt = list(range(12))
    kv.allocate_prompt("q8", prompt)
    kv.mark_computed("q8", 12)
    salt = FULL_PRECISION_SALT
    assert kv.allocate_prompt("fp", list(prompt), salt=salt) == 0  # same tokens: no hit on the 8-bit blocks
    assert all(b < 6 for b in kv.block_table("fp"))
    kv.mark_computed("fp", 12)
    assert kv.allocate_prompt("fp2", list(prompt), salt=salt) == 8  # full-precision blocks serve their like
    assert all(b < 6 for b in kv.block_table("fp2"))
    kv.check_integrity()
    kv.free("fp2")
    kv.free("fp")
    with pytest.raises(OutOfBlocksError, match="full-precision"):  # 6 full blocks, 8 wanted: it waits
        kv.allocate_prompt("long", list(range(100, 132)), salt=salt)
    assert "long" not in kv
    kv.check_integrity()


def test_fork_and_copy_on_write_keep_the_format_of_the_position():
    kv = _manager()
    parent = list(range(6))
    kv.allocate_prompt("p", parent)
    kv.mark_computed("p", 6)
    child = list(parent)
    kv.fork("p", "c", child)
    child.append(7)
    copies = kv.allocate_slots("c", 1)  # writes into the shared second block: copied first
    assert len(copies) == 1 and copies[0][0] >= 6 and copies[0][1] >= 6
    assert kv.block_table("c")[0] == kv.block_table("p")[0] < 6
    kv.check_integrity()


def test_kv_events_say_which_blocks_a_full_precision_request_stored():
    from pagedkv.kv_events import BlockStored
    from pagedkv.memory.prefix_cache import FULL_PRECISION_EVENT_KEY

    kv = _manager(kv_events=True)
    prompt = list(range(12))
    kv.allocate_prompt("q8", prompt)
    kv.mark_computed("q8", 12)
    kv.allocate_prompt("fp", list(prompt), salt=FULL_PRECISION_SALT)
    kv.mark_computed("fp", 12)
    stored = [e for e in kv.events.events if isinstance(e, BlockStored)]
    assert [e.extra_keys is not None and FULL_PRECISION_EVENT_KEY in e.extra_keys for e in stored] == [False, True]
    assert stored[0].block_hashes != stored[1].block_hashes  # same tokens, not the same blocks
