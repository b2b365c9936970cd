"""The scheduler's plan of one step (``SchedulerOutput``) and the engine's answer to it (``StepResult``).

    Scheduler.schedule() ──SchedulerOutput──> engine: runner copies + forward pass, StepUpdater
    Scheduler.update_from_output(plan, StepResult) <── the request state the update wrote

Frozen, typed messages between the parts, in a module of their own so the runner side, the step
update and the fault-injecting wrappers read them without importing the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.engine.sequence import Sequence, SequenceGroup
from pagedkv.engine.step_cost import StepWork
from pagedkv.memory import CopyPair

__all__ = ["ScheduledSeq", "SchedulerOutput", "StepResult"]


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One sequence's work in a step: compute ``num_tokens`` tokens from position ``start``.

    A speculating sequence's chunk is its last token and then its ``proposal`` (``num_tokens``
    counts both); the engine verifies the proposal against the chunk's logits and tells the
    update how many of the tokens to keep (``StepResult.spec_computed``)."""

    group: SequenceGroup
    seq: Sequence
    start: int
    num_tokens: int
    proposal: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token: its logits give the next token."""
        return self.start + self.num_tokens - len(self.proposal) == self.seq.num_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """The plan of one step. The runner serializes ``to_disk`` blocks, writes ``from_disk``
    payloads into host blocks, performs ``swap_out``, then ``swap_in``, then ``copies``
    (copy-on-write), then computes ``scheduled``.

    That order is safe because a copy's source is held by a sequence scheduled in this step
    (never freed or reused within it), a copy's destination may be a block just swapped out
    (its old contents are saved first), and a swapped-in block may be a copy's source.
    """

    scheduled: tuple[ScheduledSeq, ...]
    copies: tuple[CopyPair, ...] = ()
    swap_out: tuple[CopyPair, ...] = ()
    swap_in: tuple[CopyPair, ...] = ()
    preempted: tuple[str, ...] = ()
    resumed: tuple[str, ...] = ()  # request ids whose blocks come back by swap_in
    to_disk: tuple[tuple[int, bytes], ...] = ()  # (device block, key): serialize first, for the disk tier
    from_disk: tuple[tuple[int, bytes], ...] = ()  # (host block, payload) read from disk: before swap_in
    work: StepWork = field(default_factory=StepWork)  # what it computes, for the step-time fit

    @property
    def request_ids(self) -> set[str]:
        """Every request this plan touches (computes, swaps out or swaps in)."""
        return {s.group.request_id for s in self.scheduled} | set(self.preempted) | set(self.resumed)


@dataclass(slots=True, eq=False)
class StepResult:
    """What the engine made of one plan, for ``Scheduler.update_from_output``.

    The engine has already written the request state (tokens appended, finish reasons, errors on
    the ``Sequence``s and ``SequenceGroup``s it owns); this lists what the scheduler and the memory
    core must now do about it.
    """

    computed: bool = True  # False: the shared work failed, none of the plan's KV was written
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)  # (parent, new child)
    finished: list[tuple[SequenceGroup, Sequence]] = field(default_factory=list)  # finish_reason set
    failed: list[SequenceGroup] = field(default_factory=list)  # error set: end the whole request
    progressed: dict[str, SequenceGroup] = field(default_factory=dict)  # requests with new output
    # speculating sequences: seq_id -> tokens of the chunk whose KV is kept (the last token and the
    # accepted proposals); the slots of the rest are rolled back
    spec_computed: dict[str, int] = field(default_factory=dict)
