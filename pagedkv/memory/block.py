"""One physical KV block: ``block_size`` token slots of K and V for every layer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class Block:
    """Bookkeeping for one physical block (the tensors live in the runner).

    ``block_hash`` is set when the block becomes a cached prefix block (full and computed) and is
    cleared only when the block is evicted for reuse. ``prev``/``next`` link the block into the free
    queue while its ref count is 0 (both ``None`` otherwise). ``pinned`` blocks hold one extra
    reference so they are never evicted. A block's data, including the per-block scales of
    8-bit KV formats, lives in the runner's ``KVCache`` at index ``block_id``.
    """

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    pinned: bool = False
    # Logical clock values for eviction policies.
    last_used: int = 0
    cached_at: int = 0
    uses: int = 0  # how many sequences have referenced this block since it was cached
    kv_group: int = 0  # the KV group (a hybrid model's, memory/kv_groups.py) it was cached for
    tenant: str | None = None  # who holds it, with per-tenant quotas on (memory/tenant_ledger.py)
    prev: Block | None = None
    next: Block | None = None

    @property
    def is_free(self) -> bool:
        return self.ref_count == 0

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        pin = ", pinned" if self.pinned else ""
        return f"Block(id={self.block_id}, ref={self.ref_count}, hash={h}{pin})"
