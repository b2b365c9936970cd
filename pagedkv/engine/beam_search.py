"""Native beam search: beams are sequences of one group that share blocks through forks.

Each step every live beam proposes its ``2 * beam_width`` most likely next tokens; all proposals
are ranked by cumulative log-probability. A proposal ending in EOS becomes a finished
hypothesis; the best ``beam_width`` others become the next beams. A parent chosen k times is
kept once and forked k-1 times (the children share its blocks copy-on-write); a parent not
chosen is freed. After ``max_tokens`` steps the live beams finish too, and the ``beam_width``
best hypotheses by length-penalised score are returned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from pagedkv.engine.scheduler_output import StepResult
from pagedkv.engine.sequence import Sequence, SequenceGroup
from pagedkv.sampling.sampler import NO_CANDIDATE, SamplingError, top_logprobs


class Proposal(NamedTuple):
    parent: Sequence
    token: int
    cumulative_logprob: float


def select_beams(beams: list[Sequence], candidates: dict[str, tuple[list[float], list[int]]],
                 width: int, eos_token_ids: frozenset[int], ignore_eos: bool
                 ) -> tuple[list[Proposal], list[Proposal]]:
    """(next beams, finished hypotheses) from every beam's top candidates.

    Ties are broken by beam order then candidate rank, so the result is deterministic.
    """
    proposals = []
    for order, beam in enumerate(beams):
        values, ids = candidates[beam.seq_id]
        for rank, (lp, tok) in enumerate(zip(values, ids)):
            cum = beam.cumulative_logprob + lp
            proposals.append((cum, order, rank, Proposal(beam, tok, cum)))
    proposals.sort(key=lambda p: (-p[0], p[1], p[2]))
    live, done = [], []
    for *_, prop in proposals:
        if not ignore_eos and prop.token in eos_token_ids:
            done.append(prop)
        else:
            live.append(prop)
    return live[:width], done


class BeamSearch:
    """The engine's beam search over one step's logits: each beam request's candidates, then (once
    every beam of a request is computed) the next beams, forks and finished hypotheses.

    It writes the request state of beam requests (tokens, cumulative log-probabilities, finish
    reasons, hypotheses) and lists what the update must do in the ``StepResult``; forking (which
    gives a child a sequence id, a generator and its parent's blocks) is the caller's ``fork``.
    """

    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int,
                 num_computed: Callable[[str], int]) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.num_computed = num_computed  # the memory core's: tokens whose KV is written

    def take_candidates(self, logits: torch.Tensor, beam_rows: list[tuple[int, SequenceGroup, Sequence]]) -> None:
        """Each beam's ``2 * beam_width`` best next tokens from its logits row (shared work: one
        call for every beam row of the step)."""
        k = max(2 * g.beam_width for _, g, _ in beam_rows)
        values, ids = top_logprobs(logits[[i for i, _, _ in beam_rows]], min(k, logits.shape[-1]))
        for (_, group, seq), v, t in zip(beam_rows, values, ids):
            group.beam_candidates[seq.seq_id] = (v[:2 * group.beam_width], t[:2 * group.beam_width])

    def ready(self, group: SequenceGroup, beams: list[Sequence], planned: dict[str, int]) -> bool:
        """Every live beam has its candidates and its KV computed (earlier steps' count plus this
        plan's tokens, ``planned``): the request advances."""
        return all(b.seq_id in group.beam_candidates
                   and self.num_computed(b.seq_id) + planned.get(b.seq_id, 0) == b.num_tokens
                   for b in beams)

    def advance(self, group: SequenceGroup, beams: list[Sequence], step: StepResult,
                fork: Callable[[SequenceGroup, Sequence, StepResult], Sequence]) -> int:
        """Move ``group`` one token on: the next beams (forked where a parent is chosen more than
        once, finished where not chosen), finished hypotheses, the length limits. Returns the
        tokens appended; raises SamplingError when a candidate is NaN."""
        if any(x != x for v, _ in group.beam_candidates.values() for x in v):
            raise SamplingError(NO_CANDIDATE)
        live, done = select_beams(beams, group.beam_candidates, group.beam_width,
                                  self.eos_token_ids, group.params.ignore_eos)
        group.beam_candidates.clear()
        for prop in done:  # finished hypotheses hold no blocks
            hyp = Sequence(f"{group.request_id}#h{len(group.finished_seqs)}", -1, prop.parent.prompt_len,
                           prop.parent.token_ids + [prop.token], finish_reason="stop")
            hyp.cumulative_logprob = prop.cumulative_logprob
            group.finished_seqs.append(hyp)
        used: set[str] = set()
        assignments = []
        for prop in live:  # the first use of a parent keeps it; later uses fork it
            child = prop.parent if prop.parent.seq_id not in used else fork(group, prop.parent, step)
            used.add(prop.parent.seq_id)
            assignments.append((child, prop))
        for beam in beams:
            if beam.seq_id not in used:
                beam.finish_reason = "pruned"
                step.finished.append((group, beam))
        for child, prop in assignments:
            child.token_ids.append(prop.token)
            child.cumulative_logprob = prop.cumulative_logprob
        for child, _ in assignments:
            if child.num_output_tokens >= group.max_tokens or child.num_tokens >= self.max_model_len:
                child.finish_reason = "length"
                group.finished_seqs.append(child)
                step.finished.append((group, child))
        return len(assignments)
