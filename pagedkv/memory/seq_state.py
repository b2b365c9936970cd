"""A sequence as the memory core sees it: its block tables, hash chain and computed count.

The caller (the engine's ``Sequence``) owns the token ids; ``SeqState.token_ids`` is that list,
read and never written here. Everything else is the memory core's (``KVCacheManager.seqs``).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from pagedkv.memory.kv_groups import RELEASED
from pagedkv.memory.tiers import DEVICE


@dataclass(slots=True)
class SeqState:
    seq_id: Hashable
    token_ids: list[int]  # the caller's list (read, never written here)
    root: bytes  # parent hash of block 0: carries the tenant salt and adapter id
    tenant: str | None = None  # who holds its blocks, for per-tenant quotas (memory/tenancy.py)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks, chained
    num_cached_blocks: int = 0  # leading blocks already offered to the prefix cache
    tier: str = DEVICE  # the pool its block table points into (see memory/tiers.py)
    # a hybrid model's KV groups 1..: their tables (RELEASED entries: out of the window) and how
    # many leading blocks each has released (memory/kv_groups.py)
    group_tables: list[list[int]] = field(default_factory=list)
    released: list[int] = field(default_factory=list)
    content_hashes: list[bytes] = field(default_factory=list)  # unsalted chain of a salted root (miss reasons)
    adapter: str | None = None  # the LoRA adapter its KV was computed by (in the root too; for KV events)
    # the last allocate_prompt's outcome, for cache_details(): hit blocks per tier, the most that
    # could hit, and whether the host tier held more than was reloaded
    hits: tuple[int, int, int, int, bool] = (0, 0, 0, 0, False)  # device, host, disk, max, skipped

    @property
    def on_device(self) -> bool:
        return self.tier == DEVICE

    def tables(self) -> list[list[int]]:
        """Every group's block table (group 0's is ``block_table``); live lists."""
        return [self.block_table, *self.group_tables]

    def block_ids(self) -> list[int]:
        """Every block the sequence holds, all groups."""
        return [b for table in self.tables() for b in table if b != RELEASED]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
