"""EngineStats: one snapshot of the memory core's figures and the scheduler's counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pagedkv.memory import KVStats


@dataclass(frozen=True, slots=True)
class EngineStats:
    kv: KVStats
    num_running: int       # requests with device blocks
    num_waiting: int
    num_swapped: int
    num_running_seqs: int
    preemptions_recompute: int
    preemptions_swap: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_steps: int
    faults_fired: int

    def as_dict(self) -> dict:
        d = asdict(self)
        d["kv"] = self.kv.as_dict()
        return d
