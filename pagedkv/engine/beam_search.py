"""Native beam search: beams are sequences of one group that share blocks through forks.

Each step every live beam proposes its ``2 * beam_width`` most likely next tokens; all proposals
are ranked by cumulative log-probability. A proposal ending in EOS becomes a finished
hypothesis; the best ``beam_width`` others become the next beams. A parent chosen k times is
kept once and forked k-1 times (the children share its blocks copy-on-write); a parent not
chosen is freed. After ``max_tokens`` steps the live beams finish too, and the ``beam_width``
best hypotheses by length-penalised score are returned.
"""

from __future__ import annotations

from typing import NamedTuple

from pagedkv.engine.sequence import Sequence


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
