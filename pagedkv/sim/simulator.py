"""Discrete-event simulation of a continuous-batching engine's KV memory under one policy.

One simulated step is one decode iteration. Rules, in order, every step:

1. Arrivals: requests whose arrival step has come join the back of the waiting queue (a closed-loop
   client's next request or a chat's next turn arrives ``delay`` steps after the one it follows
   completes).
2. Decode: every running request, oldest first, gains one token in each of its sequences (beam
   groups may first replace a losing beam by a copy of a winning one). When memory runs out, the
   latest-arrived running request is preempted by recompute: its memory is freed, its generated
   tokens are kept, and it returns to the front of the waiting queue to be re-prefilled later.
   A request that cannot grow even when it runs alone is rejected (it can never fit).
3. Admission: unless this step preempted, waiting requests are admitted FCFS (head-of-line
   blocking) while the policy finds room and ``max_num_seqs`` allows; a request that does not
   fit into empty memory is rejected.
4. Metrics are sampled every ``sample_every`` steps; concurrency every step.

A request with ``output_len`` tokens completes after ``output_len`` decode steps of running: one
arriving at step ``a`` and admitted at once generates its first token at ``a + 1`` and completes
at ``a + output_len``.

Tenants and KV quotas (paged policies with ``tenant_quotas`` / ``default_tenant_quota``) follow the
engine's scheduler (``pagedkv/engine/scheduler.py``, ``pagedkv/memory/tenant_ledger.py``):

- admission: a request refused by its tenant's quota (``TenantQuotaError``) waits, and so do its
  tenant's later requests this step, while other tenants' requests behind it are still admitted
  (FCFS within a tenant); a plain shortage still blocks everything behind the head;
- decode: a request whose tenant is at its quota preempts only its own tenant's latest running
  request, or itself; on a plain shortage the latest running request of a tenant over its quota
  goes first, else the latest running request;
- before decode, a waiting head-of-line request that does not fit but would stay within its
  tenant's quota preempts running requests of tenants over theirs (latest first) until it fits,
  and is then admitted first in the same step (the engine asks only that its tenant be under its
  quota: see ``_make_room_for_waiting``);
- a request that keeps hitting its quota at the same length while it runs alone is rejected (it
  cannot grow under the quota), and so is a request whose own samples exceed its tenant's quota
  (``n > 1`` without ``+cow``: the engine forks its samples from one prompt instead).
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from bisect import insort
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedkv.memory import DEFAULT_TENANT, EVICTION_POLICIES, TenantQuotaError
from pagedkv.memory.tenant_ledger import check_fraction, parse_quotas
from pagedkv.sim.memory_policy import MemoryPolicy, SimSeq
from pagedkv.sim.metrics import MetricsAccumulator, PolicyResult, TenantAccumulator
from pagedkv.sim.policies import PolicySpec, build_policy
from pagedkv.sim.workload import Request, output_token

_FIRST_EXTRA_STREAM = 1 << 19  # streams of extra samples / new beams; req ids stay below


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Engine-side settings shared by every policy run. ``ValueError`` names the flag."""

    capacity: int
    max_model_len: int
    max_num_seqs: int = 1024
    watermark: float = 0.01
    eviction_policy: str = "lru"
    beam_reshuffle: float = 0.2
    sample_every: int = 1
    seed: int = 0
    max_steps: int = 2_000_000
    check_integrity: bool = False
    kv_group_windows: tuple[int | None, ...] = (None,)  # a hybrid model's KV groups (see build_policy)
    tenant_quotas: tuple[tuple[str, float], ...] = ()  # (tenant, fraction of the pool): paged only
    default_tenant_quota: float | None = None  # every other tenant's fraction (None: no limit)

    def validate(self) -> None:
        checks = [
            (self.capacity >= 1, "--kv-tokens", ">= 1", self.capacity),
            (self.max_num_seqs >= 1, "--max-num-seqs", ">= 1", self.max_num_seqs),
            (0.0 <= self.watermark < 1.0, "--watermark", "in [0, 1)", self.watermark),
            (0.0 <= self.beam_reshuffle <= 1.0, "--beam-reshuffle", "in [0, 1]",
             self.beam_reshuffle),
            (self.sample_every >= 1, "--sample-every", ">= 1", self.sample_every),
            (self.eviction_policy in EVICTION_POLICIES, "--eviction-policy",
             f"one of {', '.join(EVICTION_POLICIES)}", self.eviction_policy),
        ]
        for ok, flag, allowed, value in checks:
            if not ok:
                raise ValueError(f"{flag}: must be {allowed}, got {value}")
        try:
            parse_quotas([f"{name}={fraction}" for name, fraction in self.tenant_quotas])
        except ValueError as exc:
            raise ValueError(str(exc).replace("tenant_kv_quota", "--tenant-kv-quota", 1)) from None
        if self.default_tenant_quota is not None:
            check_fraction(self.default_tenant_quota, "--default-tenant-kv-quota")


@dataclass(slots=True, eq=False)
class _Group:
    """A request in flight: its sequences and how many tokens each has generated."""

    req: Request
    seqs: list[SimSeq]
    generated: int = 0
    grown: int = 0  # sequences already grown in the current step
    admitted: bool = False  # admitted at least once (its first admission is the one measured)
    quota_stall: int = -1  # tokens it had when it last preempted itself at its quota, alone

    @property
    def tenant(self) -> str:
        return self.req.tenant or DEFAULT_TENANT

    @property
    def key(self) -> tuple[int, int]:
        return (self.req.arrival_step, self.req.req_id)


@dataclass(slots=True)
class _Run:
    """Mutable state of one simulation run."""

    policy: MemoryPolicy
    config: SimConfig
    waiting: deque[_Group] = field(default_factory=deque)
    running: list[_Group] = field(default_factory=list)
    running_seqs: int = 0
    next_seq_id: int = 0
    next_stream: int = _FIRST_EXTRA_STREAM
    preemptions: int = 0
    rejected: int = 0
    completed: int = 0
    preempted_now: bool = False
    step: int = 0
    tenants: TenantAccumulator | None = None  # per-tenant figures, when the trace names tenants
    made_room_for: _Group | None = None  # admitted first this step (it preempted over-quota work)

    def new_seq(self, tokens: list[int], stream: int | None, final_len: int,
                tenant: str | None = None) -> SimSeq:
        if stream is None:
            stream = self.next_stream
            self.next_stream += 1
        self.next_seq_id += 1
        return SimSeq(self.next_seq_id, tokens, stream, final_len, tenant)

    def reject(self, group: _Group) -> None:
        self.rejected += 1
        if self.tenants is not None:
            self.tenants.rejected(group.tenant)

    def preempt(self, group: _Group) -> None:
        """Recompute preemption: free everything, keep generated tokens, wait at the front."""
        self.policy.release(group.seqs)
        keep = group.req.prompt_len + group.generated
        for seq in group.seqs:
            del seq.tokens[keep:]
        self.running.remove(group)
        self.running_seqs -= len(group.seqs)
        group.grown = 0
        self.waiting.appendleft(group)
        self.preemptions += 1
        self.preempted_now = True
        if self.tenants is not None:
            self.tenants.preempted(group.tenant)


def simulate(requests: list[Request], spec: PolicySpec, config: SimConfig,
             on_complete: Callable[[int], None] | None = None) -> PolicyResult:
    """Replay ``requests`` against a fresh policy built from ``spec``; returns its metrics.

    ``on_complete(k)`` is called with the number of requests finished (or rejected) in a step.
    Raises RuntimeError if the run exceeds ``config.max_steps``.
    """
    config.validate()
    policy = build_policy(spec, config.capacity, config.max_model_len, watermark=config.watermark,
                          eviction_policy=config.eviction_policy, kv_group_windows=config.kv_group_windows,
                          tenant_quotas=dict(config.tenant_quotas),
                          default_tenant_quota=config.default_tenant_quota)
    run = _Run(policy, config)
    if any(r.tenant is not None for r in requests):
        run.tenants = TenantAccumulator(sorted({r.tenant or DEFAULT_TENANT for r in requests}))
        for r in requests:
            run.tenants.arrived(r.tenant or DEFAULT_TENANT)
    metrics = MetricsAccumulator(policy.capacity)
    fixed = deque(sorted((r for r in requests if r.after is None),
                         key=lambda r: (r.arrival_step, r.req_id)))
    dependents: dict[int, list[Request]] = {}
    for r in requests:
        if r.after is not None:
            dependents.setdefault(r.after, []).append(r)
    triggered: list[tuple[int, int, Request]] = []  # heap of (arrival step, req id, request)
    step = 0
    finished = 0
    while finished < len(requests):
        if step > config.max_steps:
            raise RuntimeError(f"{spec.name}: simulation did not finish in {config.max_steps} steps")
        if not run.running and not run.waiting:
            upcoming = [t for t in ((fixed[0].arrival_step if fixed else None),
                                    (triggered[0][0] if triggered else None)) if t is not None]
            if upcoming and min(upcoming) > step:
                idle = min(upcoming) - step
                metrics.idle(idle)
                step += idle
        while fixed and fixed[0].arrival_step <= step:
            run.waiting.append(_arrive(run, fixed.popleft(), step))
        while triggered and triggered[0][0] <= step:
            run.waiting.append(_arrive(run, heapq.heappop(triggered)[2], step))

        run.step = step
        _make_room_for_waiting(run)
        done = _decode(run)
        done += _admit(run)
        for req in done:
            for nxt in dependents.get(req.req_id, ()):
                heapq.heappush(triggered, (step + 1 + nxt.delay, nxt.req_id, nxt))
        finished += len(done)
        if done and on_complete is not None:
            on_complete(len(done))

        metrics.concurrency(len(run.running), run.running_seqs, bool(run.waiting))
        if step % config.sample_every == 0:
            head = run.waiting[0].req if run.waiting else None
            unusable = policy.unusable_free_slots(head) if head is not None else 0
            metrics.sample(policy.usage(), unusable)
        if config.check_integrity:
            policy.check_integrity()
        step += 1
    return metrics.result(spec, steps=step, completed=run.completed, rejected=run.rejected,
                          preemptions=run.preemptions, counters=policy.counters(), tenants=run.tenants)


def _arrive(run: _Run, req: Request, step: int) -> _Group:
    if req.after is not None:
        req = _with_arrival(req, step)
    seqs = [run.new_seq(list(req.prompt), req.req_id if i == 0 else None, req.final_len, req.tenant)
            for i in range(req.num_seqs)]
    return _Group(req, seqs)


def _with_arrival(req: Request, step: int) -> Request:
    """A triggered request's copy stamped with its actual arrival step (for FCFS order)."""
    return dataclasses.replace(req, arrival_step=step)


def _decode(run: _Run) -> list[Request]:
    """Every running request gains one token per sequence; returns the requests that finished."""
    run.preempted_now = False
    done: list[Request] = []
    policy = run.policy
    i = 0
    while i < len(run.running):
        group = run.running[i]
        if group.req.beam_width > 1 and group.grown == 0 and group.generated > 0:
            if not _maybe_reshuffle(run, group):
                continue  # group was preempted (it is no longer at index i)
        prompt_len = group.req.prompt_len
        alive = True
        while group.grown < len(group.seqs):
            seq = group.seqs[group.grown]
            seq.tokens.append(output_token(seq.stream, len(seq.tokens) - prompt_len))
            try:
                if policy.grow(seq):
                    group.grown += 1
                    continue
                at_quota = False
            except TenantQuotaError:
                at_quota = True  # its tenant is at its KV quota: only its own work gives way
            seq.tokens.pop()  # no room: the token is generated again once it fits
            length = len(seq.tokens)
            if len(run.running) == 1 and (not at_quota or group.quota_stall == length):
                _drop(run, group)  # cannot grow even alone (or, alone, under its quota): never fits
                done.append(group.req)
                alive = False
                break
            victim = _victim(run, group, own_tenant=at_quota)
            if victim is None:
                if at_quota:
                    group.quota_stall = length
                run.preempt(group)
                alive = False
                break
            run.preempt(victim)
        if not alive:
            continue  # the group left; index i now holds the next one (or the loop ends)
        group.grown = 0
        group.generated += 1
        if group.generated == 1 and run.tenants is not None:
            run.tenants.first_token(group.tenant, run.step - group.req.arrival_step)
        if group.generated >= group.req.output_len:
            policy.release(group.seqs)
            del run.running[i]
            run.running_seqs -= len(group.seqs)
            run.completed += 1
            done.append(group.req)
            if run.tenants is not None:
                run.tenants.completed(group.tenant, run.step - group.req.arrival_step)
        else:
            i += 1
    return done


def _victim(run: _Run, group: _Group, own_tenant: bool) -> _Group | None:
    """The running request to preempt so that ``group`` can grow: the latest one after it, a
    tenant over its quota's first; ``own_tenant`` (its tenant is at its quota): only its own
    tenant's. None: none after it qualifies (``group`` preempts itself). The engine's
    ``Scheduler._victim``, without priorities or the thrash guard."""
    fallback = None
    for victim in reversed(run.running):
        if victim is group:
            return fallback
        if own_tenant and victim.tenant != group.tenant:
            continue
        if own_tenant or run.policy.quota_status(victim.req.tenant) == 1:
            return victim
        if fallback is None:
            fallback = victim
    return fallback


def _make_room_for_waiting(run: _Run) -> None:
    """The engine's ``Scheduler._make_room_for_waiting``: the head-of-line request of a tenant
    under its quota, when it does not fit, preempts running requests of tenants over theirs,
    latest first, until it fits; it is then admitted first this step (``run.made_room_for``).

    One difference: the waiting request must fit within its tenant's quota (its tenant's blocks in
    use plus the request's), where the engine only asks that its tenant be under it. Otherwise two
    tenants whose requests are each larger than their quota preempt each other every step, each
    one under its quota while it waits and over it once admitted, and neither runs."""
    run.made_room_for = None
    if not run.waiting or not run.running:
        return
    group = run.waiting[0]
    policy = run.policy
    if not policy.within_quota(group.req, group.seqs):
        return  # no quota, or over it once admitted: preempting others would not be fair
    while True:
        victim = next((v for v in reversed(run.running) if policy.quota_status(v.req.tenant) == 1), None)
        if victim is None:
            break
        if run.running_seqs + len(group.seqs) <= run.config.max_num_seqs and policy.fits(group.req, group.seqs):
            break
        run.preempt(victim)
        run.made_room_for = group


def _maybe_reshuffle(run: _Run, group: _Group) -> bool:
    """Beam search: with probability ``beam_reshuffle`` one beam is replaced by a copy of another.

    The decision depends only on (seed, request, step within the request), so every policy sees
    the same beam history. Returns False if the group had to be preempted.
    """
    rng = random.Random(hash((run.config.seed, group.req.req_id, group.generated)))
    if rng.random() >= run.config.beam_reshuffle:
        return True
    loser_index = rng.randrange(len(group.seqs))
    winner_index = (loser_index + 1 + rng.randrange(len(group.seqs) - 1)) % len(group.seqs)
    loser, winner = group.seqs[loser_index], group.seqs[winner_index]
    new = run.new_seq(list(winner.tokens), None, winner.final_len, winner.tenant)
    ok = run.policy.replace(loser, winner, new)
    group.seqs[loser_index] = new
    if not ok:
        run.preempt(group)
    return ok


def _admit(run: _Run) -> list[Request]:
    """FCFS admission; returns requests rejected because they can never fit.

    A request refused by its tenant's KV quota is skipped with its tenant's later requests (they
    wait this step) and admission goes on behind them; any other shortage stops it."""
    rejected: list[Request] = []
    if run.preempted_now:
        return rejected
    first = run.made_room_for
    if first is not None and run.waiting and run.waiting[0] is not first and any(g is first for g in run.waiting):
        run.waiting.remove(first)
        run.waiting.appendleft(first)
    cap = run.config.max_num_seqs
    at_quota: set[str] = set()
    i = 0
    while i < len(run.waiting):
        group = run.waiting[i]
        if group.tenant in at_quota:
            i += 1
            continue
        if run.running_seqs + len(group.seqs) <= cap:
            try:
                admitted = run.policy.admit(group.req, group.seqs)
            except TenantQuotaError:
                if not run.running:
                    # Its own samples (n > 1, each with its own copy of the prompt) exceed the
                    # quota: as a prompt too large for empty memory, it can never be admitted.
                    del run.waiting[i]
                    run.reject(group)
                    rejected.append(group.req)
                    continue
                at_quota.add(group.tenant)
                if run.tenants is not None:
                    run.tenants.quota_wait(group.tenant)
                i += 1
                continue
            if admitted:
                del run.waiting[i]
                insort(run.running, group, key=lambda g: g.key)
                run.running_seqs += len(group.seqs)
                if not group.admitted:
                    group.admitted = True
                    if run.tenants is not None:
                        run.tenants.admitted(group.tenant, group.req.prompt_len, run.policy.last_hit_tokens)
                continue
        if run.running:
            break  # head-of-line blocking until memory frees up
        del run.waiting[i]
        run.reject(group)
        rejected.append(group.req)
    return rejected


def _drop(run: _Run, group: _Group) -> None:
    run.policy.release(group.seqs)
    run.running.remove(group)
    run.running_seqs -= len(group.seqs)
    run.reject(group)
