"""Token sampling from logits: greedy, temperature, top-k, top-p, min-p, seeds and logprobs.

Each row to sample names its logits row, its SamplingParams and its own random generator (for
seeded requests), so a seeded request draws the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.outputs import Logprob
from pagedkv.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleRow:
    row: int                       # index into the logits
    params: SamplingParams
    generator: torch.Generator | None


@dataclass(slots=True)
class Sampled:
    token: int
    logprob: float | None = None                  # of the chosen token (when asked)
    top: dict[int, Logprob] | None = None          # chosen + top-k alternatives (when asked)


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    return g


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.default_generator = make_generator(seed)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[Sampled]:
        """One token per row. ``logits``: float32 ``[num_rows_in_step, vocab]``."""
        if not rows:
            return []
        greedy_rows = [r.row for r in rows if r.params.temperature == 0.0]
        greedy = {}
        if greedy_rows:
            idx = torch.tensor(greedy_rows)
            greedy = dict(zip(greedy_rows, logits.index_select(0, idx).argmax(-1).tolist()))
        out = []
        for r in rows:
            p = r.params
            if p.temperature == 0.0:
                token = greedy[r.row]
            else:
                probs = _filtered_probs(logits[r.row], p)
                g = r.generator or self.default_generator
                token = int(torch.multinomial(probs, 1, generator=g).item())
            out.append(_with_logprobs(logits[r.row], token, p.logprobs) if p.logprobs is not None
                       else Sampled(token))
        return out


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    x = logits / p.temperature  # [vocab]
    if p.top_k > 0 and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p) >= p.top_p  # keep the smallest prefix reaching top_p (>= 1 token)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return probs


def _with_logprobs(logits: torch.Tensor, token: int, k: int) -> Sampled:
    lp = torch.log_softmax(logits, dim=-1)  # the model's distribution, before sampling filters
    chosen = float(lp[token])
    rank = int((lp > lp[token]).sum()) + 1
    top = {token: Logprob(chosen, rank)}
    if k:
        values, ids = torch.topk(lp, k)
        for i, (v, t) in enumerate(zip(values.tolist(), ids.tolist())):
            top.setdefault(t, Logprob(v, i + 1))
    return Sampled(token, chosen, top)


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Top-k log-probabilities and token ids of each row (beam search's candidates)."""
    values, ids = torch.topk(torch.log_softmax(logits, dim=-1), k, dim=-1)
    return values.tolist(), ids.tolist()
