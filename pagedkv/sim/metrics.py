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
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from pagedkv.sim.memory_policy import MemoryUsage

if TYPE_CHECKING:
    from pagedkv.sim.policies import PolicySpec


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

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


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
               preemptions: int, counters: dict[str, int]) -> PolicyResult:
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
            evictions=counters.get("evictions", 0), cow_copies=counters.get("cow_copies", 0))
