"""The KV cache manager: the façade of the memory core, the sequence registry and its verbs.

Who owns what: the caller (the engine's ``Sequence``) owns a sequence's token ids; the manager
reads that list, never copies or writes it. The memory core's state has one owner each, built
here and given its collaborators when built:

    KVCacheManager   the sequence registry (``seqs``: SeqState, a block table per KV group, the
                     hash chain, num_computed) and the per-sequence verbs below; counters of them
    BlockPool        blocks, the free queue, the hash map of cached blocks; built with its
                     eviction listeners (radix index, miss history, lower tiers, ledger, events)
    PrefixCache      hashing, caching full blocks, the prefix index, the one chain walk, stored
                     events, miss history and details, hit counters (``prefix_cache.py``)
    KVGroup          what a kind of group decides: hit span, most blocks, window (``kv_groups.py``)
    Tenancy          the quota ledger and conversation pins; the scheduler's questions (``tenants.py``)
    TierStack        the lower tiers of the prefix cache: host, disk (``tiers/``)

A sequence's tokens, and the manager's view (group 0's table; every group's is as long)::

    token ids:    [ t0 t1 ... | ... | ...                          ]
    block table:  [ b7        | b2  | b9        ]   logical block i -> physical table[i]
                   <--- cached ---><- computed -><- new (slots reserved, KV not written) ->
                   full blocks     num_computed   allocate_slots() covers num_computed + n

- ``allocate_prompt`` registers a sequence: the prefix cache finds the longest prefix every group
  can serve (device, then host tier; never the block holding the last prompt token, whose logits
  must be computed), tenancy lets pins give way and checks the quota, the pool touches the hits
  and allocates the rest, host hits are reloaded; one path for one or N groups.
- ``allocate_slots`` grows the tables for the next chunk or decode token; a write into a block
  shared with a fork copies it first (copy-on-write) and returns the ``(src, dst)`` copy.
- ``mark_computed`` records written KV; only then do full blocks enter the prefix cache, so a
  block is never served to another request before its KV exists; a sliding group releases the
  blocks that left every query's window.
- ``rollback``, ``fork``, ``free``; ``swap_out`` / ``swap_in`` move whole sequences between the
  device and host pools (``swap.py``), returning block copy pairs.
- ``stats()`` and ``check_integrity()`` gather each part's own figures and checks.

Every allocation is transactional: it raises ``OutOfBlocksError`` before changing anything.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from pagedkv.kv_events import MEDIUMS, KVEventLog
from pagedkv.memory.block import Block
from pagedkv.memory.block_pool import BlockPool, EvictionEvents, EvictionListener
from pagedkv.memory.errors import IntegrityError, OutOfBlocksError
from pagedkv.memory.eviction import make_eviction_policy
from pagedkv.memory.kv_cache_config import KVCacheConfig
from pagedkv.memory.kv_groups import make_kv_groups, release_out_of_window
from pagedkv.memory.miss_reasons import CacheDetails, CacheHistory, EvictionHistory
from pagedkv.memory.pins import PinOutcome
from pagedkv.memory.prefix_cache import PrefixCache
from pagedkv.memory.prefix_hash import root_hash
from pagedkv.memory.prefix_index import make_prefix_index
from pagedkv.memory.seq_state import FULL_PRECISION_SALT, RELEASED, AdmissionOutcome, SeqState, cdiv
from pagedkv.memory.stats import KVStats
from pagedkv.memory.swap import move_sequences
from pagedkv.memory.tenancy import Tenancy
from pagedkv.memory.tenant_ledger import DEFAULT_TENANT, TenantLedger
from pagedkv.memory.tiers.base import DEVICE, HOST, LowerTier, TierCopies
from pagedkv.memory.tiers.costs import TierCosts
from pagedkv.memory.tiers.disk import DiskTier
from pagedkv.memory.tiers.disk_store import DiskStore
from pagedkv.memory.tiers.host import HostTier
from pagedkv.memory.tiers.stack import TierStack
from pagedkv.model_shape import check_block_size

CopyPair = tuple[int, int]  # (source block id, destination block id)


class KVCacheManager:
    """Block tables, prefix caching, forks and swapping for many sequences.

    Args:
        num_blocks: device blocks in the pool.
        block_size: token slots per block.
        config: the options (``memory/kv_cache_config.py``); ``options``: its fields by name,
            overriding ``config``'s (``KVCacheManager(64, 16, num_host_blocks=32)``).
        disk: the opened block store of the disk tier below the host tier (``memory/tiers/disk.py``;
            needs ``offload_to_host``): evicted device blocks are written through to it, and
            ``prefetch()`` reads a waiting prompt's blocks from it into the host tier.
        costs: the measured costs that decide reload against recompute (``memory/tiers/costs.py``).
        more_tiers: further lower tiers, below the host and disk tiers (a store shared by
            replicas): each is made from the host tier it loads into (None without one), so a
            new tier is a new class (``memory/tiers/base.py``, ``LowerTier``) and no edit here.
    """

    def __init__(self, num_blocks: int, block_size: int, config: KVCacheConfig | None = None, *,
                 disk: DiskStore | None = None, costs: TierCosts | None = None,
                 more_tiers: Sequence[Callable[[HostTier | None], LowerTier]] = (), **options: Any) -> None:
        config = replace(config or KVCacheConfig(), **options) if options else config or KVCacheConfig()
        check_block_size(block_size)
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        self.config = config
        num_host_blocks, enable_prefix_caching = config.num_host_blocks, config.enable_prefix_caching
        eviction_policy, kv_group_windows = config.eviction_policy, config.kv_group_windows
        kwargs = {"alpha": config.lrc_alpha, "beta": config.lrc_beta} if eviction_policy == "lrc" else {}
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = make_kv_groups(kv_group_windows)
        self._sliding = any(group.window is not None for group in self.groups)  # blocks to release
        self.watermark_blocks = int(config.watermark * num_blocks)
        # KV cache events (pagedkv/kv_events.py): prefix blocks entering and leaving each tier
        self.events = KVEventLog(block_size) if config.kv_events else None
        # Why prompts miss (memory/miss_reasons.py): a bounded history of evictions and cached blocks.
        # (about 300 bytes an entry and map: twice the pools' blocks, at least 4096)
        history = CacheHistory(block_size, capacity=max(4096, 2 * (num_blocks + num_host_blocks)))
        host_listeners: list[EvictionListener] = [EvictionHistory(history, HOST)]
        if self.events is not None:
            host_listeners.append(EvictionEvents(self.events, MEDIUMS[HOST]))
        self.host_pool = BlockPool(num_host_blocks, name=HOST, listeners=host_listeners)
        # The lower tiers of the prefix cache (memory/tiers/), below the device pool: the host tier,
        # then the disk tier. self.lower_tiers hears the device pool's evictions (a listener).
        self.costs = costs or TierCosts(block_size)
        host_tier = disk_tier = None
        if config.offload_to_host and enable_prefix_caching and num_host_blocks > 0:
            host_tier = HostTier(self.host_pool, self.events)
            if disk is not None:
                disk_tier = DiskTier(disk, host=host_tier, costs=self.costs, block_size=block_size,
                                     max_queued_writes=config.disk_write_queue,  # (a hybrid's keys mix groups:)
                                     events=self.events if self.num_groups == 1 else None)
                history.fingerprint_discarded = disk.discarded_keys
        elif disk is not None:
            raise ValueError("the disk tier needs the host tier: offload_to_host, prefix caching and host blocks")
        self.lower_tiers = TierStack(host_tier, disk_tier, tuple(make(host_tier) for make in more_tiers))
        # The device pool, built with everything that hears of its evictions, in order. The pool's
        # hash map always names cached blocks; the index finds a prompt's hits in it (hash chain)
        # or in a radix tree kept in step (check_integrity proves they agree).
        index = make_prefix_index(config.prefix_index, block_size)
        ledger = (TenantLedger(num_blocks, config.tenant_quotas, config.default_tenant_quota)
                  if config.quotas_on else None)
        listeners: list[EvictionListener] = [index] if index.listens else []
        listeners.append(EvictionHistory(history, DEVICE))
        if self.lower_tiers:
            listeners.append(self.lower_tiers)
        if ledger is not None:
            listeners.append(ledger)
        if self.events is not None:
            listeners.append(EvictionEvents(self.events, MEDIUMS[DEVICE]))
        self.pool = BlockPool(num_blocks, name=DEVICE, eviction_policy=make_eviction_policy(eviction_policy, **kwargs),
                              tenants=ledger, listeners=listeners, num_full_blocks=config.num_full_blocks)
        self.sink_blocks = config.kv_sink_blocks if config.num_full_blocks else 0
        self.pools = {DEVICE: self.pool, HOST: self.host_pool}  # where a sequence's tables point (SeqState.tier)
        self.prefix = PrefixCache(self.pool, self.groups, block_size, index, history, self.events)
        # quotas and conversation pins (memory/tenancy.py)
        fraction = config.max_tenant_pin_fraction
        pin_limit = None if fraction is None else max(1, int(fraction * num_blocks))
        self.tenancy = Tenancy(self.pool, ledger, pin_limit)
        self.seqs: dict[Hashable, SeqState] = {}  # the sequence registry
        self.cow_copies = 0
        self.released_blocks = 0  # sliding-window blocks released as sequences advanced
        self.rolled_back_blocks = 0  # blocks released by rollback() (rejected speculative tokens)
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0

    # ------------------------------------------------------------------ queries
    @property
    def host_tier(self) -> HostTier | None:
        """The host tier of the prefix cache, right below the device pool, or None."""
        return self.lower_tiers.host

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier below the host tier, or None."""
        return self.lower_tiers.disk

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
        return len(self.groups)

    def blocks_for(self, num_tokens: int, chunk: int | None = None) -> int:
        """Blocks a sequence of ``num_tokens`` holds at most, every KV group's: a sliding group
        keeps its window plus the chunk being computed (``chunk``: the most tokens one step
        computes; None: the whole sequence at once)."""
        B = self.block_size
        return sum(group.max_blocks(num_tokens, chunk, B) for group in self.groups)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """KV group 0's block table (the runner's ``SeqChunk.block_table``; every group's is in
        ``seqs[seq_id].tables``); live list: do not modify."""
        return self.seqs[seq_id].tables[0]

    def group_tables(self, seq_id: Hashable) -> tuple[list[int], ...]:
        """The block tables of KV groups 1.. (the runner's ``SeqChunk.group_tables``); live lists."""
        return tuple(self.seqs[seq_id].tables[1:])

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
        B, G, prefix = self.block_size, len(self.groups), self.prefix
        seq = SeqState(seq_id, token_ids, root_hash(salt, adapter_id), self.tenancy.holder(tenant),
                       [[] for _ in range(G)], released=[0] * G, adapter=adapter_id,
                       full_precision=bool(self.pool.num_full_blocks and salt and FULL_PRECISION_SALT in salt))
        hit, reload, max_hits = prefix.no_hit, None, 0  # reload: the reload-or-recompute decision, when made
        if self.enable_prefix_caching:
            prefix.admitted(seq, salt, adapter_id)
            prefix.hash_full_blocks(seq, len(token_ids) // B)
            max_hits = prefix.max_hits(len(token_ids), B)
            host = self.host_tier
            hit = prefix.longest_hit(seq.root, token_ids, seq.block_hashes, max_hits,
                                     host.pool if host is not None else None)
            if hit.num_host:  # (per block: a hybrid block holds fewer layers, so a cheaper copy)
                reload = self.costs.reload_cheaper("host", hit.num_host, record=False)
                if not reload:  # recomputing is cheaper here: what only the host holds is a miss
                    hit = prefix.longest_hit(seq.root, token_ids, seq.block_hashes, max_hits, None)
        k = hit.k
        num_cached = k * B
        remaining = len(token_ids) - num_cached
        num_new = remaining if num_new_tokens is None else max(1, min(num_new_tokens, remaining))
        per_group = cdiv(num_cached + num_new, B) - k  # new blocks in each group
        if hit.num_host:
            on_device = [b for blocks, flags in zip(hit.blocks, hit.on_host) for b, h in zip(blocks, flags) if not h]
            on_host = [b for blocks, flags in zip(hit.blocks, hit.on_host) for b, h in zip(blocks, flags) if h]
        else:
            on_device, on_host = hit.blocks[0] if G == 1 else [b for blocks in hit.blocks for b in blocks], []
        formats = None
        if self.pool.num_full_blocks:  # a mixed pool: the format of each fresh block, in the order taken below
            formats = []
            for blocks, flags in zip(hit.blocks, hit.on_host):
                released = k - len(blocks)
                formats += [self._wants_full(seq, released + j) for j, h in enumerate(flags) if h and on_host]
                formats += [self._wants_full(seq, k + j) for j in range(per_group)]
        fresh = iter(self._take_blocks(seq, per_group * G + len(on_host), on_device, on_host,
                                       tenant or DEFAULT_TENANT, formats))
        for g, (blocks, flags) in enumerate(zip(hit.blocks, hit.on_host)):
            table = seq.tables[g]
            seq.released[g] = released = k - len(blocks)  # before the window of the first uncached token
            table += [RELEASED] * released
            if not on_host:
                table += [b.block_id for b in blocks]
                table += [next(fresh).block_id for _ in range(per_group)]
                continue
            reloads: list[tuple[Block, Block]] = []
            for block, from_host in zip(blocks, flags):
                if from_host:
                    reloads.append((block, next(fresh)))
                    table.append(reloads[-1][1].block_id)
                else:
                    table.append(block.block_id)
            table += [next(fresh).block_id for _ in range(per_group)]
            if reloads:  # (hit tokens counted once, by group 0)
                self.host_tier.reload([s for s, _ in reloads], [d for _, d in reloads],  # type: ignore[union-attr]  # host hits: a host tier
                                      B if g == 0 else 0)
        seq.num_computed = num_cached
        host0 = [b for b, h in zip(hit.blocks[0], hit.on_host[0]) if h] if on_host else []
        from_disk = from_remote = 0  # of the host hits, those read from the disk or remote tier first
        if host0 and (host_tier := self.host_tier) is not None:
            from_disk = self._loaded(host0, host_tier.from_disk)
            from_remote = self._loaded(host0, host_tier.from_remote)
        seq.hits = AdmissionOutcome(k - len(host0), len(host0), from_disk, max_hits, reload is False, from_remote)
        seq.num_cached_blocks = hit.first_reload() if on_host else k  # reloaded blocks are cached again, below
        self.seqs[seq_id] = seq
        if on_host:
            prefix.cache_full_blocks(seq)
        if reload is not None:
            self.costs.record("host", reload=reload)
        self.forget(seq_id)
        if self.enable_prefix_caching:
            prefix.count(len(token_ids), num_cached)
        return num_cached

    def _wants_full(self, seq: SeqState, index: int) -> bool:
        """Whether a mixed pool's block ``index`` of ``seq`` is asked at full precision: every
        block of a full-precision request, the first ``kv_sink_blocks`` of the others."""
        return seq.full_precision or index < self.sink_blocks

    def _formats(self, seq: SeqState, indices: Iterable[int]) -> list[bool] | None:
        """``allocate``'s ``full`` for new blocks at these logical indices (None: one format)."""
        return [self._wants_full(seq, i) for i in indices] if self.pool.num_full_blocks else None

    def _take_blocks(self, seq: SeqState, need: int, device_hits: list[Block], host_hits: list[Block],
                     owner: str, formats: list[bool] | None = None) -> list[Block]:
        """Touch the device hits, hold the host hits and allocate ``need`` fresh blocks; or raise,
        changing nothing: TenantQuotaError first (a tenant at its quota waits, not the line), then
        OutOfBlocksError. Pins give way first (other tenants' before ``owner``'s; never those
        holding the prompt's own hits), when that admits it; the watermark stays free."""
        pool = self.pool
        revived = sum(1 for b in device_hits if b.ref_count == 0)
        self.tenancy.make_room(need + revived + self.watermark_blocks, admission=True, tenant=owner,
                               keep=device_hits)
        self.tenancy.check_admission(seq.tenant, need, device_hits)
        available = pool.num_free - revived - self.watermark_blocks
        if need > available:
            raise OutOfBlocksError(need, max(available, 0))
        if pool.num_full_blocks and seq.full_precision:  # its blocks at full precision, or it waits
            revived_full = sum(1 for b in device_hits if b.ref_count == 0 and pool.is_full_precision(b))
            full_free = pool.num_free_full - revived_full
            if need > full_free:
                raise OutOfBlocksError(need, max(full_free, 0), f"{pool.name} full-precision")
        for block in device_hits:
            pool.touch(block)
        if host_hits:  # held until the reload is done, before any allocation could evict them
            self.host_tier.hold(host_hits)  # type: ignore[union-attr]  # host hits: a host tier
        if not pool.num_full_blocks:
            return pool.allocate(need, seq.tenant, quota=False)  # (check_admission decided)
        return pool.allocate(need, seq.tenant, quota=False, full=formats, strict_full=seq.full_precision)

    @staticmethod
    def _loaded(host_hits: list[Block], loaded: set[bytes]) -> int:
        """Of these host blocks about to be reloaded, how many came from a tier below (``loaded``:
        the host tier's ``from_disk`` or ``from_remote``)."""
        if not loaded:
            return 0
        keys = [b.block_hash for b in host_hits if b.block_hash in loaded]
        loaded.difference_update(keys)
        return len(keys)

    def blocks_to_admit(self, token_ids: list[int], num_new_tokens: int | None = None, *,
                        salt: str | None = None, adapter_id: str | None = None) -> int:
        """Free-queue blocks ``allocate_prompt`` would take for this prompt now: fresh ones plus the
        cached-free device hits it revives (a hybrid model: every group's, at most). Host and disk
        hits are not counted (they need fresh blocks too). Changes nothing."""
        B = self.block_size
        hits = revived = 0
        if self.enable_prefix_caching:
            hits, revived = self.prefix.device_hits(root_hash(salt, adapter_id), token_ids)
        remaining = len(token_ids) - hits * B
        num_new = remaining if num_new_tokens is None else max(1, min(num_new_tokens, remaining))
        return (cdiv(hits * B + num_new, B) - hits) * len(self.groups) + revived

    # ------------------------------------------------------------------ tenancy (memory/tenancy.py)
    @property
    def quotas_on(self) -> bool:
        """Whether per-tenant quotas are on."""
        return self.tenancy.quotas_on

    def tenant_over_quota(self, tenant: str | None) -> bool:
        """Whether ``tenant`` holds more device blocks than its quota (False with quotas off)."""
        return self.tenancy.over_quota(tenant)

    def quota_admits(self, tenant: str | None, need: int) -> bool:
        """Whether ``tenant``'s quota lets a new prompt take ``need`` fresh blocks now (True with
        quotas off); changes nothing."""
        return self.tenancy.quota_admits(tenant, need)

    def tenant_under_quota(self, tenant: str | None) -> bool:
        """Whether ``tenant`` holds fewer device blocks than its quota (False with quotas off or
        without a quota for it)."""
        return self.tenancy.under_quota(tenant)

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
        ids = [table[i] for table in seq.tables for i in range(min(seq.num_cached_blocks, len(table)))
               if table[i] != RELEASED and blocks[table[i]].block_hash is not None]
        return self.tenancy.pin(key, ids, expires_at)

    def expire_pins(self, now: float) -> int:
        """Release the pins whose TTL has passed (``now`` on the clock the pins were given)."""
        return self.tenancy.expire_pins(now)

    def cache_details(self, seq_id: Hashable, tenant: str | None = None) -> CacheDetails | None:
        """The prefix-cache outcome of the sequence's last ``allocate_prompt``: hit tokens per tier
        and why its first missed block missed (``memory/miss_reasons.py``), counted per reason and
        ``tenant`` in ``first_misses``; None with prefix caching off. Call once per request."""
        seq = self.seqs.get(seq_id)
        if seq is None or not self.enable_prefix_caching:
            return None
        return self.prefix.details(seq, tenant)

    def prefetch(self, seq_id: Hashable, token_ids: list[int], *, salt: str | None = None,
                 adapter_id: str | None = None, count: bool = True) -> bool:
        """Read ahead the blocks of a waiting prompt whose cached prefix goes on past the device
        and host tiers onto disk; True while some of them are still being read (admit the
        request later, when they are in the host tier). Blocks read since the last call are
        taken into the host tier here, so call it while planning a step. Cheap when there is no
        disk tier (returns False). ``count``: the sequence is next in line, and its first lookup
        counts in ``disk_query_tokens`` (a lookahead for a later one passes False)."""
        tiers = self.lower_tiers
        if not tiers.below_host:
            return False
        root = root_hash(salt, adapter_id)
        max_hits = max(self.prefix.max_hits(len(token_ids), self.block_size), 0)
        hashes = self.prefix.hashes(root, token_ids, max_hits)
        if self.num_groups == 1:
            return tiers.prefetch(seq_id, hashes, count, self.pool, self.block_size)
        tiers.complete_loads(self.pool)  # a hybrid model: every group's window before the hit
        waiting = False
        for tier in tiers.below_host:
            query, keys, tokens_of = self.prefix.reads_below(root, token_ids, hashes, max_hits, self.host_pool,
                                                             tier.holds)
            waiting |= tier.prepare_load(seq_id, keys, query, count, tokens_of)
        return waiting

    @property
    def loads_in_background(self) -> bool:
        """Whether a tier below the host loads blocks in the background (a disk tier): waiting
        prompts are then worth a ``prefetch`` and an idle step a ``wait_for_loads``."""
        return bool(self.lower_tiers.below_host)

    def wait_for_loads(self, timeout: float) -> bool:
        """Block until a background load finishes (or none is in flight), at most ``timeout``
        seconds: an engine with nothing to run but prompts waiting for loads sleeps here instead
        of spinning. True when one is ready (the next ``prefetch`` takes it); False at once
        without such a tier."""
        return self.lower_tiers.wait_for_loads(timeout)

    def prefix_in_flight(self, token_ids: list[int], *, salt: str | None = None,
                         adapter_id: str | None = None) -> bool:
        """Whether the first block of this prompt that no tier holds is being computed now by a
        sequence on the device (its prompt blocks not yet all computed): admitting the prompt
        after that would hit it instead of computing it a second time."""
        if not self.enable_prefix_caching:
            return False
        B = self.block_size
        device, host = self.pool.cached, self.host_pool.cached
        block_hash = self.prefix.first_uncached(root_hash(salt, adapter_id), token_ids,
                                                lambda h: h in device or h in host)
        return block_hash is not None and any(block_hash in seq.block_hashes[seq.num_computed // B:]
                                              for seq in self.seqs.values() if seq.on_device)

    def take_tier_copies(self) -> TierCopies:
        """This step's copies between the tiers, handed over once (see ``TierCopies``): the
        runner makes them before the forward pass."""
        return self.lower_tiers.take_copies()

    def persistable_blocks(self) -> list[tuple[str, int, bytes]]:
        """``(tier, block id, key)`` of every cached block, host then device, not yet on disk
        (what a clean shutdown writes down); empty without a disk tier."""
        disk = self.lower_tiers.disk
        return disk.persistable_blocks(self.pool) if disk is not None else []

    def finish_step(self, copied: bool = True) -> None:
        """The step's copies are over: release the host blocks they held (``copied=False``: the
        step's shared work failed, and what it offloaded is forgotten)."""
        self.lower_tiers.finish_step(copied)

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
        for table in seq.tables:
            shared = [i for i in range(first, min(last, len(table))) if blocks[table[i]].ref_count > 1]
            plans.append((table, shared, max(last - len(table), 0)))
        total = sum(len(shared) + missing for _, shared, missing in plans)
        if total == 0:
            return []
        self.tenancy.make_room(total)
        if total > self.pool.num_free:
            raise OutOfBlocksError(total, self.pool.num_free)
        if self.pool.num_full_blocks:  # a mixed pool: each new block in the format its index asks
            formats = self._formats(seq, [i for table, shared, missing in plans
                                          for i in [*shared, *range(len(table), len(table) + missing)]])
            fresh = iter(self.pool.allocate(total, seq.tenant, quota=quota, full=formats,
                                            strict_full=seq.full_precision))
        else:
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
        slots = len(seq.tables[0]) * self.block_size
        if num_tokens < 0 or n > len(seq.token_ids) or n > slots:
            raise ValueError(f"sequence {seq_id!r}: cannot mark {num_tokens} more tokens computed "
                             f"({seq.num_computed} computed, {len(seq.token_ids)} known, {slots} slots)")
        seq.num_computed = n
        if self.enable_prefix_caching and n // self.block_size > seq.num_cached_blocks:
            start = seq.num_cached_blocks
            self.prefix.cache_full_blocks(seq)
            if self.lower_tiers:  # a tier shared by replicas writes blocks as they become cached
                blocks, end = self.pool.blocks, seq.num_cached_blocks
                self.lower_tiers.on_cached([blocks[t[i]] for t in seq.tables for i in range(start, end)
                                            if t[i] != RELEASED and blocks[t[i]].block_hash is not None])
        if self._sliding:  # cached first: a released block stays cached-free
            self.released_blocks += release_out_of_window(self.pool, seq, self.groups, self.block_size)

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
        extra = [table[i] for table in seq.tables for i in range(len(table) - 1, keep - 1, -1)]
        for table in seq.tables:
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
        child = SeqState(child_id, token_ids, parent.root, parent.tenant, [list(t) for t in parent.tables],
                         parent.num_computed, list(parent.block_hashes), parent.num_cached_blocks,
                         released=list(parent.released), content_hashes=list(parent.content_hashes),
                         adapter=parent.adapter, full_precision=parent.full_precision)
        blocks = self.pool.blocks
        for block_id in child.block_ids():
            self.pool.touch(blocks[block_id])
        self.seqs[child_id] = child

    def forget(self, seq_id: Hashable) -> None:
        """Drop what ``prefetch`` remembers of a sequence that left the queue without blocks."""
        self.lower_tiers.forget(seq_id)

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks. Its last block is freed first, so under LRU a cached
        prefix chain is evicted from its tail and its shared head survives longest."""
        seq = self.seqs.pop(seq_id)
        pool = self.pools[seq.tier]
        blocks = pool.blocks
        pool.free(blocks[i] for i in reversed(seq.block_ids()))

    def evict_cached(self, max_blocks: int | None = None, *, offload: bool = True) -> int:
        """Forget cached-free device prefix blocks (all, or up to ``max_blocks``); returns the
        count. With ``offload`` (and a host tier) they are copied down first; pass False when
        their contents are not to be trusted (after a failed forward pass)."""
        return self.pool.evict_cached(max_blocks, keep_contents=offload)

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
        full: dict[int, bool] | None = None
        strict = False
        if self.pool.num_full_blocks:  # a mixed pool: each block back in the format its position asks
            full = {}
            for seq in seqs:
                for table in seq.tables:
                    for i, b in enumerate(table):
                        if b != RELEASED:
                            full[b] = full.get(b, False) or self._wants_full(seq, i)
            strict = any(seq.full_precision for seq in seqs)
            wanted = sum(full.values())
            if strict and wanted > self.pool.num_free_full:
                raise OutOfBlocksError(wanted, self.pool.num_free_full, f"{self.pool.name} full-precision")
        if self.host_tier is not None:
            # The host blocks are read by this step's swap-in copies, after its swap-outs: hold
            # them so that an offload later in the step cannot take one and write it first.
            host = self.host_pool
            sources = [host.blocks[i] for i in dict.fromkeys(i for seq in seqs for i in seq.block_ids())]
            self.tenancy.make_room(len(sources))
            if len(sources) > self.pool.num_free:
                raise OutOfBlocksError(len(sources), self.pool.num_free, self.pool.name)
            self.host_tier.hold(sources)
        mapping = move_sequences(seqs, self.host_pool, self.pool, full, strict)
        self.swapped_in_blocks += len(mapping)
        for seq in seqs:
            seq.num_cached_blocks = 0
            if self.enable_prefix_caching:
                self.prefix.cache_full_blocks(seq)
        return list(mapping.items())

    def swap_cheaper(self, blocks: int, tokens: int) -> bool:
        """Whether preempting work that holds ``blocks`` device blocks with ``tokens`` computed is
        better done by swapping it out than by recomputing it later: the host pool has room and
        the measured copy costs beat the prefill (``memory/tiers/costs.py``)."""
        return blocks <= self.host_pool.num_free and self.costs.swap_cheaper(blocks, tokens)

    def _in_tier(self, seq_ids: Iterable[Hashable], tier: str) -> list[SeqState]:
        seqs = [self.seqs[s] for s in dict.fromkeys(seq_ids)]
        for seq in seqs:
            if seq.tier != tier:
                where = "swapped out" if tier == DEVICE else "on the device"
                raise ValueError(f"sequence {seq.seq_id!r} is already {where}")
        return seqs

    # ------------------------------------------------------------------ inspection
    def stats(self) -> KVStats:
        """A snapshot of the pools and counters: fill and fragmentation over the device blocks
        the sequences hold, then each part's own figures (prefix cache, lower tiers, tenancy)."""
        B = self.block_size
        filled: dict[int, int] = {}
        table_blocks = 0
        for seq in self.seqs.values():
            if not seq.on_device:
                continue
            for table in seq.tables:  # every KV group's (a hybrid model's released entries skipped)
                n = min(len(seq.token_ids), len(table) * B)
                for i, block_id in enumerate(table):
                    fill = min(B, n - i * B)
                    if fill <= 0:
                        break
                    if block_id == RELEASED:
                        continue
                    table_blocks += 1
                    if fill > filled.get(block_id, 0):
                        filled[block_id] = fill
        pool, host, prefix = self.pool, self.host_pool, self.prefix
        used = pool.num_blocks - pool.num_free
        evictable = sum(1 for b in pool.free_queue if b.block_hash is not None)
        return KVStats(
            num_blocks=pool.num_blocks, block_size=B, used_blocks=used, free_blocks=pool.num_free,
            cached_blocks=len(pool.cached), evictable_blocks=evictable, num_seqs=len(self.seqs),
            table_blocks=table_blocks, filled_slots=sum(filled.values()), allocated_slots=used * B,
            prefix_query_tokens=prefix.query_tokens, prefix_hit_tokens=prefix.hit_tokens,
            evictions=pool.evictions, cow_copies=self.cow_copies, window_released_blocks=self.released_blocks,
            rolled_back_blocks=self.rolled_back_blocks,
            full_precision_blocks=pool.num_full_blocks, free_full_precision_blocks=pool.num_free_full,
            swapped_out_blocks=self.swapped_out_blocks, swapped_in_blocks=self.swapped_in_blocks,
            host_blocks=host.num_blocks, host_used_blocks=host.num_blocks - host.num_free,
            host_cached_blocks=len(host.cached), first_misses=prefix.first_misses_by_reason(),
            **self.lower_tiers.stats(),  # each lower tier's own fields (memory/tiers/)
            **self.tenancy.stats())

    def check_integrity(self) -> None:
        """Raise IntegrityError unless every structure agrees with every other.

        Each part checks itself (the pools: free queue, ref counts, hash map and the tenant
        ledger; the lower tiers; the prefix cache: sequences' cached blocks carry their prefix's
        hash, and the index agrees with the hash map); then each block's ref count must equal the
        references to it: block tables, conversation pins, a ``pin``, tier copies in flight.
        """
        for pool in self.pools.values():
            pool.check_integrity()
        self.lower_tiers.check_integrity()
        refs = {tier: Counter[int]() for tier in self.pools}
        refs[HOST].update(self.lower_tiers.held_blocks())  # held for this step's tier copies
        refs[DEVICE].update(self.tenancy.refs())  # conversation pins (memory/pins.py)
        for seq in self.seqs.values():
            self._check_seq(seq)
            refs[seq.tier].update(seq.block_ids())
        self.prefix.check(self.seqs.values())
        for tier, pool in self.pools.items():
            counts = refs[tier]
            for block in pool.blocks:
                expected = counts[block.block_id] + block.pinned
                if block.ref_count != expected:
                    raise IntegrityError(f"{pool.name} {block}: ref count {block.ref_count} but "
                                         f"{expected} references")

    def _check_seq(self, seq: SeqState) -> None:
        """One sequence's tables (one per group, all as long, released entries exactly the leading
        ones out of the window of the next query) and counters."""
        B, sid, tables = self.block_size, seq.seq_id, seq.tables
        held = seq.block_ids()
        if len(set(held)) != len(held):
            raise IntegrityError(f"sequence {sid!r} maps one block twice: {tables}")
        if len(tables) != len(self.groups) or len(seq.released) != len(tables):
            raise IntegrityError(f"sequence {sid!r} has {len(tables)} block tables for {len(self.groups)} KV groups")
        for g, (table, group) in enumerate(zip(tables, self.groups)):
            lo = seq.released[g]
            if len(table) != len(tables[0]):
                raise IntegrityError(f"sequence {sid!r} group {g} table has {len(table)} blocks, "
                                     f"group 0 {len(tables[0])}")
            if any(b != RELEASED for b in table[:lo]) or RELEASED in table[lo:]:
                raise IntegrityError(f"sequence {sid!r} group {g} released entries are not the first {lo}")
            if lo > group.first_visible(seq.num_computed, B):
                raise IntegrityError(f"sequence {sid!r} group {g} released a block still in the window")
        if not seq.num_computed <= len(seq.token_ids):
            raise IntegrityError(f"sequence {sid!r} computed more tokens than it has")
        if seq.num_computed > len(tables[0]) * B:
            raise IntegrityError(f"sequence {sid!r} computed tokens have no slots")
        if len(seq.block_hashes) * B > len(seq.token_ids):
            raise IntegrityError(f"sequence {sid!r} hashed blocks past its tokens")
        if seq.num_cached_blocks > seq.num_computed // B:
            raise IntegrityError(f"sequence {sid!r} cached a block before computing it")
        if seq.full_precision and seq.on_device and any(b >= self.pool.num_full_blocks for b in held):
            raise IntegrityError(f"full-precision sequence {sid!r} holds an 8-bit block: {tables}")

    def pretty_print(self) -> str:
        """A readable dump of every sequence's block tables and the cached blocks."""
        lines = [f"KVCacheManager: {self.num_blocks} blocks x {self.block_size} slots, "
                 f"{self.pool.num_free} free, {len(self.pool.cached)} cached"]
        for seq in self.seqs.values():
            lines.append(f"  seq {seq.seq_id!r} [{seq.tier}] tokens={len(seq.token_ids)} "
                         f"computed={seq.num_computed} table={seq.tables[0]}")
            for g, table in enumerate(seq.tables[1:], start=1):
                lines.append(f"    group {g} (window {self.groups[g].window}) table={table}")
        return "\n".join(lines)
