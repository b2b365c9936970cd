"""Paged KV memory under simulation: a thin adapter over the real ``pagedkv.memory.KVCacheManager``.

Nothing here re-implements paging: every allocation, prefix hit, fork and copy-on-write is the
manager's. The adapter only maps the simulator's calls onto the manager's API::

    admit    cow and n > 1:  allocate_prompt(prompt) + mark_computed, fork(prompt, seq) for every
                             sequence, free(prompt); then each sequence's generated tokens (after
                             a preemption) via allocate_slots + mark_computed
             otherwise:      allocate_prompt(seq, tokens) + mark_computed for every sequence
                             (without CoW each sample holds its own copy of the prompt, unless
                             prefix caching finds the full blocks another sample computed)
    grow     allocate_slots(seq, 1), mark_computed(seq, 1) (the simulator appended the token)
    replace  cow: free(loser), fork(winner, new); else free(loser), allocate_prompt(new, copy)

Every ``allocate_prompt`` passes ``salt=tenant, tenant=tenant`` (the request's tenant; None when the
trace names none, which keeps a trace without tenants exactly as before): each tenant hits only its
own cached prefixes and, with ``tenant_quotas`` / ``default_tenant_quota``, is held to its share of the
pool. ``admit`` and ``grow`` then let the manager's ``TenantQuotaError`` through (after undoing a
partial admission) so the simulator can make that tenant wait, or preempt its own work, as the
engine's scheduler does.

The manager reads each ``SimSeq.tokens`` list; only the simulator writes it.

Usage comes from the manager: allocated = used blocks x block size; filled = allocated minus the
empty tails of the live sequences' last blocks, each physical block once: the same number as
``stats().filled_slots`` (the tests check it every step) in O(sequences) instead of O(blocks).
"""

from __future__ import annotations

from pagedkv.memory import IntegrityError, KVCacheManager, OutOfBlocksError, TenantQuotaError
from pagedkv.sim.memory_policy import MemoryUsage, SimSeq
from pagedkv.sim.workload import Request


class PagedPolicy:
    """Paged KV memory of ``capacity // block_size`` blocks managed by ``KVCacheManager``."""

    def __init__(self, name: str, capacity: int, block_size: int, *, prefix_caching: bool,
                 cow: bool, watermark: float = 0.01, eviction_policy: str = "lru",
                 kv_group_windows: tuple[int | None, ...] = (None,),
                 tenant_quotas: dict[str, float] | None = None,
                 default_tenant_quota: float | None = None) -> None:
        if capacity < block_size:
            raise ValueError(f"--kv-tokens: capacity {capacity} is below block size {block_size}")
        self.name = name
        self.block_size: int | None = block_size
        self.capacity = capacity // block_size * block_size
        self.cow = cow
        self.kv = KVCacheManager(capacity // block_size, block_size,
                                 enable_prefix_caching=prefix_caching,
                                 eviction_policy=eviction_policy, watermark=watermark,
                                 kv_group_windows=kv_group_windows,
                                 tenant_quotas=tenant_quotas or None,
                                 default_tenant_quota=default_tenant_quota)
        self.live: dict[int, SimSeq] = {}
        self.last_hit_tokens = 0

    def admit(self, request: Request, seqs: list[SimSeq]) -> bool:
        kv = self.kv
        done: list[SimSeq] = []
        root = ("prompt", seqs[0].seq_id)  # the CoW path's shared prompt, freed once forked
        tenant = request.tenant
        hits = 0
        try:
            if self.cow and len(seqs) > 1:
                # The prompt is computed once, as a sequence of its own that every sample forks.
                prompt = request.prompt
                cached = hits = kv.allocate_prompt(root, prompt, salt=tenant, tenant=tenant)
                kv.mark_computed(root, len(prompt) - cached)
                for seq in seqs:
                    kv.fork(root, seq.seq_id, seq.tokens)
                    done.append(seq)
                kv.free(root)
                for seq in seqs:
                    generated = len(seq.tokens) - len(prompt)
                    if generated:
                        kv.allocate_slots(seq.seq_id, generated)
                        kv.mark_computed(seq.seq_id, generated)
            else:
                for seq in seqs:
                    cached = kv.allocate_prompt(seq.seq_id, seq.tokens, salt=tenant, tenant=tenant)
                    if not done:
                        hits = cached
                    done.append(seq)
                    kv.mark_computed(seq.seq_id, len(seq.tokens) - cached)
        except OutOfBlocksError as exc:
            for seq_id in [s.seq_id for s in done] + [root]:
                if seq_id in kv:
                    kv.free(seq_id)
            if isinstance(exc, TenantQuotaError):
                raise
            return False
        for seq in seqs:
            self.live[seq.seq_id] = seq
        self.last_hit_tokens = hits
        return True

    def grow(self, seq: SimSeq) -> bool:
        kv = self.kv
        try:
            kv.allocate_slots(seq.seq_id, 1)
        except TenantQuotaError:
            raise  # its tenant is at its quota: the simulator preempts that tenant's own work
        except OutOfBlocksError:
            return False
        kv.mark_computed(seq.seq_id, 1)
        return True

    def replace(self, loser: SimSeq, winner: SimSeq, new: SimSeq) -> bool:
        kv = self.kv
        self.release([loser])
        if self.cow:
            kv.fork(winner.seq_id, new.seq_id, new.tokens)
        else:
            try:
                cached = kv.allocate_prompt(new.seq_id, new.tokens, salt=new.tenant, tenant=new.tenant)
            except OutOfBlocksError:
                return False
            kv.mark_computed(new.seq_id, len(new.tokens) - cached)
        self.live[new.seq_id] = new
        return True

    def release(self, seqs: list[SimSeq]) -> None:
        for seq in seqs:
            if self.live.pop(seq.seq_id, None) is not None:
                self.kv.free(seq.seq_id)

    def usage(self) -> MemoryUsage:
        kv = self.kv
        B = kv.block_size
        allocated = (kv.num_blocks - kv.num_free_blocks) * B
        # Only a sequence's last block can be partly filled (prefix hits are full blocks; forks
        # share a partial last block until copy-on-write), so the empty slots are the last
        # blocks' tails, each physical block counted once.
        empty: dict[int, int] = {}
        never = 0  # slots past a sequence's final length in its last block
        for seq in self.live.values():
            n = len(seq.tokens)
            end = -(-n // B) * B
            for table in (kv.block_table(seq.seq_id), *kv.group_tables(seq.seq_id)):
                empty[table[-1]] = end - n
            if end > seq.final_len:
                never += end - seq.final_len
        filled = allocated - sum(empty.values())
        return MemoryUsage(allocated, filled, min(never, allocated - filled))

    def unusable_free_slots(self, request: Request) -> int:
        return 0  # any free block can hold any token

    def quota_status(self, tenant: str | None) -> int | None:
        tenancy = self.kv.tenancy
        if (limit := tenancy.limit(tenant)) is None:
            return None
        held = tenancy.held(tenant)
        return (held > limit) - (held < limit)

    def fits(self, request: Request, seqs: list[SimSeq]) -> bool:
        """The engine's check before it preempts for a waiting request: the first sequence's
        blocks (its prefix hits revived, fresh ones) within the free blocks above the watermark."""
        kv = self.kv
        need = kv.blocks_to_admit(seqs[0].tokens, salt=request.tenant)
        return need <= kv.num_free_blocks - kv.watermark_blocks

    def within_quota(self, request: Request, seqs: list[SimSeq]) -> bool:
        """The tenant's blocks in use (held minus its cached-free ones, which it gives up first) plus
        every sequence's blocks, each counted as if alone (at least what ``admit`` takes: shared
        prompt blocks count once per sequence), within its quota."""
        kv = self.kv
        if (limit := kv.tenancy.limit(request.tenant)) is None:
            return False
        in_use = kv.tenancy.in_use(request.tenant)
        need = sum(kv.blocks_to_admit(seq.tokens, salt=request.tenant) for seq in seqs)
        return in_use + need <= limit

    def check_integrity(self) -> None:
        """The manager's own checks, plus: this adapter's usage equals ``stats()`` and it holds
        exactly the sequences the manager knows. Raises ``IntegrityError``."""
        kv = self.kv
        kv.check_integrity()
        stats, usage = kv.stats(), self.usage()
        if (usage.allocated_slots, usage.filled_slots) != (stats.allocated_slots, stats.filled_slots):
            raise IntegrityError(f"{self.name}: usage {usage} disagrees with the manager's "
                                 f"allocated {stats.allocated_slots} / filled {stats.filled_slots}")
        if set(self.live) != set(kv.seqs):
            raise IntegrityError(f"{self.name}: live sequences differ from the manager's")
        for seq in self.live.values():
            if kv.seqs[seq.seq_id].token_ids is not seq.tokens:
                raise IntegrityError(f"{self.name}: sequence {seq.seq_id} is read from another list")

    def counters(self) -> dict[str, int]:
        kv = self.kv
        return {
            "prefix_query_tokens": kv.prefix.query_tokens,
            "prefix_hit_tokens": kv.prefix.hit_tokens,
            "evictions": kv.evictions,
            "cow_copies": kv.cow_copies,
        }
