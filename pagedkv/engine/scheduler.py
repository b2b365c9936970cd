"""Continuous batching by counters, with chunked prefill, preemption and swapping.

Every step the scheduler builds a plan (``SchedulerOutput``) under a token budget:

1. Running requests, in priority order (lower ``priority`` first, then arrival): each live
   sequence computes its next tokens (1 for a decode, a chunk for a prefill). When blocks run out,
   the running request that sorts last (highest priority value, then latest arrival) is preempted:
   by swap to the host tier (``preemption_mode="swap"``, when the host has room) or by recompute
   (blocks dropped, the request re-prefills its prompt and its output so far later);
   ``"auto"`` swaps when the memory core's measured costs (``memory/tier_costs.py``) say copying
   the blocks down and back is cheaper than recomputing their tokens. A thrash guard skips, as a
   victim, a request preempted before that has not sampled a token since, while another victim
   exists. A request that cannot grow even when no victim is left preempts itself, always by
   recompute.
2. If nothing was preempted: swapped requests come back (FCFS), then waiting requests are admitted
   (prefix-cache hits skip their cached tokens) while the budget, ``max_num_seqs`` and the KV
   pool allow. A waiting request that does not fit blocks the ones behind it (no starvation);
   so does one whose next uncached prefix block another request is computing now: it waits and
   then hits that block instead of computing the shared prefix a second time.
   With a disk tier, a waiting request whose cached prefix continues on disk waits until those
   blocks are read (``KVCacheManager.prefetch``) while running requests keep decoding.

Each step also has a budget of prefill seconds (``EngineConfig.max_step_time_s``), spent by the
step-time estimate of ``engine/step_cost.py`` (fitted to measured steps): attention grows with the
context a chunk attends to, so a long prompt is prefilled in chunks that shrink as it grows and
the streams beside it keep their inter-token gaps near the budget (plus the batch's decodes,
which always run). Running prefills leave a share to the first waiting request (unless it sorts
after them, or waits for a prefix one of them computes) so a newcomer's prefill starts within a
step or two. A chunk that completes a prompt counts its rows: the n forks sampled at once, and
the penalties or logit_bias they process.

Fan-out: a step computes at most ``max_num_seqs`` rows. A request with more live sequences than
its share of them takes turns among them (the least advanced first), and it holds at most half
of ``max_num_seqs``'s seats for admission, so an ``n: 128`` request never shuts newcomers out
for its whole life.

Speculative decoding: a decoding sequence with a live proposal (``Sequence.live_proposal``)
computes its last token and the proposal in one chunk when free blocks allow (it never preempts
for them); the update keeps the accepted part and rolls back the rest (``KVCacheManager.rollback``).

Pure Python: the scheduler drives the memory core and never touches tensors.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

from pagedkv.engine.scheduler_output import ScheduledSeq, SchedulerOutput, StepResult
from pagedkv.engine.sequence import GroupStatus, Sequence, SequenceGroup
from pagedkv.engine.step_cost import StepBudget, StepCostModel, prior_coefficients
from pagedkv.memory import DEFAULT_TENANT, CopyPair, KVCacheManager, OutOfBlocksError, TenantQuotaError

PREFETCH_LOOKAHEAD = 4  # waiting requests whose disk reads are issued ahead of their admission


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The scheduler's part of EngineConfig (which owns the defaults)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    preemption_mode: str  # "auto" | "recompute" | "swap"
    max_loras: int = 0  # distinct LoRA adapters running at once (0: no adapters)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, costs: StepCostModel | None = None) -> None:
        """``costs``: the step-time estimate and its budget (default: a prior with no time limit,
        the token budget alone)."""
        self.config = config
        self.kv = kv
        self.costs = costs if costs is not None else StepCostModel(prior_coefficients(None))
        self.waiting: list[SequenceGroup] = []   # each list sorted by SequenceGroup.sort_key
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self.groups: dict[str, SequenceGroup] = {}
        self.preemptions = {"recompute": 0, "swap": 0}
        self.thrash_guarded = 0  # times a victim was skipped by the thrash guard

    # ------------------------------------------------------------------ requests
    def add(self, group: SequenceGroup) -> None:
        if group.request_id in self.groups:
            raise ValueError(f"request id {group.request_id!r} is already in use")
        self.groups[group.request_id] = group
        self._enqueue(self.waiting, group, GroupStatus.WAITING)

    def abort(self, request_id: str, reason: str = "abort") -> SequenceGroup | None:
        """Drop a request wherever it is and free its blocks; its live sequences finish with
        ``reason`` ("abort", or "error" when the engine failed it). Unknown ids are ignored."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        for seq in group.live_seqs:
            seq.finish_reason = reason
        self._retire(group)
        return group

    def has_unfinished(self) -> bool:
        return bool(self.groups)

    @property
    def num_running_seqs(self) -> int:
        return sum(g.num_live for g in self.running)

    def _seats(self, width: int) -> int:
        """Seats of ``max_num_seqs`` a request of ``width`` live sequences holds for admission: all
        of them, but at most half the batch (a wider request takes turns among its sequences)."""
        return min(width, max(1, self.config.max_num_seqs // 2))

    @property
    def num_running_seats(self) -> int:
        return sum(self._seats(g.num_live) for g in self.running)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        self.kv.expire_pins(time.monotonic())
        scheduled: list[ScheduledSeq] = []
        copies: list[CopyPair] = []
        swap_out: list[CopyPair] = []
        swap_in: list[CopyPair] = []
        preempted: list[str] = []
        resumed: list[str] = []
        self._begin_step(swap_out, preempted)
        made_room_for = self._make_room_for_waiting(budget, swap_out, preempted)
        num_made_room = len(preempted)
        seconds = self.costs.budget()
        caps = self._row_caps()
        # running prefills leave a share of the step to the first waiting request, when it may join
        # (not when it waits for a prefix a running prompt computes: that prompt then takes the
        # whole step, and the requests behind the waiting one wait for it too)
        newcomer = self.waiting[0] if self.waiting and (
            not self.running or self.num_running_seats + self._seats(self.waiting[0].width)
            <= self.config.max_num_seqs) else None
        if newcomer is not None and self.running and self._waits_for_prefix(newcomer):
            newcomer = None

        i = 0
        while i < len(self.running) and budget > 0:
            group = self.running[i]
            share = seconds.reserve() if newcomer is not None and newcomer.priority <= group.priority else 0.0
            plan = self._schedule_running(group, budget, swap_out, preempted, seconds, caps, share, not share)
            if plan is None:  # preempted itself
                continue
            entries, pairs = plan
            scheduled += entries
            copies += pairs
            budget -= sum(e.num_tokens for e in entries)
            i += 1

        if made_room_for is not None and len(preempted) == num_made_room:
            self._admit_waiting(budget, scheduled, seconds, first=made_room_for)
        elif not preempted:
            budget = self._resume_swapped(budget, scheduled, copies, swap_in, resumed, seconds)
            if not self.swapped:
                self._admit_waiting(budget, scheduled, seconds)
        tiers = self.kv.take_tier_copies()  # the host and disk tiers of the prefix cache
        swap_out += tiers.offloads
        swap_in += tiers.reloads
        return SchedulerOutput(tuple(scheduled), tuple(copies), tuple(swap_out), tuple(swap_in),
                               tuple(preempted), tuple(resumed), tiers.to_disk, tiers.from_disk, seconds.work)

    def update_from_output(self, output: SchedulerOutput, result: StepResult) -> None:
        """The one update after a step: record the plan's KV as computed (full blocks enter the
        prefix cache), fork new children in the memory core, free finished sequences and retire
        requests with none left, and end failed requests. After a failed forward pass nothing is
        recorded and every cached-free block is forgotten: a swap-in registers its blocks in the
        prefix cache before their data is copied, so no later request may hit them."""
        kv = self.kv
        if result.computed:
            for s in output.scheduled:
                if not s.proposal:
                    kv.mark_computed(s.seq.seq_id, s.num_tokens)
                elif (n := result.spec_computed.get(s.seq.seq_id, 0)):
                    kv.mark_computed(s.seq.seq_id, n)
        for s in output.scheduled:  # rejected proposals give their slots back (before any fork)
            if s.proposal and s.seq.seq_id in kv and not kv.is_swapped(s.seq.seq_id):
                kv.rollback(s.seq.seq_id)
        for parent, child in result.forks:
            if child.finish_reason is None:
                kv.fork(parent.seq_id, child.seq_id, child.token_ids)
        for group, seq in result.finished:
            if seq.seq_id in kv:
                if group.conversation_id is not None and seq is group.seqs[0] and result.computed \
                        and seq.finish_reason in ("stop", "length"):  # the turn's prefix, for the next turn
                    pinned = kv.pin_prefix(seq.seq_id, (group.tenant or DEFAULT_TENANT, group.conversation_id),
                                           time.monotonic() + group.pin_ttl_s)
                    if pinned.refused and group.cache_details is not None:  # the caller learns why
                        group.cache_details.warnings.append(pinned.refused)
                kv.free(seq.seq_id)
        for group in {id(g): g for g, _ in result.finished}.values():
            if group.num_live == 0:
                self._retire(group)
        for group in result.failed:
            self.abort(group.request_id, reason="error")
        kv.finish_step(copied=result.computed)
        if not result.computed:
            kv.evict_cached(offload=False)

    # ------------------------------------------------------------------ helpers
    def _schedule_running(self, group: SequenceGroup, budget: int, swap_out: list[CopyPair],
                          preempted: list[str], seconds: StepBudget, caps: dict[int, int] | None = None,
                          reserve: float = 0.0, floor: bool = True) -> tuple[list[ScheduledSeq], list[CopyPair]] | None:
        """Plan ``group``'s sequences within ``budget`` tokens and ``seconds`` (less ``reserve``
        for prefill chunks and further forks' rows; ``floor``: a prefill chunk may take the step's
        floor); None when it preempted itself."""
        entries: list[ScheduledSeq] = []
        pairs: list[CopyPair] = []
        seqs = group.live_seqs
        if len(seqs) > 1 and not group.beam_width:  # forks take turns: the least advanced first
            seqs = sorted(seqs, key=lambda s: s.num_tokens)[:caps.get(id(group), len(seqs)) if caps else None]
        for seq in seqs:
            if budget <= 0:
                break
            computed = self.kv.num_computed(seq.seq_id)
            n = min(seq.num_tokens - computed, budget)
            if n <= 0:
                continue
            if n > 1:  # a prefill chunk (a prompt, or a recompute): sized by the step's seconds
                n = seconds.chunk(computed, n, *_sampled_rows(group, seq, computed, n), reserve=reserve,
                                  floor=floor)
                if n <= 0:
                    continue
            proposal = seq.live_proposal[:budget - 1] if n == 1 and seq.seq_id in self.kv else ()
            if proposal:
                # Speculation takes free blocks only: it never preempts or waits for them.
                try:
                    pairs += self.kv.allocate_slots(seq.seq_id, 1 + len(proposal))
                except OutOfBlocksError:
                    proposal = ()
                else:
                    entries.append(ScheduledSeq(group, seq, computed, 1 + len(proposal), proposal))
                    seconds.charge(computed, 1 + len(proposal), 1 + len(proposal),
                                   (1 + len(proposal)) * _processes(group), prefill=False)
                    budget -= 1 + len(proposal)
                    continue
            if seq.seq_id not in self.kv:
                # A sibling not yet back after a recompute: re-prefill when blocks allow.
                try:
                    computed = self.kv.allocate_prompt(seq.seq_id, seq.token_ids, n, salt=group.salt,
                                                       adapter_id=group.lora_key,
                                                       tenant=group.tenant)
                except OutOfBlocksError:
                    continue
                n = min(seq.num_tokens - computed, n)
            else:
                while True:
                    try:
                        pairs += self.kv.allocate_slots(seq.seq_id, n)
                        break
                    except OutOfBlocksError as exc:
                        at_quota = isinstance(exc, TenantQuotaError)
                        victim = self._victim(group, own_tenant=at_quota)
                        if victim is None and at_quota and self._only_running_of_its_tenant(group):
                            # a tenant's only work grows past its quota rather than retry for ever
                            try:
                                pairs += self.kv.allocate_slots(seq.seq_id, n, quota=False)
                                break
                            except OutOfBlocksError:
                                pass
                        if victim is None:
                            self._preempt(group, "recompute", swap_out, preempted)
                            return None
                        self._preempt(victim, self._preemption_mode(victim), swap_out, preempted)
            entries.append(ScheduledSeq(group, seq, computed, n))
            seconds.charge(computed, n, *_sampled_rows(group, seq, computed, n))
            budget -= n
        return entries, pairs

    def _row_caps(self) -> dict[int, int] | None:
        """Rows each running request may compute this step (by ``id``), when their live sequences
        and one row for a waiting request exceed ``max_num_seqs``: a max-min fair share of it, each
        request at least one row. None (the common case): every live sequence runs."""
        limit, waiting = self.config.max_num_seqs, 1 if self.waiting else 0
        if self.num_running_seqs + waiting <= limit:
            return None
        rows, groups = limit - waiting, sorted(self.running, key=lambda g: g.num_live)
        caps: dict[int, int] = {}
        for k, group in enumerate(groups):
            caps[id(group)] = cap = max(1, min(group.num_live, rows // (len(groups) - k)))
            rows -= cap
        return caps

    def _resume_swapped(self, budget: int, scheduled: list[ScheduledSeq], copies: list[CopyPair],
                        swap_in: list[CopyPair], resumed: list[str], seconds: StepBudget) -> int:
        while self.swapped and budget > 0:
            group = self.swapped[0]
            if self.num_running_seqs + group.num_live > self.config.max_num_seqs or self._lora_blocked(group):
                break
            try:
                swap_in += self.kv.swap_in([s.seq_id for s in group.live_seqs])
            except OutOfBlocksError:
                break
            self.swapped.pop(0)
            resumed.append(group.request_id)
            self._enqueue(self.running, group, GroupStatus.RUNNING)
            for seq in group.live_seqs:
                computed = self.kv.num_computed(seq.seq_id)
                n = min(seq.num_tokens - computed, budget)
                if n <= 0:
                    continue
                try:
                    copies += self.kv.allocate_slots(seq.seq_id, n)
                except OutOfBlocksError:
                    continue  # runs next step; preemption will make room there
                scheduled.append(ScheduledSeq(group, seq, computed, n))
                seconds.charge(computed, n, *_sampled_rows(group, seq, computed, n))
                budget -= n
        return budget

    def _victim(self, group: SequenceGroup, own_tenant: bool = False) -> SequenceGroup | None:
        """The running request to preempt so that ``group`` can grow: the one that sorts last,
        skipping those the thrash guard protects; None when none sorts after ``group`` (those
        before it are already planned in this step). With tenant quotas: ``own_tenant`` (the
        group's tenant is at its quota) only the group's tenant's requests; otherwise those of a
        tenant over its quota first."""
        kv = self.kv
        fallback = None
        for victim in reversed(self.running):
            if victim is group:
                return fallback
            if own_tenant and victim.tenant != group.tenant:
                continue
            if victim.preemption_guarded:
                self.thrash_guarded += 1
                continue
            if own_tenant or not kv.quotas_on or kv.tenant_over_quota(victim.tenant):
                return victim
            fallback = fallback or victim
        return fallback

    def _waits_for_prefix(self, group: SequenceGroup) -> bool:
        """Whether ``group`` (waiting) is held back from admission this step because the next
        uncached block of its prompt is being computed by a running request (see
        ``_admit_in_order``)."""
        seq = group.live_seqs[0]
        return self.kv.prefix_in_flight(seq.token_ids, salt=group.salt, adapter_id=group.lora_key)

    def _only_running_of_its_tenant(self, group: SequenceGroup) -> bool:
        return not any(g is not group and g.tenant == group.tenant for g in self.running)

    def _make_room_for_waiting(self, budget: int, swap_out: list[CopyPair],
                               preempted: list[str]) -> SequenceGroup | None:
        """Preempt running work that must give way to the first waiting request when it cannot be
        admitted: work of a lower priority (a higher value), and, with tenant quotas, work of a
        tenant over its quota when the waiting request's tenant is under its own. The worst such
        request goes first (lowest priority, then latest), one at a time until the waiting request
        fits. Returns that request when anything was preempted for it (it is then admitted first,
        before a victim that sorts ahead of it), else None."""
        if not self.waiting or not self.running:
            return None
        group = self.waiting[0]
        kv = self.kv
        if kv.tenant_over_quota(group.tenant):
            return None  # its own quota holds it back: preempting others would not help
        fair = kv.tenant_under_quota(group.tenant)
        seq = group.live_seqs[0]
        width = group.num_live if group.forked else group.width
        made_room = False
        while True:
            victim = next((v for v in reversed(self.running) if not v.preemption_guarded and (
                v.priority > group.priority or (fair and kv.tenant_over_quota(v.tenant)))), None)
            if victim is None:  # (the common case, checked first: no hashing)
                break
            need = kv.blocks_to_admit(seq.token_ids, budget, salt=group.salt, adapter_id=group.lora_key)
            if not kv.quota_admits(group.tenant, need):
                break  # its own quota would refuse it: preempting others would not help
            if self.num_running_seats + self._seats(width) <= self.config.max_num_seqs and \
                    need <= kv.num_free_blocks - kv.watermark_blocks:
                break
            self._preempt(victim, self._preemption_mode(victim), swap_out, preempted)
            made_room = True
        return group if made_room else None

    def _preemption_mode(self, group: SequenceGroup) -> str:
        mode = self.config.preemption_mode
        if mode != "auto":
            return mode
        kv = self.kv
        resident = [s.seq_id for s in group.live_seqs if s.seq_id in kv]
        blocks = len({b for sid in resident for b in kv.block_ids(sid)})
        tokens = sum(kv.num_computed(sid) for sid in resident)
        return "swap" if kv.swap_cheaper(blocks, tokens) else "recompute"

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledSeq], seconds: StepBudget,
                       first: SequenceGroup | None = None) -> None:
        """Admit waiting requests in order (``first`` before all) while they fit."""
        if first is not None:
            self.waiting.remove(first)
            self.waiting.insert(0, first)
        try:
            self._admit_in_order(budget, scheduled, seconds)
        finally:
            if first is not None and first in self.waiting:
                self.waiting.sort(key=lambda g: g.sort_key)

    def _admit_in_order(self, budget: int, scheduled: list[ScheduledSeq], seconds: StepBudget) -> None:
        if self.kv.loads_in_background:  # start loads (disk reads) for the requests about to be admitted
            for group in self.waiting[1:PREFETCH_LOOKAHEAD]:
                seq = group.live_seqs[0]
                self.kv.prefetch(seq.seq_id, seq.token_ids, salt=group.salt, adapter_id=group.lora_key,
                                 count=False)
        at_quota: set[str | None] = set()  # tenants whose new requests wait this step (memory/tenant_ledger.py)
        i = 0
        while i < len(self.waiting) and budget > 0:
            group = self.waiting[i]
            if group.tenant in at_quota:
                i += 1
                continue
            width = group.num_live if group.forked else group.width
            if self.num_running_seats + self._seats(width) > self.config.max_num_seqs and self.running:
                break
            if self._lora_blocked(group):
                break  # its adapter waits for a free one of max_loras; those behind it wait too (no starvation)
            # Only the first live sequence is allocated here; its siblings (after a recompute)
            # follow in later steps, when they can hit the prefix it recomputes.
            seq = group.live_seqs[0]
            if self.kv.prefetch(seq.seq_id, seq.token_ids, salt=group.salt, adapter_id=group.lora_key):
                break  # its prefix is being read from disk; running requests go on meanwhile
            if self._waits_for_prefix(group):
                break  # its prefix is being computed for another request: admitted next, it hits
            # the chunk's seconds from position 0: a cached prefix only makes its tokens dearer
            wanted = min(seq.num_tokens, budget)
            wanted = seconds.chunk(0, wanted, *_sampled_rows(group, seq, 0, wanted))
            if wanted <= 0:
                break  # the step is full: admitted in a later one
            try:
                cached = self.kv.allocate_prompt(seq.seq_id, seq.token_ids, wanted, salt=group.salt,
                                                 adapter_id=group.lora_key,
                                                 tenant=group.tenant)
            except TenantQuotaError:
                at_quota.add(group.tenant)  # its tenant's later requests wait too; others go on
                i += 1
                continue
            except OutOfBlocksError:
                break
            self.waiting.pop(i)
            if group.num_cached_tokens < 0:  # first admission: its prefix-cache outcome
                group.num_cached_tokens = min(cached, len(group.prompt_token_ids))
                group.cache_details = self.kv.cache_details(seq.seq_id, group.tenant)
            self._enqueue(self.running, group, GroupStatus.RUNNING)
            rest = seq.num_tokens - cached
            n = min(rest, wanted)
            n = min(n, max(1, seconds.chunk(cached, n, *_sampled_rows(group, seq, cached, n))))
            scheduled.append(ScheduledSeq(group, seq, cached, n))
            seconds.charge(cached, n, *_sampled_rows(group, seq, cached, n))
            budget -= n

    # ------------------------------------------------------------------ LoRA adapters
    def _lora_blocked(self, group: SequenceGroup) -> bool:
        """Whether running ``group`` now would make more than ``max_loras`` distinct adapters run
        (each step computes every running request, and each adapter of a step needs a slot). The
        caller stops admitting there, so the requests of other adapters behind it wait too: the
        running adapters drain and the waiting one is admitted, never starved."""
        limit = self.config.max_loras
        if not limit or group.lora_key is None:
            return False
        running = {g.lora_key for g in self.running if g.lora_key is not None}
        return group.lora_key not in running and len(running) >= limit

    def _preempt(self, group: SequenceGroup, mode: str, swap_out: list[CopyPair],
                 preempted: list[str]) -> None:
        self.running.remove(group)
        preempted.append(group.request_id)
        group.num_preemptions += 1
        group.preempted_at = group.total_tokens
        live = group.live_seqs
        resident = [s for s in live if s.seq_id in self.kv]
        # Swap only whole groups: siblings still waiting to re-prefill make it a recompute.
        if mode == "swap" and len(resident) == len(live):
            try:
                swap_out += self.kv.swap_out([s.seq_id for s in live])
            except OutOfBlocksError:
                pass  # the host tier is full: fall back to recompute
            else:
                self.preemptions["swap"] += 1
                self._enqueue(self.swapped, group, GroupStatus.SWAPPED)
                return
        for s in resident:
            self.kv.free(s.seq_id)
        self.preemptions["recompute"] += 1
        self._enqueue(self.waiting, group, GroupStatus.WAITING)

    def _retire(self, group: SequenceGroup) -> None:
        for queue in (self.waiting, self.running, self.swapped):
            if group in queue:
                queue.remove(group)
        for seq in group.seqs:
            if seq.seq_id in self.kv:
                self.kv.free(seq.seq_id)
            self.kv.forget(seq.seq_id)
        group.status = GroupStatus.FINISHED
        group.metrics.setdefault("finished_time", time.time())
        self.groups.pop(group.request_id, None)

    def _enqueue(self, queue: list[SequenceGroup], group: SequenceGroup, status: GroupStatus) -> None:
        group.status = status
        bisect.insort(queue, group, key=lambda g: g.sort_key)

    def _begin_step(self, swap_out: list[CopyPair], preempted: list[str]) -> None:
        """Runs first in every ``schedule()``; nothing here. The seam that fault injection
        (``engine/faults.py``) wraps to preempt or evict before the step is planned."""


def _processes(group: SequenceGroup) -> int:
    """1 when the sampler processes the request's logits rows (penalties, logit_bias, a grammar)."""
    p = group.params
    return 1 if p.uses_penalties or p.structured_output is not None else 0


def _sampled_rows(group: SequenceGroup, seq: Sequence, start: int, n: int) -> tuple[int, int]:
    """(rows sampled, of them processed) when ``seq`` computes ``n`` tokens from ``start``: none
    before its last token; then one, or the n forks of a prompt not yet forked (sampled at once)."""
    if start + n < seq.num_tokens:
        return 0, 0
    rows = group.params.n if not group.forked and not group.beam_width else 1
    return rows, rows * _processes(group)
