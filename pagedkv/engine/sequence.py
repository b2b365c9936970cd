"""Requests as the scheduler sees them: a group of sequences sharing one prompt.

A request with ``n`` completions (or ``beam_width`` beams) is one ``SequenceGroup``. It starts
with one sequence; after its prompt is computed the engine forks the others from it, so they all
share the prompt's blocks (copy-on-write). Scheduling is by counters: each sequence computes
tokens until ``num_computed == num_tokens``; a prefill chunk, a prefix-cache hit and a recompute
after preemption are all just different starting values of ``num_computed``.

Ownership: these objects own the request state (token ids, finish and stop reasons, text,
logprobs, errors); the engine writes them. How many tokens' KV is written is the memory core's
(``KVCacheManager.num_computed``), which reads ``Sequence.token_ids`` without copying it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedkv.sampling_params import SamplingParams

if TYPE_CHECKING:  # types only: this module stays pure Python, like the scheduler that imports it
    import torch

    from pagedkv.engine.structured_output import GrammarState
    from pagedkv.speculative.decoder import SpeculativeState


class GroupStatus(enum.Enum):
    WAITING = "waiting"    # not on the device: new, or preempted by recompute
    RUNNING = "running"    # has device blocks
    SWAPPED = "swapped"    # blocks on the host tier
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: str
    index: int                # completion index within the request (0 .. n-1)
    prompt_len: int
    token_ids: list[int]      # prompt + generated (the memory core reads this very list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output_text: str = ""
    text_tokens: int = -1     # output tokens that output_text was decoded from
    # incremental detokenization (OutputProcessor.decode): output_text ends with the text of the
    # output tokens before read_offset; the tokens from prefix_offset on are decoded again to
    # extend it (their first token gives the context that spacing and multi-byte characters need)
    prefix_offset: int = 0
    read_offset: int = 0
    logprobs: list | None = None
    cumulative_logprob: float = 0.0
    rng: torch.Generator | None = None  # per-sequence random generator for seeded sampling
    grammar: GrammarState | None = None  # structured output: advanced by each appended token
    # speculative decoding (pagedkv/speculative): tokens proposed to follow token_ids[:proposal_at] (the
    # scheduler verifies them only while proposal_at == num_tokens), and the back-off state
    proposal: tuple[int, ...] = ()
    proposal_at: int = -1
    speculative: SpeculativeState | None = None  # back-off state (pagedkv.speculative.decoder)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def live_proposal(self) -> tuple[int, ...]:
        """The proposal for the tokens as they are now (empty once tokens were added since)."""
        return self.proposal if self.proposal_at == len(self.token_ids) else ()


@dataclass(slots=True, eq=False)
class SequenceGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int              # admission order (ties broken by it after priority)
    priority: int = 0         # lower runs first; the highest value is preempted first
    salt: str | None = None
    tenant: str | None = None  # whose KV quota it counts against (memory/tenant_ledger.py); None: the default
    conversation_id: str | None = None  # its prefix stays pinned pin_ttl_s after it finishes (memory/pins.py)
    pin_ttl_s: float = 0.0
    max_tokens: int = 16      # resolved limit on generated tokens
    beam_width: int = 0       # > 0: native beam search (see engine.beam_search)
    length_penalty: float = 1.0
    seqs: list[Sequence] = field(default_factory=list)
    status: GroupStatus = GroupStatus.WAITING
    forked: bool = False      # children created after the prompt was computed
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first admission
    cache_details: Any = None  # memory.miss_reasons.CacheDetails of that admission
    finished_seqs: list[Sequence] = field(default_factory=list)  # beams that ended (beam search)
    beam_candidates: dict[str, tuple[list[float], list[int]]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    # params.logit_bias as one dense [vocab] vector (sampler.logit_bias_vector), built at its first
    # sampling and reused every step by every fork, so no step loops over the bias's entries
    logit_bias_vector: Any = None
    error: str | None = None  # why the engine failed this request (it then finishes at once)
    prompt_logprobs: list | None = None  # [None, {token: Logprob}, ...] as far as computed
    num_preemptions: int = 0
    preempted_at: int = -1    # total_tokens at the last preemption (the thrash guard's mark)
    # LoRA: the adapter computing this request (lora.adapter.LoRAWeights, None: the base model) and
    # its identity in the prefix cache (name + digest of its weights), which keys the block hashes
    lora: Any = None
    lora_key: str | None = None

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival)

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.finish_reason is None]

    @property
    def num_live(self) -> int:
        return sum(1 for s in self.seqs if s.finish_reason is None)

    @property
    def total_tokens(self) -> int:
        """Tokens over every sequence, finished ones included: grows whenever the request progresses."""
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def preemption_guarded(self) -> bool:
        """Preempted and no token sampled since: the scheduler does not pick it as a victim again
        (a thrash guard) while another choice exists."""
        return self.preempted_at >= 0 and self.total_tokens == self.preempted_at

    @property
    def width(self) -> int:
        """Sequences this group will hold once forked."""
        return self.beam_width or self.params.n

    @property
    def is_finished(self) -> bool:
        return self.status is GroupStatus.FINISHED
