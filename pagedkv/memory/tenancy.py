"""Tenancy: per-tenant KV quotas and conversation pins, and the scheduler's questions about them.

Owns the quota ledger (``memory/tenant_ledger.py``: who holds which device blocks; None with quotas
off), the conversation pins (``memory/pins.py``) and the limit on one tenant's pins. The device
pool consults the ledger when it allocates (it was given the ledger when built); everything else
asks this part: may a tenant's prompt take n blocks, is a tenant over or under its quota, let go
of pins so work is never starved, pin a finished turn's prefix. Pure Python.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from typing import Any

from pagedkv.memory.block import Block
from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.pins import ConversationPins, PinOutcome
from pagedkv.memory.tenant_ledger import DEFAULT_TENANT, TenantLedger


class Tenancy:
    """Args:
        pool: the device pool (pins hold its blocks; its free count decides what pins give way).
        ledger: the quota ledger the pool was built with, or None with quotas off.
        pin_limit: the most device blocks one tenant's pins may hold (None: no limit but the pool).
    """

    def __init__(self, pool: BlockPool, ledger: TenantLedger | None, pin_limit: int | None = None) -> None:
        self.pool = pool
        self.ledger = ledger
        self.pins = ConversationPins(pool)
        self.pin_limit = pin_limit

    # ------------------------------------------------------------------ the scheduler's questions
    @property
    def quotas_on(self) -> bool:
        return self.ledger is not None

    def holder(self, tenant: str | None) -> str | None:
        """The name a sequence of ``tenant`` holds its blocks under (None with quotas off)."""
        return (tenant or DEFAULT_TENANT) if self.ledger is not None else None

    def over_quota(self, tenant: str | None) -> bool:
        """Whether ``tenant`` holds more device blocks than its quota (False with quotas off)."""
        ledger = self.ledger
        return ledger is not None and ledger.is_over(tenant or DEFAULT_TENANT)

    def under_quota(self, tenant: str | None) -> bool:
        """Whether ``tenant`` holds fewer device blocks than its quota (False with quotas off or
        without a quota for it)."""
        ledger = self.ledger
        if ledger is None:
            return False
        limit = ledger.limit(tenant or DEFAULT_TENANT)
        return limit is not None and ledger.held[tenant or DEFAULT_TENANT] < limit

    def quota_admits(self, tenant: str | None, need: int) -> bool:
        """Whether ``tenant``'s quota lets a new prompt take ``need`` fresh blocks now (True with
        quotas off); changes nothing."""
        ledger = self.ledger
        return ledger is None or ledger.allocation_error(tenant or DEFAULT_TENANT, need, self.pool.num_free,
                                                         admit=True) is None

    def limit(self, tenant: str | None) -> int | None:
        """``tenant``'s quota in blocks; None with quotas off or no quota for it."""
        return None if self.ledger is None else self.ledger.limit(tenant or DEFAULT_TENANT)

    def in_use(self, tenant: str | None) -> int:
        """Device blocks ``tenant`` holds, less its cached-free ones (which it gives up first)."""
        ledger = self.ledger
        if ledger is None:
            return 0
        name = tenant or DEFAULT_TENANT
        return ledger.held[name] - ledger.own_cached(name)

    def held(self, tenant: str | None) -> int:
        """Device blocks ``tenant`` holds (used or cached-free); 0 with quotas off."""
        return 0 if self.ledger is None else self.ledger.held[tenant or DEFAULT_TENANT]

    # ------------------------------------------------------------------ admission
    def make_room(self, need: int, admission: bool = False, tenant: str | None = None,
                  keep: tuple[Block, ...] | list[Block] = ()) -> None:
        """Pins never starve work: let go of the oldest (other tenants' before ``tenant``'s own)
        until ``need`` blocks are free, whether or not anything runs. For a new prompt
        (``admission``) only when that admits it: while even every pin would not free enough, they
        stay (running work frees blocks as it finishes, and the prompt is tried again). Pins
        holding a block of ``keep`` (the prompt's own prefix hits) stay."""
        pins = self.pins
        if not pins.pins or self.pool.num_free >= need:
            return
        kept = frozenset(b.block_id for b in keep)
        if admission and self.pool.num_free + pins.releasable(kept) < need:
            return
        pins.release_for(need, tenant, kept)

    def check_admission(self, tenant: str | None, need: int, hits: list[Block]) -> None:
        """Raise TenantQuotaError, changing nothing, when a new prompt of ``tenant`` needing
        ``need`` fresh blocks (after touching ``hits``) would go over its quota; its own
        conversation pins give way first rather than block it for ever."""
        ledger = self.ledger
        if ledger is None or tenant is None:
            return
        revived = sum(1 for b in hits if b.ref_count == 0 and b.tenant == tenant)
        while True:
            error = ledger.allocation_error(tenant, need, self.pool.num_free, admit=True, revived=revived)
            if error is None:
                return
            if not self.pins.release_oldest_of(tenant):
                ledger.quota_waits[tenant] += 1
                raise error

    # ------------------------------------------------------------------ conversation pins
    def pin(self, key: Hashable, block_ids: list[int], expires_at: float) -> PinOutcome:
        """Pin ``block_ids`` under ``key`` (``(tenant, conversation)``) until ``expires_at``,
        replacing its earlier pin; refused (the earlier pin stays) when the tenant's pins would
        hold more than ``pin_limit`` blocks."""
        if not block_ids:
            return PinOutcome(0)
        if self.pin_limit is not None and (held := self.pins.blocks_after(key, block_ids)) > self.pin_limit:
            self.pins.refused += 1
            return PinOutcome(0, f"conversation not pinned: its tenant's pins would hold {held} KV blocks, "
                                 f"more than the {self.pin_limit} (max_tenant_pin_fraction of the pool) one "
                                 f"tenant may pin; end or shorten other conversations' pins (pin_ttl_s)")
        self.pins.pin(key, block_ids, expires_at)
        return PinOutcome(len(block_ids))

    def expire_pins(self, now: float) -> int:
        """Release the pins whose TTL has passed (``now`` on the clock the pins were given)."""
        return self.pins.expire(now) if self.pins.pins else 0

    @property
    def has_pins(self) -> bool:
        return bool(self.pins.pins)

    # ------------------------------------------------------------------ inspection
    def stats(self) -> dict[str, Any]:
        """This part's ``KVStats`` fields."""
        pins, ledger = self.pins, self.ledger
        out: dict[str, Any] = dict(pins=len(pins), pinned_blocks=len(pins.refs()), pins_expired=pins.expired,
                                   pins_replaced=pins.replaced,
                                   pins_released_under_pressure=pins.released_under_pressure,
                                   pins_refused=pins.refused)
        if ledger is not None:
            out.update(tenants=ledger.snapshot(), tenant_quota_waits=dict(ledger.quota_waits))
        return out

    def refs(self) -> Counter[int]:
        """References the pins hold, per device block id (IntegrityError when the pins disagree
        with their own per-tenant counts). The ledger is checked with the pool."""
        return self.pins.refs()
