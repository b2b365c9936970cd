"""Conversation pins: a finished turn's cached prefix held on the device until a TTL passes.

A pin holds one reference on each block of a conversation's prompt + output prefix (its full,
computed blocks, every KV group), so the eviction policy cannot take them; the blocks stay in the
prefix cache and count as used (and against their tenant's quota, ``memory/tenancy.py``). One pin
per ``(tenant, conversation)``: a newer turn replaces the older turn's pin (the new blocks are
taken before the old ones are let go, so the prefix they share is never free in between).

Pins never starve work: ``release_for(n)`` lets go of the oldest pins until ``n`` blocks are free,
and ``release_oldest_of(tenant)`` one of a tenant's whose quota its pins fill, counting each one
released (``released_under_pressure``); expired pins go at the start of each step (``expire``).
Pure Python.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from pagedkv.memory.block_pool import BlockPool


@dataclass(slots=True)
class Pin:
    block_ids: list[int]
    expires_at: float  # on the caller's clock (the engine uses time.monotonic())


class ConversationPins:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.pins: OrderedDict[Hashable, Pin] = OrderedDict()  # oldest first
        self.pinned_turns = 0
        self.expired = 0
        self.replaced = 0
        self.released_under_pressure = 0

    def __len__(self) -> int:
        return len(self.pins)

    def pin(self, key: Hashable, block_ids: Iterable[int], expires_at: float) -> None:
        blocks = self.pool.blocks
        ids = list(dict.fromkeys(block_ids))
        for i in ids:
            self.pool.touch(blocks[i])
        old = self.pins.pop(key, None)
        if old is not None:
            self._free(old)
            self.replaced += 1
        self.pins[key] = Pin(ids, expires_at)
        self.pinned_turns += 1

    def unpin(self, key: Hashable) -> bool:
        pin = self.pins.pop(key, None)
        if pin is not None:
            self._free(pin)
        return pin is not None

    def expire(self, now: float) -> int:
        """Let go of every pin whose TTL has passed; returns how many."""
        done = [key for key, pin in self.pins.items() if pin.expires_at <= now]
        for key in done:
            self._free(self.pins.pop(key))
        self.expired += len(done)
        return len(done)

    def release_for(self, n: int) -> int:
        """Let go of the oldest pins until ``n`` blocks are free (or none is left); returns how many."""
        released = 0
        while self.pins and self.pool.num_free < n:
            _, pin = self.pins.popitem(last=False)
            self._free(pin)
            released += 1
        self.released_under_pressure += released
        return released

    def release_oldest_of(self, tenant: str | None) -> bool:
        """Let go of ``tenant``'s oldest pin (keys are ``(tenant, conversation)``), counted as
        released under pressure; False when it has none."""
        key = next((k for k in self.pins if isinstance(k, tuple) and k and k[0] == tenant), None)
        if key is None:
            return False
        self._free(self.pins.pop(key))
        self.released_under_pressure += 1
        return True

    def refs(self) -> Counter[int]:
        """References the pins hold, per block id (for ``check_integrity``)."""
        return Counter(i for pin in self.pins.values() for i in pin.block_ids)

    def _free(self, pin: Pin) -> None:
        blocks = self.pool.blocks
        self.pool.free(blocks[i] for i in reversed(pin.block_ids))
