"""A sequence as the memory core sees it: a block table per KV group, its hash chain and computed
count, and the outcome of its admission.

The caller (the engine's ``Sequence``) owns the token ids; ``SeqState.token_ids`` is that list,
read and never written here. Everything else is the memory core's (``KVCacheManager``'s registry).
Every KV group has a table, all as long as the sequence and all treated alike::

    tables[0] (full attention):   [ b4  b9  b2  b7  b5 ]
    tables[1] (window 8):         [ -1  -1  b3  b8  b6 ]     released[1] == 2 (RELEASED: -1)
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

from pagedkv.memory.tiers.base import DEVICE

RELEASED = -1  # a table entry whose block is out of every query's window (memory/kv_groups.py)
# In a request's prefix-cache salt: its KV is kept at full precision in a mixed pool. In the salt, so
# that its blocks never match (or serve) the 8-bit blocks of the same tokens.
FULL_PRECISION_SALT = "\x00kv:full-precision\x00"


class AdmissionOutcome(NamedTuple):
    """What ``allocate_prompt`` found of a prompt's prefix, in blocks of group 0 (read by
    ``PrefixCache.details``: hit tokens per tier and why the first missed block missed)."""

    device: int = 0  # hit blocks the device pool held
    host: int = 0  # hit blocks reloaded from the host tier (``disk`` of them read from disk first)
    disk: int = 0
    max_hits: int = 0  # the most blocks that could hit (the last prompt token's block never does)
    reload_skipped: bool = False  # the host tier held more, but recomputing was measured cheaper
    remote: int = 0  # hit blocks reloaded from the host tier that were read from the remote tier first

    @property
    def hits(self) -> int:
        return self.device + self.host


NO_HITS = AdmissionOutcome()


@dataclass(slots=True)
class SeqState:
    seq_id: Hashable
    token_ids: list[int]  # the caller's list (read, never written here)
    root: bytes  # parent hash of block 0: carries the tenant salt and adapter id
    tenant: str | None = None  # who holds its blocks, for per-tenant quotas (memory/tenant_ledger.py)
    # one block table per KV group (RELEASED entries: out of a sliding group's window)
    tables: list[list[int]] = field(default_factory=lambda: [[]])
    num_computed: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks, chained
    num_cached_blocks: int = 0  # leading blocks already offered to the prefix cache
    tier: str = DEVICE  # the pool its tables point into (see memory/swap.py)
    released: list[int] = field(default_factory=lambda: [0])  # per group: leading RELEASED entries
    content_hashes: list[bytes] = field(default_factory=list)  # unsalted chain of a salted root (miss reasons)
    adapter: str | None = None  # the LoRA adapter its KV was computed by (in the root too; for KV events)
    hits: AdmissionOutcome = NO_HITS  # the last allocate_prompt's outcome (PrefixCache.details)
    full_precision: bool = False  # every block at full precision in a mixed pool (its salt says so)

    @property
    def on_device(self) -> bool:
        return self.tier == DEVICE

    def block_ids(self) -> list[int]:
        """Every block the sequence holds, all groups."""
        return [b for table in self.tables for b in table if b != RELEASED]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
