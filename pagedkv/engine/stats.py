"""EngineStats: one snapshot of the memory core's figures and the scheduler's counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pagedkv.lora.stats import LoRAStats
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
    enable_prefix_caching: bool = True
    kv_bytes_per_block: int = 0         # one block, all layers, K and V, scales included
    # 8-bit formats: relative RMS error (K, V) of the rows stored per layer, and its maximum;
    # None for the float formats (see engine/kv_quality.py)
    kv_quant_error: list[tuple[float, float]] | None = None
    kv_quant_error_max: float | None = None
    # Reload or recompute (memory/tiers/costs.py): measured inputs (None until measured) and the
    # decisions taken; thrash_guarded counts victims the preemption thrash guard skipped
    tier_costs: dict[str, float | int | None] | None = None
    thrash_guarded: int = 0
    # The step-time estimate (engine/step_cost.py): seconds per unit of each feature as fitted,
    # steps observed, and the mean factor between estimated and measured step times
    step_costs: dict[str, float | int | None] | None = None
    # Speculative decoding (pagedkv/speculative; zeros when off): verifications (a sequence's proposal in
    # a step), tokens proposed and accepted, accepted / proposed, tokens emitted per verification,
    # and accepted tokens by their position in the proposal
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    spec_mean_accepted_length: float = 0.0
    spec_accepted_per_position: tuple[int, ...] = ()
    lora: LoRAStats | None = None  # LoRA adapters (None unless enable_lora)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["kv"] = self.kv.as_dict()
        return d


def cache_report(stats: EngineStats) -> str:
    """A few readable lines on the prefix cache, tenants, pins and speculative decoding
    (``pagedkv generate --stats``)."""
    kv = stats.kv
    q = kv.prefix_query_tokens
    lines = [f"prefix cache: {kv.prefix_hit_tokens}/{q} prompt tokens hit ({kv.prefix_hit_rate:.1%}); "
             f"per tier: " + ", ".join(f"{t} {n}" for t, n in kv.tier_hit_tokens.items()) + " tokens"]
    if kv.first_misses:
        reasons = sorted(((sum(per.values()), reason) for reason, per in kv.first_misses.items()), reverse=True)
        lines.append("first miss per request: " + ", ".join(f"{reason} {n}" for n, reason in reasons))
    for tenant, (held, cached, limit) in kv.tenants.items():
        waits = kv.tenant_quota_waits.get(tenant, 0)
        lines.append(f"tenant {tenant}: {held} blocks held ({cached} cached), quota "
                     f"{limit if limit is not None else 'none'}, {waits} allocations refused by it")
    if kv.pins or kv.pins_expired or kv.pins_replaced or kv.pins_released_under_pressure:
        lines.append(f"conversation pins: {kv.pins} holding {kv.pinned_blocks} blocks; {kv.pins_expired} expired, "
                     f"{kv.pins_replaced} replaced, {kv.pins_released_under_pressure} released under pressure")
    if stats.spec_accepted_per_position:  # speculative decoding is on
        lines.append(f"speculative decoding: {stats.spec_accepted_tokens}/{stats.spec_draft_tokens} proposed tokens "
                     f"accepted ({stats.spec_acceptance_rate:.1%}) over {stats.spec_num_drafts} verifications, "
                     f"{stats.spec_mean_accepted_length:.2f} tokens each")
    return "\n".join(lines)
