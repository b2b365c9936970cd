"""Exact verification of proposed tokens against the target model's logits.

A speculating sequence's chunk is its last token followed by proposals ``d_1 .. d_k``; the
target's logits row ``j`` is its distribution ``p_j`` for the token after ``d_1 .. d_j`` (row 0:
after the last token). Proposals are accepted in order while they pass; the first that fails is
replaced by a token drawn from what the check leaves, and when all pass, row k gives one more
(the bonus token). Either way the step emits 1 to k + 1 tokens.

- Greedy rows: ``d_j`` passes when it is row ``j - 1``'s token (argmax, after penalties). The
  output is token for token that of decoding without proposals.
- Sampled rows: every proposer here proposes one token per position (a point mass ``q``), so
  rejection sampling (Leviathan et al., 2023; Chen et al., 2023) reads: accept ``d`` with
  probability ``p(d)``; on rejection draw from ``p`` with ``d`` removed, renormalized. Then
  ``P(x) = p(d) [x = d] + (1 - p(d)) p(x) [x != d] / (1 - p(d)) = p(x)``: each emitted token has
  exactly the target's distribution (temperature, top-k, top-p, min-p and penalties applied as
  in ordinary sampling), and the uniform draws come from the sequence's own generator, so a
  seeded request is reproducible.
"""

from __future__ import annotations

import torch

from pagedkv.sampling.sampler import SampleBatch, Sampled, SampleRow, SamplingError, filtered_probs


@torch.inference_mode()
def verify(batch: SampleBatch, rows: list[SampleRow],
           proposal: tuple[int, ...] | list[int]) -> tuple[list[Sampled], int]:
    """The tokens to emit for one sequence and how many proposals were accepted.

    ``rows[j]`` samples logits row ``j`` of the sequence's chunk (``len(rows) == len(proposal) + 1``),
    each with the context of the proposals before it for penalties. Raises SamplingError when a
    row has no candidate."""
    out: list[Sampled] = []
    for j, d in enumerate(proposal):
        r = rows[j]
        if r.params.temperature == 0.0:
            s = batch.sample(r)
            out.append(s)
            if s.token != d:
                return out, j
            continue
        probs = filtered_probs(batch.row_logits(r), r.params)
        gen = r.generator or batch.default_generator
        p_d = float(probs[d]) if 0 <= d < probs.numel() else 0.0
        if float(torch.rand((), dtype=torch.float64, generator=gen)) < p_d:
            out.append(batch.result(r, d))
            continue
        rest = probs.clone()
        if 0 <= d < rest.numel():
            rest[d] = 0.0
        total = float(rest.sum())
        if not total > 0.0:  # p(d) == 1 is always accepted; only a row without candidates gets here
            raise SamplingError("speculative decoding: no token left to draw after a rejection")
        token = int(torch.multinomial(rest / total, 1, generator=gen).item())
        out.append(batch.result(r, token))
        return out, j
    out.append(batch.sample(rows[len(proposal)]))
    return out, len(proposal)
