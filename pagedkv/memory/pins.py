"""Conversation pins: a finished turn's cached prefix held on the device until a TTL passes.

A pin holds one reference on each block of a conversation's prompt + output prefix (its full,
computed blocks, every KV group), so the eviction policy cannot take them; the blocks stay in the
prefix cache and count as used (and against their tenant's quota, ``memory/tenant_ledger.py``). One pin
per ``(tenant, conversation)``: a newer turn replaces the older turn's pin (the new blocks are
taken before the old ones are let go, so the prefix they share is never free in between).

Pins never starve work: ``release_for(n)`` lets go of the oldest pins (other tenants' before the
asking tenant's own) until ``n`` blocks are free, whether or not anything runs, and
``release_oldest_of(tenant)`` one of a tenant's whose quota its pins fill, counting each one
released (``released_under_pressure``); expired pins go at the start of each step (``expire``).
A tenant's pins hold at most a share of the pool when the owner sets one: ``blocks_after`` says
what a new pin would take the tenant to, so the owner can refuse it first.
Pure Python.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.errors import IntegrityError


@dataclass(slots=True)
class Pin:
    block_ids: list[int]
    expires_at: float  # on the caller's clock (the engine uses time.monotonic())


class PinOutcome(NamedTuple):
    """What ``KVCacheManager.pin_prefix`` did: blocks pinned, or why the pin was refused."""

    blocks: int
    refused: str | None = None


def pin_tenant(key: Hashable) -> Hashable | None:
    """The tenant of a pin key ``(tenant, conversation)``; None for a key of another shape."""
    return key[0] if isinstance(key, tuple) and key else None


class ConversationPins:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.pins: OrderedDict[Hashable, Pin] = OrderedDict()  # oldest first
        self.pinned_turns = 0
        self.expired = 0
        self.replaced = 0
        self.released_under_pressure = 0
        self.refused = 0  # pins refused: the tenant's pins would hold more than its share
        self._by_tenant: dict[Hashable | None, Counter[int]] = {}  # references per block, per tenant

    def __len__(self) -> int:
        return len(self.pins)

    def pin(self, key: Hashable, block_ids: Iterable[int], expires_at: float) -> None:
        blocks = self.pool.blocks
        ids = list(dict.fromkeys(block_ids))
        for i in ids:
            self.pool.touch(blocks[i])
        old = self.pins.pop(key, None)
        if old is not None:
            self._free(old, key)
            self.replaced += 1
        self.pins[key] = Pin(ids, expires_at)
        self._by_tenant.setdefault(pin_tenant(key), Counter()).update(ids)
        self.pinned_turns += 1

    def blocks_of(self, tenant: Hashable | None) -> int:
        """Distinct device blocks ``tenant``'s pins hold."""
        return len(self._by_tenant.get(tenant, ()))

    def blocks_after(self, key: Hashable, block_ids: Iterable[int]) -> int:
        """Distinct blocks ``key``'s tenant's pins would hold once ``key`` pins ``block_ids``
        (replacing its earlier pin)."""
        refs = Counter(self._by_tenant.get(pin_tenant(key), ()))
        old = self.pins.get(key)
        if old is not None:
            refs.subtract(old.block_ids)
        held = {i for i, n in refs.items() if n > 0}
        return len(held.union(block_ids))

    def unpin(self, key: Hashable) -> bool:
        pin = self.pins.pop(key, None)
        if pin is not None:
            self._free(pin, key)
        return pin is not None

    def expire(self, now: float) -> int:
        """Let go of every pin whose TTL has passed; returns how many."""
        done = [key for key, pin in self.pins.items() if pin.expires_at <= now]
        for key in done:
            self._free(self.pins.pop(key), key)
        self.expired += len(done)
        return len(done)

    def release_for(self, n: int, tenant: Hashable | None = None, keep: frozenset[int] = frozenset()) -> int:
        """Let go of pins until ``n`` blocks are free (or none is left to let go): the oldest
        first, other tenants' before ``tenant``'s own; pins holding a block of ``keep`` (the
        asker's own prefix hits) stay. Returns how many were released."""
        released = 0
        order = sorted(self.pins, key=lambda k: pin_tenant(k) == tenant and tenant is not None)  # (stable)
        for key in order:
            if self.pool.num_free >= n:
                break
            if keep and not keep.isdisjoint(self.pins[key].block_ids):
                continue
            self._free(self.pins.pop(key), key)
            released += 1
        self.released_under_pressure += released
        return released

    def releasable(self, keep: frozenset[int] = frozenset()) -> int:
        """Blocks that letting go of every pin (but those holding a block of ``keep``) would
        free: the blocks nothing else holds. Changes nothing."""
        refs: Counter[int] = Counter()
        kept: set[int] = set()
        for pin in self.pins.values():
            if keep and not keep.isdisjoint(pin.block_ids):
                kept.update(pin.block_ids)
            else:
                refs.update(pin.block_ids)
        blocks = self.pool.blocks
        return sum(1 for i, n in refs.items() if i not in kept and blocks[i].ref_count == n)

    def release_oldest_of(self, tenant: str | None) -> bool:
        """Let go of ``tenant``'s oldest pin (keys are ``(tenant, conversation)``), counted as
        released under pressure; False when it has none."""
        key = next((k for k in self.pins if pin_tenant(k) == tenant), None)
        if key is None:
            return False
        self._free(self.pins.pop(key), key)
        self.released_under_pressure += 1
        return True

    def refs(self) -> Counter[int]:
        """References the pins hold, per block id (for ``check_integrity``); raises IntegrityError
        when the per-tenant counts disagree with the pins."""
        by_tenant: dict[Hashable | None, Counter[int]] = {}
        for key, pin in self.pins.items():
            by_tenant.setdefault(pin_tenant(key), Counter()).update(pin.block_ids)
        if by_tenant != self._by_tenant:
            raise IntegrityError("conversation pins: the per-tenant block counts disagree with the pins")
        return Counter(i for pin in self.pins.values() for i in pin.block_ids)

    def _free(self, pin: Pin, key: Hashable) -> None:
        tenant = pin_tenant(key)
        refs = self._by_tenant[tenant]
        refs.subtract(pin.block_ids)
        for i in pin.block_ids:
            if refs[i] <= 0:
                del refs[i]
        if not refs:
            del self._by_tenant[tenant]
        blocks = self.pool.blocks
        self.pool.free(blocks[i] for i in reversed(pin.block_ids))
