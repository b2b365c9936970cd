"""Per-policy metrics of a simulation run, and how they are accumulated.

Definitions (time averages are ratios of sums over the sampled steps, so busy steps weigh more):

    waste          (allocated - filled) / allocated: reserved-but-unused slots over the KV
                   capacity in use. Equals internal_frag + reservation.
    internal_frag  never / allocated: slots no token of their sequence will ever fill
                   (over-reservation, power-of-two rounding, the tail of a paged last block).
    reservation    the rest of the waste: slots held now for tokens the sequence will
                   generate later (what a contiguous reservation pays for in advance).
    external_frag  free slots that cannot hold the waiting head-of-line request's reservation
                   (holes between extents, unmergeable buddies), over the capacity. 0 when
                   nobody waits, and always 0 for paged memory.
    usage          allocated / capacity.
    mean/peak_concurrency   running requests per step (mean over every step of the run);
                   *_seqs counts sequences (n samples or beams each).
    saturated_concurrency   mean running requests over the steps where requests were
                   waiting: what the memory holds when demand exceeds it (None if never).
    throughput     completed requests per simulated step.
    prefix_hit_rate         prompt tokens served from the prefix cache / prompt tokens looked
                   up (including re-prefills after preemption); None without prefix caching.

Per tenant (``tenants``: only when some request names a tenant; requests naming none are
``default``), in steps of the simulation (see ``pagedkv.sim.simulator``: a request arriving at step
``a`` and admitted at once gets its first token at ``a + 1`` and completes at ``a + output_len``):

    prefix_hit_rate  prompt tokens found in the prefix cache at each request's first admission
                   / its prompt tokens, over the tenant's admitted requests (0..1; block-aligned
                   and short of the last prompt token, so a fully shared prompt stays below 1);
                   None without prefix caching.
    latency        completion step - arrival step, over completed requests: mean, p50, p95
                   (nearest rank).
    ttft           step of the first generated token - arrival step: mean, p50, p95.
    preemptions    times the tenant's running requests were preempted.
    quota_waits    admission attempts refused by the tenant's KV quota (at most one a step: its
                   later requests wait behind the refused one).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from pagedkv.sim.memory_policy import MemoryUsage

if TYPE_CHECKING:
    from pagedkv.sim.policies import PolicySpec


@dataclass(slots=True)
class TenantResult:
    """One tenant's figures on one trace under one policy (see the module docstring)."""

    requests: int
    completed: int
    rejected: int
    preemptions: int
    quota_waits: int
    prompt_tokens: int
    hit_tokens: int
    prefix_hit_rate: float | None
    mean_latency: float | None
    p50_latency: int | None
    p95_latency: int | None
    mean_ttft: float | None
    p50_ttft: int | None
    p95_ttft: int | None


@dataclass(slots=True)
class _TenantTally:
    requests: int = 0
    rejected: int = 0
    preemptions: int = 0
    quota_waits: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    latencies: list[int] = field(default_factory=list)
    ttfts: list[int] = field(default_factory=list)


class TenantAccumulator:
    """Per-tenant tallies, fed by the simulator as requests are admitted, start and finish."""

    __slots__ = ("tallies",)

    def __init__(self, tenants: list[str]) -> None:
        self.tallies = {t: _TenantTally() for t in tenants}

    def arrived(self, tenant: str) -> None:
        self.tallies[tenant].requests += 1

    def admitted(self, tenant: str, prompt_tokens: int, hit_tokens: int) -> None:
        """A request's first admission."""
        tally = self.tallies[tenant]
        tally.prompt_tokens += prompt_tokens
        tally.hit_tokens += hit_tokens

    def first_token(self, tenant: str, steps: int) -> None:
        self.tallies[tenant].ttfts.append(steps)

    def completed(self, tenant: str, steps: int) -> None:
        self.tallies[tenant].latencies.append(steps)

    def rejected(self, tenant: str) -> None:
        self.tallies[tenant].rejected += 1

    def preempted(self, tenant: str) -> None:
        self.tallies[tenant].preemptions += 1

    def quota_wait(self, tenant: str) -> None:
        self.tallies[tenant].quota_waits += 1

    def result(self, prefix: bool) -> dict[str, TenantResult]:
        out: dict[str, TenantResult] = {}
        for name, t in self.tallies.items():
            rate = (t.hit_tokens / t.prompt_tokens if t.prompt_tokens else 0.0) if prefix else None
            out[name] = TenantResult(
                requests=t.requests, completed=len(t.latencies), rejected=t.rejected,
                preemptions=t.preemptions, quota_waits=t.quota_waits, prompt_tokens=t.prompt_tokens,
                hit_tokens=t.hit_tokens, prefix_hit_rate=rate,
                mean_latency=_mean(t.latencies), p50_latency=_percentile(t.latencies, 0.5),
                p95_latency=_percentile(t.latencies, 0.95), mean_ttft=_mean(t.ttfts),
                p50_ttft=_percentile(t.ttfts, 0.5), p95_ttft=_percentile(t.ttfts, 0.95))
        return out


def _mean(values: list[int]) -> float | None:
    return sum(values) / len(values) if values else None


def _percentile(values: list[int], q: float) -> int | None:
    """Nearest rank: the smallest value with at least ``q`` of the values at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass(slots=True)
class PolicyResult:
    """One policy's figures on one trace (see the module docstring for definitions)."""

    name: str
    family: str
    block_size: int | None
    capacity: int
    steps: int
    completed: int
    rejected: int
    preemptions: int
    waste: float
    internal_frag: float
    reservation: float
    external_frag: float
    usage: float
    mean_concurrency: float
    peak_concurrency: int
    mean_seqs: float
    peak_seqs: int
    saturated_concurrency: float | None
    throughput: float
    prefix_hit_rate: float | None
    evictions: int
    cow_copies: int
    tenants: dict[str, TenantResult] | None = None
    # block resizing (merge / vtail, sim/resizing.py): token slots copied, and tokens decode
    # attention read; 0 for the other policies
    resize_copies: int = 0
    attended_tokens: int = 0

    @property
    def copy_cost(self) -> float | None:
        """The resizing copies' time as a share of decode attention's KV reads (``2 * copies /
        attended``: a copy reads and writes each token; sim/resizing.py); None without copies
        counted."""
        return 2 * self.resize_copies / self.attended_tokens if self.attended_tokens else None

    @property
    def net_concurrency(self) -> float | None:
        """``saturated_concurrency`` less the copies' share: the sequences the memory holds,
        net of the modelled time of the copies (docs/block_size.md)."""
        if self.saturated_concurrency is None:
            return None
        return self.saturated_concurrency * (1 - (self.copy_cost or 0.0))

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "copy_cost": self.copy_cost, "net_concurrency": self.net_concurrency}


class MetricsAccumulator:
    """Sums per-step observations; ``result()`` turns them into a ``PolicyResult``."""

    __slots__ = ("capacity", "allocated", "filled", "never", "unusable", "samples",
                 "conc_sum", "seq_sum", "conc_steps", "peak", "peak_seqs", "sat_sum", "sat_steps")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.allocated = self.filled = self.never = self.unusable = self.samples = 0
        self.conc_sum = self.seq_sum = self.conc_steps = self.peak = self.peak_seqs = 0
        self.sat_sum = self.sat_steps = 0

    def idle(self, steps: int) -> None:
        """``steps`` steps with nothing running and nothing waiting."""
        self.conc_steps += steps

    def concurrency(self, requests: int, seqs: int, waiting: bool) -> None:
        if waiting:
            self.sat_sum += requests
            self.sat_steps += 1
        self.conc_sum += requests
        self.seq_sum += seqs
        self.conc_steps += 1
        self.peak = max(self.peak, requests)
        self.peak_seqs = max(self.peak_seqs, seqs)

    def sample(self, usage: MemoryUsage, unusable_free: int) -> None:
        self.allocated += usage.allocated_slots
        self.filled += usage.filled_slots
        self.never += usage.never_filled_slots
        self.unusable += unusable_free
        self.samples += 1

    def result(self, spec: PolicySpec, *, steps: int, completed: int, rejected: int,
               preemptions: int, counters: dict[str, int],
               tenants: TenantAccumulator | None = None) -> PolicyResult:
        alloc = self.allocated
        waste = (alloc - self.filled) / alloc if alloc else 0.0
        internal = self.never / alloc if alloc else 0.0
        denominator = self.samples * self.capacity
        query = counters.get("prefix_query_tokens", 0)
        hit_rate = counters.get("prefix_hit_tokens", 0) / query if spec.prefix and query else None
        if spec.prefix and not query:
            hit_rate = 0.0
        return PolicyResult(
            name=spec.name, family=spec.family, block_size=spec.block_size,
            capacity=self.capacity, steps=steps, completed=completed, rejected=rejected,
            preemptions=preemptions, waste=waste, internal_frag=internal,
            reservation=max(0.0, waste - internal),
            external_frag=self.unusable / denominator if denominator else 0.0,
            usage=alloc / denominator if denominator else 0.0,
            mean_concurrency=self.conc_sum / self.conc_steps if self.conc_steps else 0.0,
            peak_concurrency=self.peak,
            mean_seqs=self.seq_sum / self.conc_steps if self.conc_steps else 0.0,
            peak_seqs=self.peak_seqs,
            saturated_concurrency=self.sat_sum / self.sat_steps if self.sat_steps else None,
            throughput=completed / steps if steps else 0.0,
            prefix_hit_rate=hit_rate,
            evictions=counters.get("evictions", 0), cow_copies=counters.get("cow_copies", 0),
            resize_copies=counters.get("resize_copies", 0), attended_tokens=counters.get("attended_tokens", 0),
            tenants=tenants.result(spec.prefix) if tenants is not None else None)
