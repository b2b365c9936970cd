"""Per-tenant KV quotas: who holds which device blocks, and whose cached blocks go first.

A tenant *holds* a device block while the block is used by one of its sequences or sits in the
free queue still caching one of its prefixes (cached-free). Prefix-cache keys carry the tenant
(``prefix_hash.root_hash`` of its salt), so a block is never shared across tenants and each held
block has exactly one owner (``Block.tenant``); an empty free block has none.

A tenant's *limit* is its quota (a fraction of the device pool, ``quotas`` by name, else
``default_quota``; None: no limit). The pool (``BlockPool.allocate``) asks the ledger whom to
evict when it needs fresh blocks:

1. a tenant that would go over its limit gives up its own cached-free blocks first (oldest first);
2. then the cached-free blocks of tenants already over their limits go, the most over first;
3. then the pool's eviction policy chooses among everything else.

A tenant over its limit may not take another tenant's cached blocks at all (step 3):
``allocation_error`` says so, and the memory core raises ``TenantQuotaError`` before changing
anything; the scheduler then makes that tenant's new requests wait, or preempts that tenant's own
work, never another tenant's. Pure Python, O(1) per block except step 2 (O(tenants)).
"""

from __future__ import annotations

from collections import Counter

from pagedkv.memory.block import Block
from pagedkv.memory.errors import IntegrityError, OutOfBlocksError

DEFAULT_TENANT = "default"  # requests that name no tenant (and no cache_salt)


class TenantQuotaError(OutOfBlocksError):
    """An allocation would take a tenant past its KV quota at another tenant's expense. Nothing
    was changed; the tenant's own work must wait or give way."""

    def __init__(self, tenant: str, needed: int, held: int, limit: int) -> None:
        super().__init__(needed, max(limit - held, 0))
        self.tenant = tenant
        self.args = (f"tenant {tenant!r} is at its KV quota: holds {held} of {limit} blocks, "
                     f"needs {needed} more",)


def parse_quotas(items: list[str] | tuple[str, ...] | dict[str, float] | None) -> dict[str, float]:
    """``["team-a=0.5", "team-b=0.25"]`` (or a dict) -> ``{"team-a": 0.5, ...}``; ValueError naming
    the bad item (each fraction in (0, 1], each tenant once)."""
    if not items:
        return {}
    pairs = items.items() if isinstance(items, dict) else [_split(item) for item in items]
    out: dict[str, float] = {}
    for name, fraction in pairs:
        if name in out:
            raise ValueError(f"tenant_kv_quota: tenant {name!r} is given twice")
        out[name] = check_fraction(fraction, f"tenant_kv_quota {name!r}")
    return out


def _split(item: str) -> tuple[str, str]:
    name, sep, value = str(item).rpartition("=")
    if not sep or not name:
        raise ValueError(f"tenant_kv_quota: expected NAME=FRACTION such as team-a=0.5, got {item!r}")
    return name, value


def check_fraction(value: object, what: str) -> float:
    try:
        fraction = float(value)  # type: ignore[arg-type]  # any value: a bad one raises below
    except (TypeError, ValueError):
        raise ValueError(f"{what}: expected a fraction of the KV pool in (0, 1], got {value!r}") from None
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"{what}: expected a fraction of the KV pool in (0, 1], got {value!r}")
    return fraction


class TenantLedger:
    """Blocks held per tenant, each tenant's cached-free blocks in eviction order, and limits."""

    def __init__(self, num_blocks: int, quotas: dict[str, float] | None = None,
                 default_quota: float | None = None) -> None:
        self.num_blocks = num_blocks
        self.quotas = dict(quotas or {})
        self.default_quota = default_quota
        self.held: Counter[str] = Counter()
        self.cached_free: dict[str, dict[Block, None]] = {}  # insertion order = eviction order
        self.num_cached_free = 0
        self.quota_waits: Counter[str] = Counter()  # allocations refused by a quota, per tenant

    def limit(self, tenant: str) -> int | None:
        fraction = self.quotas.get(tenant, self.default_quota)
        return None if fraction is None else max(1, int(fraction * self.num_blocks))

    def is_over(self, tenant: str) -> bool:
        limit = self.limit(tenant)
        return limit is not None and self.held[tenant] > limit

    def own_cached(self, tenant: str) -> int:
        return len(self.cached_free.get(tenant, ()))

    # ----------------------------------------------------------- the pool's choices
    def allocation_error(self, tenant: str, n: int, num_free: int, *, admit: bool = False,
                         revived: int = 0) -> TenantQuotaError | None:
        """The quota error for ``tenant`` taking ``n`` fresh blocks now, or None when it may.

        Over its limit, a tenant may take only empty free blocks, its own cached ones and those of
        tenants over their limits. ``admit`` (a new prompt) is stricter: it must fit within the
        limit once its own cached blocks are given up, unless the tenant uses no block at all (so
        a prompt larger than the quota still runs, alone). ``revived``: of its cached blocks, how
        many a prefix hit is about to take (they cannot be given up)."""
        limit = self.limit(tenant)
        held = self.held[tenant]
        over = 0 if limit is None else held + n - limit
        if over <= 0:
            return None
        own = self.own_cached(tenant) - revived
        if own >= over:  # giving up its own cached blocks keeps it within the limit
            return None
        if admit:
            in_use = held - self.own_cached(tenant)
            return TenantQuotaError(tenant, n, held, limit) if in_use > 0 else None  # type: ignore[arg-type]  # over > 0: a limit
        # running work may still grow past the limit into empty blocks and over-limit tenants' cache
        empties = num_free - self.num_cached_free
        spare = sum(len(self.cached_free.get(t, ())) for t in self._over_limit() if t != tenant)
        if n > empties + own + spare:
            return TenantQuotaError(tenant, n, held, limit)  # type: ignore[arg-type]  # over > 0: a limit
        return None

    def victims(self, tenant: str, n: int, num_free: int) -> list[Block]:
        """Cached-free blocks to evict before ``tenant`` takes ``n`` fresh blocks: its own beyond its
        limit, then those of the tenants most over theirs, while the empty free blocks do not
        cover ``n``. The pool's policy picks the rest."""
        chosen: dict[Block, None] = {}
        limit = self.limit(tenant)
        over = 0 if limit is None else self.held[tenant] + n - limit
        if over > 0:
            chosen.update(dict.fromkeys(_first(self.cached_free.get(tenant, {}), over)))
        deficit = n - (num_free - self.num_cached_free) - len(chosen)
        if deficit <= 0:  # the empty free blocks cover it (the usual case): no tenant scan
            return list(chosen)
        for t in sorted(self._over_limit(), key=self._overshoot, reverse=True):
            for block in self.cached_free.get(t, {}):
                if deficit <= 0:
                    return list(chosen)
                if block not in chosen:
                    chosen[block] = None
                    deficit -= 1
        return list(chosen)

    def _over_limit(self) -> list[str]:
        return [t for t in self.held if (lim := self.limit(t)) is not None and self.held[t] > lim]

    def _overshoot(self, tenant: str) -> float:
        return self.held[tenant] / (self.limit(tenant) or 1)

    # ----------------------------------------------------------- hooks the pool calls
    def took(self, block: Block, tenant: str) -> None:
        """``block`` (ref count 1, no longer free) now belongs to ``tenant``."""
        block.tenant = tenant
        self.held[tenant] += 1

    def revived(self, block: Block) -> None:
        """A cached-free block was taken again (a prefix hit): still held, no longer free."""
        owned = self.cached_free.get(block.tenant)  # type: ignore[arg-type]  # None finds nothing
        if owned is not None and owned.pop(block, 0) is None:
            self.num_cached_free -= 1

    def freed(self, block: Block) -> None:
        """``block`` reached ref count 0: a cached one stays held (cached-free), an empty one is
        no one's."""
        tenant = block.tenant
        if tenant is None:
            return
        if block.block_hash is not None:
            self.cached_free.setdefault(tenant, {})[block] = None
            self.num_cached_free += 1
        else:
            self._release(block)

    def on_evict(self, block: Block, cause: str) -> None:
        """The pool's eviction listener: ``block`` loses its prefix (``evicted``)."""
        self.evicted(block)

    def evicted(self, block: Block) -> None:
        """A cached-free block lost its prefix (evicted for reuse or forgotten)."""
        tenant = block.tenant
        if tenant is None:
            return
        if self.cached_free.get(tenant, {}).pop(block, 0) is None:
            self.num_cached_free -= 1
        self._release(block)

    def _release(self, block: Block) -> None:
        tenant = block.tenant
        assert tenant is not None
        self.held[tenant] -= 1
        if not self.held[tenant]:
            del self.held[tenant]
            self.cached_free.pop(tenant, None)
        block.tenant = None

    # ----------------------------------------------------------- inspection
    def snapshot(self) -> dict[str, tuple[int, int, int | None]]:
        """``{tenant: (held, cached_free, limit)}`` for tenants holding blocks or with a quota."""
        names = set(self.held) | set(self.quotas)
        return {t: (self.held[t], self.own_cached(t), self.limit(t)) for t in sorted(names)}

    def check(self, blocks: list[Block]) -> None:
        """Recount from the blocks; raise IntegrityError on any disagreement."""
        held: Counter[str] = Counter()
        cached: dict[str, set[Block]] = {}
        for block in blocks:
            holds = block.ref_count > 0 or block.block_hash is not None
            if holds != (block.tenant is not None):
                raise IntegrityError(f"device {block} (tenant {block.tenant!r}) is "
                                     f"{'held' if holds else 'empty'} but has{'' if block.tenant else ' no'} owner")
            if block.tenant is not None:
                held[block.tenant] += 1
                if block.ref_count == 0:
                    cached.setdefault(block.tenant, set()).add(block)
        if held != +self.held:
            raise IntegrityError(f"tenant ledger holds {dict(self.held)}, the blocks say {dict(held)}")
        listed = {t: set(d) for t, d in self.cached_free.items() if d}
        if listed != cached or self.num_cached_free != sum(len(s) for s in cached.values()):
            raise IntegrityError("tenant ledger's cached-free blocks disagree with the free queue")


def _first(blocks: dict[Block, None], n: int):
    for i, block in enumerate(blocks):
        if i >= n:
            return
        yield block
