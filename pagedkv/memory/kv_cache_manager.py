"""Per-sequence block tables over a device block pool and a host (swap) pool.

Who owns what: the caller (the engine's ``Sequence``) owns a sequence's token ids; the manager
reads that list, never copies or writes it, and owns the rest: the block table, the block hashes
and how many tokens' KV is written (``num_computed``). A sequence's tokens, and the manager's view::

    token ids:    [ t0 t1 ... | ... | ...                          ]
    block table:  [ b7        | b2  | b9        ]   logical block i -> physical table[i]
                   <--- cached ---><- computed -><- new (slots reserved, KV not written) ->
                   full blocks     num_computed   allocate_slots() covers num_computed + n

- ``allocate_prompt`` registers a sequence, reuses the cached prefix blocks its prompt hashes to
  (never the block holding the last prompt token: that token must be computed to get logits) and
  reserves slots for the first chunk.
- ``allocate_slots`` grows a table for the next chunk or decode token; a write into a block shared
  with a fork copies it first (copy-on-write) and returns the ``(src, dst)`` copy for the runner.
- ``mark_computed`` records written KV; only then do full blocks enter the prefix cache, so a
  block is never served to another request before its KV exists. The caller appends tokens to
  its own list before it marks them computed.
- ``swap_out`` / ``swap_in`` move whole sequences between the pools, returning block copy pairs.
- A hybrid model (``kv_group_windows`` with more than one group) gives each sequence one table
  per KV group; a sliding group's blocks that leave every query's window are released as the
  sequence advances (``memory/kv_groups.py``).

Every allocation is transactional: it raises ``OutOfBlocksError`` before changing anything.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from pagedkv.memory.admission import allocate_groups, allocate_single, blocks_to_admit
from pagedkv.memory.block import Block
from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.disk_lookup import DiskLookup
from pagedkv.memory.disk_prefix import DiskPrefixTier
from pagedkv.memory.errors import OutOfBlocksError
from pagedkv.memory.eviction import make_eviction_policy
from pagedkv.memory.host_tier import HostPrefixTier
from pagedkv.memory.inspection import check_integrity, kv_stats, pretty_print
from pagedkv.memory.kv_events import KVEventLog
from pagedkv.memory.kv_groups import RELEASED, disk_reads, release_out_of_window
from pagedkv.memory.miss_reasons import CacheDetails, CacheHistory
from pagedkv.memory.pins import ConversationPins, PinOutcome
from pagedkv.memory.prefix_caching import cache_full_blocks
from pagedkv.memory.prefix_hash import chain_hashes, root_hash
from pagedkv.memory.prefix_index import make_prefix_index
from pagedkv.memory.seq_state import SeqState, cdiv
from pagedkv.memory.stats import KVStats
from pagedkv.memory.tenancy import DEFAULT_TENANT, TenantLedger
from pagedkv.memory.tier_costs import TierCosts
from pagedkv.memory.tiers import DEVICE, HOST, TierCopies, move_sequences
from pagedkv.model_shape import check_block_size

CopyPair = tuple[int, int]  # (source block id, destination block id)


class KVCacheManager:
    """Block tables, prefix caching, forks and swapping for many sequences.

    Args:
        num_blocks: device blocks in the pool.
        block_size: token slots per block.
        num_host_blocks: blocks in the host (swap) pool; 0 disables swapping.
        enable_prefix_caching: reuse full computed blocks across sequences by hash.
        eviction_policy: "lru" (default), "fifo" or "lrc"; see ``pagedkv.memory.eviction``.
        watermark: fraction of device blocks a new prompt must leave free, so running
            sequences can keep growing without immediate preemption (avoids thrash).
        offload_to_host: keep cached blocks evicted from the device in the host pool and reload
            them on a hit (``memory/host_tier.py``); the scheduler takes the step's copies with
            ``take_tier_copies()`` and calls ``finish_step()`` once they are done.
        disk: the disk tier below the host tier (``memory/disk_prefix.py``; needs
            ``offload_to_host``): evicted device blocks are written through to it, and
            ``prefetch()`` reads a waiting prompt's blocks from it into the host tier.
        costs: the measured costs that decide reload against recompute (``memory/tier_costs.py``).
        tenant_quotas, default_tenant_quota: per-tenant limits on device blocks held (used plus
            cached), as fractions of the pool, by tenant name and for the others; either turns
            tenancy on (``memory/tenancy.py``): a sequence's tenant is ``allocate_prompt``'s.
        kv_events: record KV cache events (``memory/kv_events.py``) in ``events``: prefix blocks
            entering and leaving the device and host tiers' caches, for KV-aware routers.
        max_tenant_pin_fraction: the largest share of the device pool one tenant's conversation
            pins may hold (``pin_prefix`` refuses a pin past it); None: no limit but the pool.
        kv_group_windows: one entry per KV group of a hybrid model (``model_shape.kv_groups``):
            its attention window, or None for a group that keeps every block. Group 0 must be
            None (the prefix cache's anchor; the radix index holds group 0's blocks). The host
            and disk tiers keep every group's blocks under the group's own keys.
    """

    def __init__(self, num_blocks: int, block_size: int, *, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True, eviction_policy: str = "lru",
                 watermark: float = 0.0, lrc_alpha: float = 0.7, lrc_beta: float = 0.3,
                 prefix_index: str = "hash", offload_to_host: bool = False,
                 disk: DiskPrefixTier | None = None, costs: TierCosts | None = None,
                 kv_group_windows: tuple[int | None, ...] = (None,),
                 tenant_quotas: dict[str, float] | None = None, default_tenant_quota: float | None = None,
                 kv_events: bool = False, max_tenant_pin_fraction: float | None = None) -> None:
        check_block_size(block_size)
        if not kv_group_windows or kv_group_windows[0] is not None:
            raise ValueError(f"kv_group_windows must start with None (group 0 keeps every block), "
                             f"got {kv_group_windows!r}")
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if max_tenant_pin_fraction is not None and not 0.0 < max_tenant_pin_fraction <= 1.0:
            raise ValueError(f"max_tenant_pin_fraction must be in (0, 1] or None, got {max_tenant_pin_fraction!r}")
        kwargs = {"alpha": lrc_alpha, "beta": lrc_beta} if eviction_policy == "lrc" else {}
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = tuple(kv_group_windows)
        self.released_blocks = 0  # sliding-window blocks released as sequences advanced
        self.pool = BlockPool(num_blocks, name=DEVICE,
                              eviction_policy=make_eviction_policy(eviction_policy, **kwargs))
        self.host_pool = BlockPool(num_host_blocks, name=HOST)
        if tenant_quotas or default_tenant_quota is not None:
            self.pool.tenants = TenantLedger(num_blocks, tenant_quotas, default_tenant_quota)
        self.tiers = {DEVICE: self.pool, HOST: self.host_pool}
        self.watermark_blocks = int(watermark * num_blocks)
        # The pool's hash map always names cached blocks; the index finds a prompt's hits in it
        # (hash chain) or in a radix tree kept in step (check_integrity proves they agree).
        self.index = make_prefix_index(prefix_index, self.pool, block_size)
        # Why prompts miss (memory/miss_reasons.py): a bounded history of evictions and cached blocks.
        # (about 300 bytes an entry and map: twice the pools' blocks, at least 4096)
        self.history = CacheHistory(block_size, capacity=max(4096, 2 * (num_blocks + num_host_blocks)))
        self.first_misses: dict[tuple[str, str | None], int] = {}  # (reason, tenant) -> requests
        self.pins = ConversationPins(self.pool)  # conversations' prefixes held until a TTL (memory/pins.py)
        # the most device blocks one tenant's pins may hold (None: no limit but the pool)
        self.pin_limit = None if max_tenant_pin_fraction is None else max(1, int(max_tenant_pin_fraction * num_blocks))
        history, index_evict = self.history, self.pool.on_evict

        def on_device_evict(block: Block) -> None:
            if index_evict is not None:
                index_evict(block)
            history.on_evicted(block.block_hash, DEVICE, self.pool.evict_cause)  # type: ignore[arg-type]
        self.pool.on_evict = on_device_evict
        self.host_pool.on_evict = lambda block: history.on_evicted(block.block_hash, HOST, "lru")
        self.seqs: dict[Hashable, SeqState] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.cow_copies = 0
        self.rolled_back_blocks = 0  # blocks released by rollback() (rejected speculative tokens)
        # KV cache events (memory/kv_events.py): prefix blocks entering and leaving each tier
        self.events = KVEventLog(block_size) if kv_events else None
        self.pool.events = self.host_pool.events = self.events
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0
        # The host tier of the prefix cache (memory/host_tier.py), below the device pool.
        self.host_tier: HostPrefixTier | None = None
        self.costs = costs or TierCosts(block_size)
        self.disk_lookup: DiskLookup | None = None  # memory/disk_lookup.py
        self._offloading = True
        if offload_to_host and enable_prefix_caching and num_host_blocks > 0:
            self.host_tier = tier = HostPrefixTier(self.host_pool)
            lookup = None
            if disk is not None:
                self.disk_lookup = lookup = DiskLookup(disk, self.pool, tier, self.costs, block_size)
                self.history.fingerprint_discarded = disk.disk.discarded_keys
                if self.events is not None and self.num_groups == 1:  # (a hybrid's disk keys mix groups)
                    lookup.report_to(self.events)
            index_on_evict = self.pool.on_evict

            def on_evict(block: Block) -> None:
                if index_on_evict is not None:
                    index_on_evict(block)
                if self._offloading:
                    tier.offload(block)
                    if lookup is not None:
                        lookup.on_evict(block)
            self.pool.on_evict = on_evict
        elif disk is not None:
            raise ValueError("the disk tier needs the host tier: offload_to_host, prefix caching and host blocks")

    # ------------------------------------------------------------------ queries
    @property
    def disk(self) -> DiskPrefixTier | None:
        """The disk tier below the host tier, or None."""
        return self.disk_lookup.disk if self.disk_lookup is not None else None

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Device blocks an allocation can take now (free plus evictable cached)."""
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    @property
    def evictions(self) -> int:
        """Cached blocks whose prefix was forgotten to make room (or by evict_cached)."""
        return self.pool.evictions

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def blocks_for(self, num_tokens: int, chunk: int | None = None) -> int:
        """Blocks a sequence of ``num_tokens`` holds at most, every KV group's: a sliding group
        keeps its window plus the chunk being computed (``chunk``: the most tokens one step
        computes; None: the whole sequence at once)."""
        B = self.block_size
        total = 0
        for window in self.group_windows:
            if window is None:
                total += cdiv(num_tokens, B)
            else:
                total += min(cdiv(num_tokens, B), cdiv(window + (chunk or num_tokens), B) + 1)
        return total

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's block table (KV group 0's; live list: do not modify)."""
        return self.seqs[seq_id].block_table

    def group_tables(self, seq_id: Hashable) -> tuple[list[int], ...]:
        """The block tables of KV groups 1.. (a hybrid model's; RELEASED = -1 entries are out of
        the window), live lists: do not modify."""
        return tuple(self.seqs[seq_id].group_tables)

    def block_ids(self, seq_id: Hashable) -> list[int]:
        """Every block the sequence holds, in every KV group."""
        return self.seqs[seq_id].block_ids()

    def num_computed(self, seq_id: Hashable) -> int:
        """Tokens of the sequence whose KV is written; 0 for a sequence the manager does not hold
        (new, or preempted by recompute)."""
        seq = self.seqs.get(seq_id)
        return seq.num_computed if seq is not None else 0

    def is_swapped(self, seq_id: Hashable) -> bool:
        return not self.seqs[seq_id].on_device

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self.seqs

    # ------------------------------------------------------------------ allocation
    def allocate_prompt(self, seq_id: Hashable, token_ids: list[int], num_new_tokens: int | None = None,
                        *, salt: str | None = None, adapter_id: str | None = None, tenant: str | None = None) -> int:
        """Register a sequence, reuse its cached prefix and reserve slots for its first chunk.

        ``token_ids`` is the caller's own list of the sequence's tokens: the manager keeps reading
        it (tokens the caller appends later are seen) and never modifies it.

        Reserves slots for ``num_new_tokens`` tokens after the cached prefix (default and
        maximum: the rest of the prompt). Returns how many prompt tokens are already cached
        (a multiple of the block size, at most ``len(token_ids) - 1``). New prompts must leave
        the watermark free. Raises OutOfBlocksError (changing nothing) when blocks run out,
        TenantQuotaError when quotas are on and ``tenant`` (default: ``DEFAULT_TENANT``) already
        holds its share (``TenantLedger.allocation_error``), and ValueError for an empty prompt or
        a known ``seq_id``. Prefix hits come only from the same ``salt``, so keep a tenant's name
        in its salt when tenants must not share blocks.
        """
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        if not token_ids:
            raise ValueError("cannot allocate an empty prompt")
        seq = SeqState(seq_id, token_ids, root_hash(salt, adapter_id),
                       tenant=(tenant or DEFAULT_TENANT) if self.pool.tenants is not None else None)
        seq.adapter = adapter_id
        if self.enable_prefix_caching:
            self.history.on_root(seq.root, salt, adapter_id)  # (miss reasons: different_adapter)
        owner = tenant or DEFAULT_TENANT  # (whose pins give way last: memory/pins.py)
        if self.num_groups > 1:
            num_cached = allocate_groups(self, seq, num_new_tokens, owner)
        else:
            num_cached = allocate_single(self, seq, num_new_tokens, owner)
        self.forget(seq_id)
        if self.enable_prefix_caching:
            self.prefix_query_tokens += len(token_ids)
            self.prefix_hit_tokens += num_cached
        return num_cached

    def blocks_to_admit(self, token_ids: list[int], num_new_tokens: int | None = None, *,
                        salt: str | None = None, adapter_id: str | None = None) -> int:
        """Free-queue blocks ``allocate_prompt`` would take for this prompt now: fresh ones plus the
        cached-free device hits it revives (a hybrid model: every group's, at most). Host and disk
        hits are not counted (they need fresh blocks too). Changes nothing."""
        return blocks_to_admit(self, token_ids, num_new_tokens, root_hash(salt, adapter_id))

    def tenant_over_quota(self, tenant: str | None) -> bool:
        """Whether ``tenant`` holds more device blocks than its quota (False with quotas off)."""
        ledger = self.pool.tenants
        return ledger is not None and ledger.is_over(tenant or DEFAULT_TENANT)

    def quota_admits(self, tenant: str | None, need: int) -> bool:
        """Whether ``tenant``'s quota lets a new prompt take ``need`` fresh blocks now (True with
        quotas off); changes nothing."""
        ledger = self.pool.tenants
        return ledger is None or ledger.allocation_error(tenant or DEFAULT_TENANT, need, self.pool.num_free,
                                                         admit=True) is None

    def tenant_under_quota(self, tenant: str | None) -> bool:
        """Whether ``tenant`` holds fewer device blocks than its quota (False with quotas off or
        without a quota for it)."""
        ledger = self.pool.tenants
        if ledger is None:
            return False
        limit = ledger.limit(tenant or DEFAULT_TENANT)
        return limit is not None and ledger.held[tenant or DEFAULT_TENANT] < limit

    # ------------------------------------------------------------------ conversation pins
    def pin_prefix(self, seq_id: Hashable, key: Hashable, expires_at: float) -> PinOutcome:
        """Hold the sequence's cached prefix (its full computed blocks, every KV group) on the
        device until ``expires_at`` (``memory/pins.py``), replacing ``key``'s earlier pin; call
        before freeing the sequence. ``key`` is ``(tenant, conversation)``. Returns the blocks
        pinned (0: nothing cached to hold), or why the pin was refused: the tenant's pins would
        hold more than ``max_tenant_pin_fraction`` of the pool (its earlier pin then stays)."""
        seq = self.seqs[seq_id]
        if not self.enable_prefix_caching or not seq.on_device:
            return PinOutcome(0)
        blocks = self.pool.blocks
        ids = [table[i] for table in seq.tables() for i in range(min(seq.num_cached_blocks, len(table)))
               if table[i] != RELEASED and blocks[table[i]].block_hash is not None]
        if not ids:
            return PinOutcome(0)
        if self.pin_limit is not None and (held := self.pins.blocks_after(key, ids)) > self.pin_limit:
            self.pins.refused += 1
            return PinOutcome(0, f"conversation not pinned: its tenant's pins would hold {held} KV blocks, "
                                 f"more than the {self.pin_limit} (max_tenant_pin_fraction of the pool) one "
                                 f"tenant may pin; end or shorten other conversations' pins (pin_ttl_s)")
        self.pins.pin(key, ids, expires_at)
        return PinOutcome(len(ids))

    def expire_pins(self, now: float) -> int:
        """Release the pins whose TTL has passed (``now`` on the clock the pins were given)."""
        return self.pins.expire(now) if self.pins else 0

    def unstarve(self, need: int, admission: bool = False, tenant: str | None = None,
                 keep: frozenset[int] = frozenset()) -> None:
        """Pins never starve work: let go of the oldest (other tenants' before ``tenant``'s own)
        until ``need`` blocks are free, whether or not anything runs. For a new prompt
        (``admission``) only when that admits it: while even every pin would not free enough, they
        stay (running work frees blocks as it finishes, and the prompt is tried again). Pins
        holding a block of ``keep`` (the prompt's own prefix hits) stay."""
        if not self.pins or self.pool.num_free >= need:
            return
        if admission and self.pool.num_free + self.pins.releasable(keep) < need:
            return
        self.pins.release_for(need, tenant, keep)

    def cache_details(self, seq_id: Hashable, tenant: str | None = None) -> CacheDetails | None:
        """The prefix-cache outcome of the sequence's last ``allocate_prompt``: hit tokens per tier
        and why its first missed block missed (``memory/miss_reasons.py``), counted per reason and
        ``tenant`` in ``first_misses``; None with prefix caching off. Call once per request."""
        seq = self.seqs.get(seq_id)
        if seq is None or not self.enable_prefix_caching:
            return None
        B = self.block_size
        device, host, disk, max_hits, skipped = seq.hits
        hits = device + host
        reason, caller_reason, extra = self.history.explain(seq.root, seq.token_ids, seq.block_hashes, hits,
                                                            max_hits, in_host=skipped)
        details = CacheDetails(len(seq.token_ids), hits * B, {"device": device * B, "host": (host - disk) * B,
                                                             "disk": disk * B},
                               reason, caller_reason, None if reason == "none" else hits, **extra)
        key = (reason, tenant)
        self.first_misses[key] = self.first_misses.get(key, 0) + 1
        return details

    def check_quota(self, tenant: str | None, need: int, hits: list[Block]) -> None:
        """Raise TenantQuotaError, changing nothing, when a new prompt of ``tenant`` needing
        ``need`` fresh blocks (after touching ``hits``) would go over its quota."""
        ledger = self.pool.tenants
        if ledger is None or tenant is None:
            return
        revived = sum(1 for b in hits if b.ref_count == 0 and b.tenant == tenant)
        while True:
            error = ledger.allocation_error(tenant, need, self.pool.num_free, admit=True, revived=revived)
            if error is None:
                return
            # its own conversation pins fill its quota: they give way rather than block it for ever
            if not self.pins.release_oldest_of(tenant):
                ledger.quota_waits[tenant] += 1
                raise error

    def prefetch(self, seq_id: Hashable, token_ids: list[int], *, salt: str | None = None,
                 adapter_id: str | None = None, count: bool = True) -> bool:
        """Read ahead the blocks of a waiting prompt whose cached prefix goes on past the device
        and host tiers onto disk; True while some of them are still being read (admit the
        request later, when they are in the host tier). Blocks read since the last call are
        taken into the host tier here, so call it while planning a step. Cheap when there is no
        disk tier (returns False). ``count``: the sequence is next in line, and its first lookup
        counts in ``disk_query_tokens`` (a lookahead for a later one passes False)."""
        lookup = self.disk_lookup
        if lookup is None:
            return False
        max_hits = (len(token_ids) - 1) // self.block_size
        hashes = chain_hashes(root_hash(salt, adapter_id), token_ids, self.block_size, 0, max(max_hits, 0))
        if self.num_groups == 1:
            return lookup.prefetch(seq_id, hashes, count)
        lookup.take_reads()  # a hybrid model: every group's window before the hit (memory/kv_groups.py)
        disk = lookup.disk
        query, keys, tokens_of = disk_reads(self.pool, self.host_pool, disk.disk.__contains__, self.group_windows,
                                            hashes, max(max_hits, 0), self.block_size)
        return lookup.request(seq_id, keys, query, count, tokens_of)

    def prefix_in_flight(self, token_ids: list[int], *, salt: str | None = None,
                         adapter_id: str | None = None) -> bool:
        """Whether the first block of this prompt that no tier holds is being computed now by a
        sequence on the device (its prompt blocks not yet all computed): admitting the prompt
        after that would hit it instead of computing it a second time."""
        if not self.enable_prefix_caching:
            return False
        B = self.block_size
        max_hits = (len(token_ids) - 1) // B
        device, host = self.pool.cached, self.host_pool.cached
        parent = root_hash(salt, adapter_id)
        for i in range(max_hits):
            block_hash = chain_hashes(parent, token_ids, B, i, i + 1)[0]
            if block_hash in device or block_hash in host:
                parent = block_hash
                continue
            return any(block_hash in seq.block_hashes[seq.num_computed // B:]
                       for seq in self.seqs.values() if seq.on_device)
        return False

    def take_tier_copies(self) -> TierCopies:
        """This step's copies between the tiers, handed over once (see ``TierCopies``): the
        runner makes them before the forward pass."""
        to_disk = self.disk_lookup.take_to_disk() if self.disk_lookup is not None else []
        if self.host_tier is None:
            return TierCopies(to_disk=tuple(to_disk))
        out, into, loads = self.host_tier.take_copies()
        return TierCopies(tuple(out), tuple(into), tuple(to_disk), tuple(loads))

    def persistable_blocks(self) -> list[tuple[str, int, bytes]]:
        """``(tier, block id, key)`` of every cached block, host then device, not yet on disk
        (what a clean shutdown writes down); empty without a disk tier."""
        return self.disk_lookup.persistable_blocks() if self.disk_lookup is not None else []

    def finish_step(self, copied: bool = True) -> None:
        """The step's copies are over: release the host blocks they held (``copied=False``: the
        step's shared work failed, and what it offloaded is forgotten)."""
        if self.host_tier is not None:
            self.host_tier.finish_step(copied)
        if not copied and self.disk_lookup is not None:
            self.disk_lookup.step_failed()

    def clear_prefix_cache(self) -> None:
        """Forget every cached-free prefix block, on the device and in the host tier, without
        offloading (a benchmark's fresh start)."""
        self.evict_cached(offload=False)
        self.host_pool.evict_cached()

    def allocate_slots(self, seq_id: Hashable, num_new_tokens: int, *, quota: bool = True) -> list[CopyPair]:
        """Make room for ``num_new_tokens`` more computed tokens; returns copy-on-write pairs.

        Any block that will receive writes and is shared (ref count > 1) is replaced by a fresh
        block; when it already holds computed tokens the ``(src, dst)`` copy is returned and must
        be done before this step's KV is written. Raises OutOfBlocksError, changing nothing
        (TenantQuotaError: its tenant is over its quota; ``quota=False`` lets the sequence grow
        anyway, for a tenant's only running work).
        """
        seq = self.seqs[seq_id]
        if not seq.on_device:
            raise ValueError(f"sequence {seq_id!r} is swapped out; swap it in first")
        B = self.block_size
        start = seq.num_computed
        first = start // B  # never released: the next query sees it
        last = cdiv(start + num_new_tokens, B)  # exclusive
        blocks = self.pool.blocks
        plans = []  # per group table: (table, shared indices, missing blocks)
        for table in seq.tables():
            shared = [i for i in range(first, min(last, len(table))) if blocks[table[i]].ref_count > 1]
            plans.append((table, shared, max(last - len(table), 0)))
        total = sum(len(shared) + missing for _, shared, missing in plans)
        if total == 0:
            return []
        self.unstarve(total)
        if total > self.pool.num_free:
            raise OutOfBlocksError(total, self.pool.num_free)
        fresh = iter(self.pool.allocate(total, seq.tenant, quota=quota))
        copies: list[CopyPair] = []
        for table, shared, missing in plans:
            for i in shared:
                old, new = blocks[table[i]], next(fresh)
                if i * B < start:  # holds computed tokens to carry over
                    copies.append((old.block_id, new.block_id))
                table[i] = new.block_id
                self.pool.free((old,))
            table.extend(next(fresh).block_id for _ in range(missing))
        self.cow_copies += len(copies)
        return copies

    def mark_computed(self, seq_id: Hashable, num_tokens: int) -> None:
        """Record that the KV of ``num_tokens`` more tokens is written.

        Blocks that this makes full join the prefix cache (if enabled).
        """
        seq = self.seqs[seq_id]
        n = seq.num_computed + num_tokens
        if num_tokens < 0 or n > len(seq.token_ids) or n > len(seq.block_table) * self.block_size:
            raise ValueError(f"sequence {seq_id!r}: cannot mark {num_tokens} more tokens computed "
                             f"({seq.num_computed} computed, {len(seq.token_ids)} known, "
                             f"{len(seq.block_table) * self.block_size} slots)")
        seq.num_computed = n
        if self.enable_prefix_caching and n // self.block_size > seq.num_cached_blocks:
            cache_full_blocks(self, seq)
        if seq.group_tables:  # cached first: a released block stays cached-free
            self.released_blocks += release_out_of_window(self.pool, seq, self.group_windows, self.block_size)

    def rollback(self, seq_id: Hashable) -> int:
        """Release the blocks past the sequence's computed tokens, in every KV group: slots that
        ``allocate_slots`` gave for tokens whose KV turned out not to be wanted (speculative
        proposals the target rejected). Their slots in the last kept block are simply written
        over later; nothing past ``num_computed`` was ever hashed or cached. Returns the count."""
        seq = self.seqs[seq_id]
        if not seq.on_device:
            raise ValueError(f"sequence {seq_id!r} is swapped out; nothing to roll back on the device")
        keep = cdiv(seq.num_computed, self.block_size)
        blocks = self.pool.blocks
        extra = [table[i] for table in seq.tables() for i in range(len(table) - 1, keep - 1, -1)]
        for table in seq.tables():
            del table[keep:]
        self.pool.free(blocks[i] for i in extra)
        self.rolled_back_blocks += len(extra)
        return len(extra)

    # ------------------------------------------------------------------ forks and freeing
    def fork(self, parent_id: Hashable, child_id: Hashable, token_ids: list[int]) -> None:
        """Make ``child_id`` share every block of ``parent_id`` (ref counts, no copy).

        ``token_ids`` is the child's own token list (the caller's, read like ``allocate_prompt``'s):
        it must start with the parent's computed (and hashed) tokens; tokens after them may differ.
        """
        if child_id in self.seqs:
            raise ValueError(f"sequence {child_id!r} is already allocated")
        parent = self.seqs[parent_id]
        if not parent.on_device:
            raise ValueError(f"sequence {parent_id!r} is swapped out; swap it in before forking")
        n = max(parent.num_computed, len(parent.block_hashes) * self.block_size)
        if token_ids is parent.token_ids or token_ids[:n] != parent.token_ids[:n]:
            raise ValueError(f"fork {child_id!r}: the child needs its own token list starting with "
                             f"the first {n} tokens of {parent_id!r}")
        child = SeqState(child_id, token_ids, parent.root, parent.tenant, list(parent.block_table),
                         parent.num_computed, list(parent.block_hashes), parent.num_cached_blocks,
                         group_tables=[list(t) for t in parent.group_tables], released=list(parent.released),
                         content_hashes=list(parent.content_hashes), adapter=parent.adapter)
        blocks = self.pool.blocks
        for block_id in child.block_ids():
            self.pool.touch(blocks[block_id])
        self.seqs[child_id] = child

    def forget(self, seq_id: Hashable) -> None:
        """Drop what ``prefetch`` remembers of a sequence that left the queue without blocks."""
        if self.disk_lookup is not None:
            self.disk_lookup.forget(seq_id)

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks. Its last block is freed first, so under LRU a cached
        prefix chain is evicted from its tail and its shared head survives longest."""
        seq = self.seqs.pop(seq_id)
        pool = self.tiers[seq.tier]
        blocks = pool.blocks
        pool.free(blocks[i] for i in reversed(seq.block_ids()))

    def evict_cached(self, max_blocks: int | None = None, *, offload: bool = True) -> int:
        """Forget cached-free device prefix blocks (all, or up to ``max_blocks``); returns the
        count. With ``offload`` (and a host tier) they are copied down first; pass False when
        their contents are not to be trusted (after a failed forward pass)."""
        self._offloading = offload
        try:
            return self.pool.evict_cached(max_blocks)
        finally:
            self._offloading = True

    def pin(self, block_id: int) -> None:
        """Keep a used block (e.g. a system prompt's cached prefix) from ever being evicted."""
        block = self.pool.blocks[block_id]
        if block.pinned:
            return
        if block.ref_count == 0:
            raise ValueError(f"only a used block can be pinned; {block} is free")
        block.pinned = True
        self.pool.touch(block)

    def unpin(self, block_id: int) -> None:
        block = self.pool.blocks[block_id]
        if block.pinned:
            block.pinned = False
            self.pool.free((block,))

    # ------------------------------------------------------------------ swapping
    def swap_out(self, seq_ids: Iterable[Hashable]) -> list[CopyPair]:
        """Move sequences' blocks to the host pool; returns ``(device, host)`` copy pairs.

        Blocks shared among the given sequences are copied once and stay shared on the host.
        Raises OutOfBlocksError (pool "host"), changing nothing, when the host pool is full.
        """
        seqs = self._in_tier(seq_ids, DEVICE)
        mapping = move_sequences(seqs, self.pool, self.host_pool)
        self.swapped_out_blocks += len(mapping)
        return list(mapping.items())

    def swap_in(self, seq_ids: Iterable[Hashable]) -> list[CopyPair]:
        """Bring swapped sequences back to device blocks; returns ``(host, device)`` copy pairs.

        Raises OutOfBlocksError, changing nothing, when the device pool lacks the blocks.
        """
        seqs = self._in_tier(seq_ids, HOST)
        if self.host_tier is not None:
            # The host blocks are read by this step's swap-in copies, after its swap-outs: hold
            # them so that an offload later in the step cannot take one and write it first.
            host = self.host_pool
            sources = [host.blocks[i] for i in dict.fromkeys(i for seq in seqs for i in seq.block_ids())]
            self.unstarve(len(sources))
            if len(sources) > self.pool.num_free:
                raise OutOfBlocksError(len(sources), self.pool.num_free, self.pool.name)
            self.host_tier.hold(sources)
        mapping = move_sequences(seqs, self.host_pool, self.pool)
        self.swapped_in_blocks += len(mapping)
        for seq in seqs:
            seq.num_cached_blocks = 0
            if self.enable_prefix_caching:
                cache_full_blocks(self, seq)
        return list(mapping.items())

    def _in_tier(self, seq_ids: Iterable[Hashable], tier: str) -> list[SeqState]:
        seqs = [self.seqs[s] for s in dict.fromkeys(seq_ids)]
        for seq in seqs:
            if seq.tier != tier:
                where = "swapped out" if tier == DEVICE else "on the device"
                raise ValueError(f"sequence {seq.seq_id!r} is already {where}")
        return seqs

    # ------------------------------------------------------------------ inspection
    def stats(self) -> KVStats:
        """A snapshot of the pools and counters (see ``memory/inspection.py``)."""
        return kv_stats(self)

    def check_integrity(self) -> None:
        """Raise IntegrityError unless every structure agrees with every other (see
        ``memory/inspection.py``)."""
        check_integrity(self)

    def pretty_print(self) -> str:
        """A readable dump of every sequence's block table and the cached blocks."""
        return pretty_print(self)
