"""LoRAStats: the adapters' figures in an engine snapshot (pure Python; EngineStats carries it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LoRAStats:
    max_loras: int
    running: tuple[str, ...] = ()  # adapters of the running requests, by name
    waiting: tuple[str, ...] = ()  # adapters of waiting (or swapped-out) requests
    requests: dict[str, int] = field(default_factory=dict)  # requests admitted per adapter since start
    slot_loads: int = 0  # adapters copied into a slot since start
