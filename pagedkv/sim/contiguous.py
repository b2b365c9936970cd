"""Contiguous reservation: every sequence gets one fixed extent of KV slots up front.

This is how static-cache engines (and the pre-PagedAttention systems in the vLLM paper, Orca's
"Max" / "Oracle" / "Pow2") hold KV: a sequence's slots must be contiguous, so the extent is sized
for the longest the sequence could get and reserved at admission::

    capacity  [ seq A: prompt|gen|....reserved.... ][ seq C ....... ][ free ][ seq D ..... ][free]
                 filled          never/future           external fragmentation: free extents
                                                        too small for the next reservation

``ExtentAllocator`` is a first-fit allocator over a sorted free list with coalescing on free, so
variable-size reservations leave holes the way a real one does. ``ReservationPolicy`` turns any
allocator with ``alloc``/``free``/``unusable`` into a ``MemoryPolicy``; the buddy policy reuses it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from typing import Protocol

from pagedkv.sim.memory_policy import MemoryUsage, SimSeq
from pagedkv.sim.workload import Request


class SlotAllocator(Protocol):
    capacity: int

    def alloc(self, size: int) -> tuple[int, int] | None:
        """Reserve at least ``size`` slots; returns ``(offset, reserved_size)`` or None."""
        ...

    def free(self, offset: int, size: int) -> None: ...

    def unusable(self, size: int) -> int:
        """Free slots lying in holes too small for a ``size``-slot reservation."""
        ...

    @property
    def free_slots(self) -> int: ...


class ExtentAllocator:
    """First-fit over free extents ``[start, start + length)`` kept sorted by start.

    Freeing merges with both neighbours, so free space is always maximal extents. Operations
    are O(number of free extents), which stays below the number of running sequences + 1.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 slot, got {capacity}")
        self.capacity = capacity
        self.starts: list[int] = [0]
        self.lengths: list[int] = [capacity]

    def alloc(self, size: int) -> tuple[int, int] | None:
        for i, length in enumerate(self.lengths):
            if length >= size:
                start = self.starts[i]
                if length == size:
                    del self.starts[i], self.lengths[i]
                else:
                    self.starts[i] += size
                    self.lengths[i] -= size
                return start, size
        return None

    def free(self, offset: int, size: int) -> None:
        i = bisect_left(self.starts, offset)
        starts, lengths = self.starts, self.lengths
        merge_prev = i > 0 and starts[i - 1] + lengths[i - 1] == offset
        merge_next = i < len(starts) and offset + size == starts[i]
        if merge_prev and merge_next:
            lengths[i - 1] += size + lengths[i]
            del starts[i], lengths[i]
        elif merge_prev:
            lengths[i - 1] += size
        elif merge_next:
            starts[i] = offset
            lengths[i] += size
        else:
            starts.insert(i, offset)
            lengths.insert(i, size)

    def unusable(self, size: int) -> int:
        return sum(length for length in self.lengths if length < size)

    @property
    def free_slots(self) -> int:
        return sum(self.lengths)


class ReservationPolicy:
    """Reserve ``reserve(request)`` slots per sequence at admission, from ``allocator``.

    Growth never allocates: the reservation already covers the sequence's final length, so these
    policies never preempt. ``never`` slots are ``reserved - final_len`` per sequence. Tenants
    and their KV quotas do not apply (no prefix cache, nothing to share or cap).
    """

    def __init__(self, name: str, allocator: SlotAllocator,
                 reserve: Callable[[Request], int]) -> None:
        self.name = name
        self.block_size: int | None = None
        self.capacity = allocator.capacity
        self.allocator = allocator
        self.reserve = reserve
        # seq_id -> [offset, reserved, length, final_len]
        self.held: dict[int, list[int]] = {}
        self.filled = 0
        self.never = 0
        self.last_hit_tokens = 0

    def admit(self, request: Request, seqs: list[SimSeq]) -> bool:
        size = self.reserve(request)
        taken: list[SimSeq] = []
        for seq in seqs:
            got = self.allocator.alloc(size)
            if got is None:
                self.release(taken)
                return False
            offset, reserved = got
            self.held[seq.seq_id] = [offset, reserved, len(seq.tokens), seq.final_len]
            self.filled += len(seq.tokens)
            self.never += reserved - seq.final_len
            taken.append(seq)
        return True

    def grow(self, seq: SimSeq) -> bool:
        entry = self.held[seq.seq_id]
        if entry[2] >= entry[1]:
            return False  # past its reservation: a contiguous extent cannot grow in place
        entry[2] += 1
        self.filled += 1
        return True

    def replace(self, loser: SimSeq, winner: SimSeq, new: SimSeq) -> bool:
        # The new beam overwrites the loser's extent with the winner's tokens: same length.
        entry = self.held.pop(loser.seq_id)
        self.filled += len(winner.tokens) - entry[2]
        entry[2] = len(winner.tokens)
        self.held[new.seq_id] = entry
        return True

    def release(self, seqs: list[SimSeq]) -> None:
        for seq in seqs:
            entry = self.held.pop(seq.seq_id, None)
            if entry is None:
                continue
            offset, reserved, length, final_len = entry
            self.allocator.free(offset, reserved)
            self.filled -= length
            self.never -= reserved - final_len

    def usage(self) -> MemoryUsage:
        allocated = sum(entry[1] for entry in self.held.values())
        return MemoryUsage(allocated, self.filled, self.never)

    def unusable_free_slots(self, request: Request) -> int:
        return self.allocator.unusable(self.reserve(request))

    def counters(self) -> dict[str, int]:
        return {}

    def quota_status(self, tenant: str | None) -> int | None:
        return None

    def fits(self, request: Request, seqs: list[SimSeq]) -> bool:
        """Free holes large enough hold every reservation (exact for one sequence; the simulator
        asks only with quotas, which these policies ignore)."""
        size = self.reserve(request)
        return self.allocator.free_slots - self.allocator.unusable(size) >= size * len(seqs)

    def within_quota(self, request: Request, seqs: list[SimSeq]) -> bool:
        return False

    def check_integrity(self) -> None:
        """Held + free slots == capacity; running counts match the held entries."""
        held = sum(entry[1] for entry in self.held.values())
        free = self.allocator.free_slots
        if held + free != self.capacity:
            raise AssertionError(f"{self.name}: held {held} + free {free} != {self.capacity}")
        if self.filled != sum(entry[2] for entry in self.held.values()):
            raise AssertionError(f"{self.name}: filled count drifted")
        if self.never != sum(entry[1] - entry[3] for entry in self.held.values()):
            raise AssertionError(f"{self.name}: never-filled count drifted")
