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
    kv_cache_dtype: str = "float32"     # the KV block format
    kv_bytes_per_block: int = 0         # one block, all layers, K and V, scales included
    # 8-bit formats: relative RMS error (K, V) of the rows stored per layer, and its maximum;
    # None for the float formats (see engine/kv_quality.py)
    kv_quant_error: list[tuple[float, float]] | None = None
    kv_quant_error_max: float | None = None
    # Reload or recompute (memory/tier_costs.py): measured inputs (None until measured) and the
    # decisions taken; thrash_guarded counts victims the preemption thrash guard skipped
    tier_costs: dict[str, float | int | None] | None = None
    thrash_guarded: int = 0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["kv"] = self.kv.as_dict()
        return d
