"""Reload or recompute: the engine's measured costs, and the decisions taken with them.

The engine feeds in what it measures on its own machine: seconds per prompt token of its prefill
steps, seconds per block of its host copies (down: swap-outs and offloads; up: swap-ins and
reloads) and of the disk tier's reads. Each figure is an exponential moving average. The memory
core and the scheduler ask:

- ``reload_cheaper(tier, blocks)``: load a prefix found in ``tier`` ("host", "disk" or "remote") rather
  than recompute its tokens? Reading from disk also pays the host copy up.
- ``swap_cheaper(blocks, tokens)``: preempt by swap (copy down now, up later) rather than by
  recompute (prefill the sequence's tokens again)?

Before a figure is measured the answer is "reload" / "swap": on every machine measured so far a
block copy or read costs far less than recomputing its tokens, and the first reload measures it.
Every answer is counted in ``decisions``; ``as_dict()`` gives the inputs and counts for ``stats()``.
"""

from __future__ import annotations

from collections import Counter

HOST_READ = "host_read"  # host -> device, seconds per block
HOST_WRITE = "host_write"  # device -> host, seconds per block
DISK_READ = "disk_read"  # a block file read and checked, seconds per block
REMOTE_READ = "remote_read"  # a block read from the remote tier's server and checked, seconds per block
_READS = {"disk": DISK_READ, "remote": REMOTE_READ}  # a lower tier's read, before the host copy up


class TierCosts:
    def __init__(self, block_size: int, smoothing: float = 0.2) -> None:
        self.block_size = block_size
        self.smoothing = smoothing
        self.prefill_s_per_token: float | None = None
        self.s_per_block: dict[str, float | None] = {HOST_READ: None, HOST_WRITE: None, DISK_READ: None,
                                                     REMOTE_READ: None}
        self.decisions: Counter[str] = Counter()

    # ------------------------------------------------------------------ measurements
    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_s_per_token = self._mix(self.prefill_s_per_token, seconds / tokens)

    def observe(self, what: str, blocks: int, seconds: float) -> None:
        if blocks > 0 and seconds > 0:
            self.s_per_block[what] = self._mix(self.s_per_block[what], seconds / blocks)

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    # ------------------------------------------------------------------ decisions
    def reload_cheaper(self, tier: str, blocks: int, *, record: bool = True) -> bool:
        """Load ``blocks`` found in ``tier`` ("host", "disk" or "remote") instead of recomputing them.
        ``record=False`` asks without counting the decision (the caller counts it with
        :meth:`record` once the answer was acted on)."""
        cost = self.s_per_block
        read = cost[HOST_READ] if tier == "host" else _sum(cost[_READS[tier]], cost[HOST_READ])
        prefill = self.prefill_s_per_token
        cheaper = read is None or prefill is None or read < self.block_size * prefill
        if record:
            self.record(tier, cheaper)
        return cheaper

    def record(self, tier: str, reload: bool) -> None:
        """Count one reload-or-recompute decision for ``tier``."""
        self.decisions[f"{tier}_{'reload' if reload else 'recompute'}"] += 1

    def swap_cheaper(self, blocks: int, tokens: int) -> bool:
        """Preempt a sequence of ``blocks`` blocks holding ``tokens`` computed tokens by swap."""
        copy = _sum(self.s_per_block[HOST_WRITE], self.s_per_block[HOST_READ])
        prefill = self.prefill_s_per_token
        cheaper = copy is None or prefill is None or blocks * copy < tokens * prefill
        self.decisions[f"preempt_{'swap' if cheaper else 'recompute'}"] += 1
        return cheaper

    def as_dict(self) -> dict[str, float | int | None]:
        """The measured inputs (None until measured) and the decisions counted so far."""
        prefill = self.prefill_s_per_token
        out: dict[str, float | int | None] = {
            "prefill_tokens_per_s": None if prefill is None else 1.0 / prefill,
            "recompute_s_per_block": None if prefill is None else prefill * self.block_size}
        for what, cost in self.s_per_block.items():
            out[f"{what}_s_per_block"] = cost
        for name in ("host_reload", "host_recompute", "disk_reload", "disk_recompute", "remote_reload",
                     "remote_recompute", "preempt_swap", "preempt_recompute"):
            out[f"decisions_{name}"] = self.decisions[name]
        return out


def _sum(a: float | None, b: float | None) -> float | None:
    """A cost made of two parts; unknown (None) while either part is."""
    return None if a is None or b is None else a + b
