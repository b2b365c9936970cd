"""The engine's side of speculative decoding: who speculates, how far, and the counters.

After each step the engine asks :meth:`SpeculativeDecoder.propose` for proposals for every running
sequence whose next step is a decode; they are stored on the ``Sequence`` (``proposal``) and the
scheduler verifies them in the next step's batch, beside other requests' decodes and prefill
chunks. A sequence speculates unless its request opted out (``SamplingParams.speculative``),
uses beam search or structured output, or is backing off.

Back-off (``SpeculativeConfig.backoff``), per sequence: proposals rejected outright pause its
speculation for 1, 2, 4 .. 32 tokens (doubling while they keep failing, reset by an accepted
one), and its proposal length follows what it accepts (an average of accepted / proposed), so a
workload where guesses fail costs little more than no speculation at all.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv.sampling.rejection import verify as verify_proposal
from pagedkv.speculative.config import SpeculativeConfig
from pagedkv.speculative.ngram import propose_ngram

if TYPE_CHECKING:
    from pagedkv.sampling.sampler import SampleBatch, Sampled, SampleRow

logger = logging.getLogger(__name__)

MAX_PAUSE = 32      # tokens a sequence decodes without speculating, at most, after rejections
EMA_WEIGHT = 0.3    # weight of the latest step in a sequence's acceptance average


@dataclass(slots=True)
class SpeculativeState:
    """One sequence's back-off state (on ``Sequence.speculative``)."""

    acceptance: float = 1.0   # running average of accepted / proposed
    misses: int = 0           # proposals rejected outright in a row
    resume_at: int = 0        # speculate again once the sequence has this many tokens


@dataclass(frozen=True, slots=True)
class SpecCounters:
    num_drafts: int             # verifications: (sequence, step) pairs with a proposal
    num_draft_tokens: int       # tokens proposed
    num_accepted_tokens: int    # of those, accepted
    accepted_per_position: tuple[int, ...]  # accepted at proposal position 0, 1, ..

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification emits on average (accepted proposals + the target's own token)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpeculativeDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft=None) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.draft = draft  # a DraftModelProposer (method "draft_model"), else None: n-gram lookup
        self._drafts = 0
        self._draft_tokens = 0
        self._accepted = 0
        self._per_position = [0] * self.k

    # ------------------------------------------------------------------ proposing
    def propose(self, running, num_computed) -> None:
        """Set ``proposal`` on every live sequence of the ``running`` groups that speculates in its
        next step (``num_computed(seq_id)``: the KV written for it, from the memory core)."""
        wanted = []  # (group, seq, k)
        limit = self.config.disable_by_batch_size
        busy = limit is not None and sum(len(group.live_seqs) for group in running) >= limit
        for group in () if busy else running:  # a batch this large is busy enough: no proposals
            if not self.speculates(group):
                continue
            for seq in group.live_seqs:
                n = seq.num_tokens
                if num_computed(seq.seq_id) != n - 1:
                    continue  # still prefilling (or not back from a preemption)
                k = self._length(group, seq)
                if k > 0:
                    wanted.append((group, seq, k))
        if self.draft is not None:
            live = {seq.seq_id for group in running for seq in group.live_seqs}
            proposals = self.draft.propose(wanted, live)
        else:
            c = self.config
            proposals = {seq.seq_id: propose_ngram(seq.token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)
                         for _, seq, k in wanted}
        for _, seq, _ in wanted:
            found = proposals.get(seq.seq_id)
            if found:
                seq.proposal, seq.proposal_at = tuple(found), seq.num_tokens

    @staticmethod
    def speculates(group) -> bool:
        p = group.params
        return p.speculative and not group.beam_width and group.error is None and \
            (group.forked or p.n == 1) and all(s.grammar is None for s in group.seqs)

    def _length(self, group, seq) -> int:
        """How many tokens to propose for ``seq`` now (0: none)."""
        state = seq.speculative
        if state is None:
            state = seq.speculative = SpeculativeState()
        k = self.k
        if self.config.backoff:
            if seq.num_tokens < state.resume_at:
                return 0
            k = max(1, min(k, math.ceil(state.acceptance * k) + 1))
        # the target computes positions num_tokens - 1 .. num_tokens - 1 + k; each proposal that
        # could be accepted leaves room for the token after it
        remaining = group.max_tokens - seq.num_output_tokens
        return max(0, min(k, remaining - 1, self.max_model_len - seq.num_tokens))

    # ------------------------------------------------------------------ outcomes
    def verify(self, seq, batch: SampleBatch, rows: list[SampleRow], proposal: tuple[int, ...],
               append: Callable[[Sampled], None]) -> int:
        """Check ``seq``'s proposal against the target's rows (``sampling/rejection.py``), hand each
        token it yields to ``append`` (which appends it and runs the stop checks) until the
        sequence finishes, and record the outcome. Returns how many of the chunk's tokens keep
        their KV: the last token and the accepted proposals that were appended."""
        tokens, accepted = verify_proposal(batch, rows, proposal)
        appended = 0
        for sampled in tokens:
            append(sampled)
            appended += 1
            if seq.finish_reason is not None:
                break
        kept = 1 + min(accepted, appended)
        self.record(seq, len(proposal), accepted)
        return kept

    def record(self, seq, proposed: int, accepted: int) -> None:
        """A verification's outcome for ``seq``: ``accepted`` of ``proposed`` tokens."""
        self._drafts += 1
        self._draft_tokens += proposed
        self._accepted += accepted
        for i in range(accepted):
            self._per_position[i] += 1
        state = seq.speculative
        if state is None or not proposed:
            return
        state.acceptance += EMA_WEIGHT * (accepted / proposed - state.acceptance)
        if accepted:
            state.misses = 0
        else:
            state.misses += 1
            state.resume_at = seq.num_tokens + min(1 << (state.misses - 1), MAX_PAUSE)

    def counters(self) -> SpecCounters:
        return SpecCounters(self._drafts, self._draft_tokens, self._accepted, tuple(self._per_position))

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()
