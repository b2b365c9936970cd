"""Exact offsets for the contiguous (first-fit) and buddy allocators the simulator compares."""

from __future__ import annotations

import random

import pytest

from pagedkv.sim.buddy import BuddyAllocator, order_for
from pagedkv.sim.contiguous import ExtentAllocator


def test_extent_first_fit_and_coalescing() -> None:
    a = ExtentAllocator(100)
    assert a.alloc(30) == (0, 30)
    assert a.alloc(30) == (30, 30)
    assert a.alloc(30) == (60, 30)
    assert a.alloc(30) is None  # 10 free, in one extent
    a.free(30, 30)
    assert (a.starts, a.lengths) == ([30, 90], [30, 10])
    assert a.unusable(20) == 10  # the tail hole is too small for 20
    assert a.alloc(20) == (30, 20)  # first fit, not best fit
    a.free(0, 30)
    assert (a.starts, a.lengths) == ([0, 50, 90], [30, 10, 10])
    a.free(30, 20)
    a.free(60, 30)
    assert (a.starts, a.lengths) == ([0], [100])


def test_extent_external_fragmentation_shows() -> None:
    a = ExtentAllocator(100)
    offsets = [a.alloc(10)[0] for _ in range(10)]
    for off in offsets[::2]:
        a.free(off, 10)
    assert a.free_slots == 50
    assert a.alloc(11) is None  # 50 free slots, none contiguous beyond 10
    assert a.unusable(11) == 50


def test_order_for() -> None:
    assert [order_for(n) for n in (1, 2, 3, 4, 5, 8, 9, 1024, 1025)] == [0, 1, 2, 2, 3, 3, 4, 10, 11]


def test_buddy_split_and_merge_exact_offsets() -> None:
    b = BuddyAllocator(16)
    assert b.alloc(3) == (0, 4)  # 16 -> 8 + 8 -> 4 + 4
    assert b.free_lists[2] == {4} and b.free_lists[3] == {8}
    assert b.alloc(5) == (8, 8)
    assert b.alloc(1) == (4, 1)  # splits [4, 8) into 4, 5, [6, 8)
    assert b.free_lists[0] == {5} and b.free_lists[1] == {6}
    b.free(0, 4)  # buddy [4, 8) is split and partly held: no merge
    assert b.free_lists[2] == {0}
    b.free(4, 1)  # 4+5 -> [4,6) + [6,8) -> [4,8) + [0,4) -> [0,8); [8,16) held
    assert b.free_lists[3] == {0} and not any(b.free_lists[o] for o in (0, 1, 2, 4))
    assert b.unusable(9) == 8  # 8 free slots, but a 16-chunk is needed
    b.free(8, 8)
    assert b.free_lists[4] == {0} and b.free_slots == 16


def test_buddy_roots_of_non_power_of_two_never_merge() -> None:
    b = BuddyAllocator(24)  # roots [0, 16) and [16, 24)
    assert (b.root_starts, b.root_orders) == ([0, 16], [4, 3])
    assert b.alloc(17) is None  # no chunk of 32
    got = [b.alloc(8) for _ in range(3)]
    assert got == [(16, 8), (0, 8), (8, 8)]  # smallest fitting order first
    for item in got:
        assert item is not None
        b.free(*item)
    assert b.free_lists[4] == {0} and b.free_lists[3] == {16}
    assert b.largest_chunk() == 16


def test_buddy_random_ops_conserve_slots() -> None:
    rng = random.Random(3)
    b = BuddyAllocator(1000)
    held: list[tuple[int, int]] = []
    for _ in range(3000):
        if held and rng.random() < 0.45:
            b.free(*held.pop(rng.randrange(len(held))))
        else:
            got = b.alloc(rng.randint(1, 70))
            if got is not None:
                held.append(got)
        assert b.free_slots + sum(size for _, size in held) == 1000
        spans = sorted(held)
        assert all(o1 + s1 <= o2 for (o1, s1), (o2, _) in zip(spans, spans[1:]))
    for item in held:
        b.free(*item)
    assert b.free_lists[9] == {0}  # 1000 = 512 + 256 + 128 + 64 + 32 + 8, all merged back
    assert sum(len(s) for s in b.free_lists) == 6


def test_allocators_reject_empty_capacity() -> None:
    with pytest.raises(ValueError, match="capacity"):
        ExtentAllocator(0)
    with pytest.raises(ValueError, match="capacity"):
        BuddyAllocator(0)
