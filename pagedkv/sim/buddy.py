"""A binary buddy allocator over KV slots: power-of-two chunks, split on demand, merged on free.

The capacity is cut into power-of-two roots (its binary digits, largest first, each aligned to its
own size), and every chunk of order ``k`` (``2**k`` slots) starts at a multiple of ``2**k``, so a
chunk's buddy is ``offset ^ 2**k``::

    root of order 4 (16 slots):  [0 ............................ 16)
    alloc 3 -> order 2:          [0..4)=A  [4..8) free  [8..16) free
    alloc 5 -> order 3:          [0..4)=A  [4..8) free  [8..16)=B
    free A  -> merges with [4..8) into [0..8) (B's buddy), not with B while B is held

Rounding a reservation up to a power of two wastes up to half of it (internal fragmentation);
free chunks whose buddy is held cannot merge, so a large request can wait while the free slots
add up to more than it needs (external fragmentation).
"""

from __future__ import annotations

from bisect import bisect_right


def order_for(size: int) -> int:
    """The smallest ``k`` with ``2**k >= size`` (``size >= 1``)."""
    return max(0, (size - 1).bit_length())


class BuddyAllocator:
    """Buddy heap of ``capacity`` slots; chunks are at least ``2**min_order`` slots."""

    def __init__(self, capacity: int, min_order: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 slot, got {capacity}")
        self.capacity = capacity
        self.min_order = min_order
        self.max_order = capacity.bit_length() - 1
        self.free_lists: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self.root_starts: list[int] = []
        self.root_orders: list[int] = []
        start = 0
        for order in range(self.max_order, min_order - 1, -1):
            if capacity >> order & 1:
                self.root_starts.append(start)
                self.root_orders.append(order)
                self.free_lists[order].add(start)
                start += 1 << order
        # Capacity bits below min_order are unusable slack.

    def alloc(self, size: int) -> tuple[int, int] | None:
        """Take the lowest-addressed free chunk of the smallest fitting order, splitting a larger
        one when needed. Returns ``(offset, chunk_size)`` or None when no chunk is big enough."""
        order = max(self.min_order, order_for(size))
        for o in range(order, self.max_order + 1):
            if self.free_lists[o]:
                offset = min(self.free_lists[o])
                self.free_lists[o].remove(offset)
                while o > order:
                    o -= 1
                    self.free_lists[o].add(offset + (1 << o))
                return offset, 1 << order
        return None

    def free(self, offset: int, size: int) -> None:
        """Return a chunk, merging with its buddy while the buddy is free and within the root."""
        order = order_for(size)
        root_order = self.root_orders[bisect_right(self.root_starts, offset) - 1]
        while order < root_order:
            buddy = offset ^ (1 << order)
            if buddy not in self.free_lists[order]:
                break
            self.free_lists[order].remove(buddy)
            offset = min(offset, buddy)
            order += 1
        self.free_lists[order].add(offset)

    def unusable(self, size: int) -> int:
        order = max(self.min_order, order_for(size))
        return sum(len(chunks) << o for o, chunks in enumerate(self.free_lists[:order]))

    @property
    def free_slots(self) -> int:
        return sum(len(chunks) << o for o, chunks in enumerate(self.free_lists))

    def largest_chunk(self) -> int:
        """The size of the biggest chunk that could ever be allocated."""
        return 1 << self.root_orders[0] if self.root_orders else 0
