"""Token sampling from logits: penalties and logit_bias, greedy, temperature, top-k, top-p, min-p,
seeds and logprobs.

Each row to sample names its logits row, its SamplingParams and its own random generator (for
seeded requests), so a seeded request draws the same tokens whatever else is in the batch, and
its sequence's token ids (prompt + output) for the penalties.

Penalties (vLLM v1's order): ``logit_bias`` is added, then ``repetition_penalty``, then
``frequency_penalty`` and ``presence_penalty`` (:func:`apply_penalties`), for all the rows that
use one at once; rows that use none are not touched (nor copied). Greedy rows are penalized too.
Log-probabilities are those of the model's own logits, before penalties and temperature (vLLM
v1's default ``logprobs_mode="raw_logprobs"``).

Structured output: a row with a ``bitmask`` (its grammar's allowed tokens) gets -inf elsewhere,
after the penalties, in the same batched pass over the copied rows (engine/structured_output.py).

Numeric guards, for every valid parameter and any logits a model can produce:

- NaN logits count as -inf; in a row holding +inf, exactly the +inf tokens are candidates
  (equally likely); a row with no finite or +inf value raises :class:`SamplingError` for that
  row alone.
- Temperature is applied as ``(logits - max) / temperature`` in float64: every value is <= 0
  with 0 at the maximum, so no temperature in (0, inf) can overflow, and a subnormal one is
  simply greedy-with-ties.
- Log-probabilities are finite: -inf (a token the model rules out) is reported as
  :data:`MIN_LOGPROB`, as JSON has no infinities.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedkv.errors import PagedKVError
from pagedkv.outputs import Logprob
from pagedkv.sampling.bitmask import apply_bitmask
from pagedkv.sampling_params import SamplingParams

MIN_LOGPROB = -9999.0  # the log-probability reported for a token of probability 0


class SamplingError(PagedKVError, RuntimeError):
    """One row's logits cannot be sampled (all NaN or -inf); the request fails, not the batch."""


@dataclass(slots=True)
class SampleRow:
    row: int                       # index into the logits
    params: SamplingParams
    generator: torch.Generator | None
    token_ids: Sequence[int] = ()  # the sequence's prompt + output so far (read for penalties only)
    prompt_len: int = 0            # token_ids[:prompt_len] is the prompt
    # structured output: the allowed tokens (int32 [words]; token t is bit t % 32 of word t // 32)
    bitmask: torch.Tensor | None = None
    # params.logit_bias as a dense [vocab] vector (logit_bias_vector), built once per request and
    # shared by its rows; None: built here from params.logit_bias (once per step)
    bias: torch.Tensor | None = None

    @property
    def processed(self) -> bool:
        """Its logits need work before sampling (penalties or a structured-output mask)."""
        return self.params.uses_penalties or self.bitmask is not None


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
    def prepare(self, logits: torch.Tensor, rows: list[SampleRow]) -> SampleBatch:
        """Sanitize ``logits`` (float32 ``[num_rows_in_step, vocab]``) once, apply the penalties and
        structured-output masks of the rows that use them (one batched pass over a copy of their
        rows) and take every greedy row's argmax in one call; then :meth:`SampleBatch.sample`
        draws one row at a time. Rows that use neither are not copied."""
        logits = sanitize_logits(logits)
        penalized = [r for r in rows if r.processed]
        processed = None
        if penalized:
            mine = logits.index_select(0, torch.tensor([r.row for r in penalized]))  # a copy
            if any(r.params.uses_penalties for r in penalized):
                mine = sanitize_logits(apply_penalties(mine, penalized))  # a tiny penalty can make +inf
            masked = [j for j, r in enumerate(penalized) if r.bitmask is not None]
            if masked:
                idx = torch.tensor(masked)
                bitmasks = torch.stack([penalized[j].bitmask for j in masked])  # type: ignore[misc]  # masked: bitmask set
                mine[idx] = apply_bitmask(mine.index_select(0, idx), bitmasks)
            processed = mine
        greedy_rows = sorted({r.row for r in rows if r.params.temperature == 0.0 and not r.processed})
        greedy: dict[int, int] = {}
        if greedy_rows:  # every row greedy (the usual batch): argmax in place, no copy of [rows, vocab]
            picked = (logits if len(greedy_rows) == logits.shape[0]
                      else logits.index_select(0, torch.tensor(greedy_rows)))
            greedy = dict(zip(greedy_rows, argmax_rows(picked).tolist()))
        batch = SampleBatch(logits, greedy, self.default_generator, processed, penalized)
        if processed is not None:
            batch.processed_greedy = argmax_rows(processed).tolist()
        return batch

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[Sampled]:
        """One token per row; raises SamplingError for the first row that cannot be sampled."""
        batch = self.prepare(logits, rows)
        return [batch.sample(r) for r in rows]


@dataclass(slots=True)
class SampleBatch:
    logits: torch.Tensor              # sanitized: no NaN, no +inf (the model's: logprobs come from it)
    greedy: dict[int, int]            # row -> argmax, for rows sampled greedily without penalties
    default_generator: torch.Generator
    processed: torch.Tensor | None = None  # [len(penalized), vocab]: their logits after penalties and masks
    penalized: list[SampleRow] = field(default_factory=list)  # the rows that use penalties or a mask
    processed_greedy: list[int] = field(default_factory=list)  # argmax of each processed row
    _index: dict[int, int] = field(init=False, default_factory=dict)  # id(row) -> index in processed

    def __post_init__(self) -> None:
        # By identity: two SampleRows may share a logits row (the n forks of a prompt) yet not a
        # history. ``penalized`` keeps the rows alive, so their ids stay theirs.
        self._index = {id(r): j for j, r in enumerate(self.penalized)}

    def row_logits(self, r: SampleRow) -> torch.Tensor:
        """The logits ``r`` samples from: the model's row, or its row after penalties."""
        j = self._index.get(id(r))
        return self.logits[r.row] if j is None else self.processed[j]  # type: ignore[index]  # j: processed set

    @torch.inference_mode()
    def sample(self, r: SampleRow) -> Sampled:
        """Draw the token of one row; raises SamplingError if the row has no candidate."""
        raw = self.logits[r.row]
        j = self._index.get(id(r))
        row = raw if j is None else self.processed[j]  # type: ignore[index]  # j only for processed rows
        p = r.params
        if p.temperature == 0.0:
            token = self.greedy[r.row] if j is None else self.processed_greedy[j]
            if row[token] == float("-inf"):
                raise SamplingError(NO_CANDIDATE)
        else:
            probs = filtered_probs(row, p)
            token = int(torch.multinomial(probs, 1, generator=r.generator or self.default_generator).item())
        return self.result(r, token)

    def result(self, r: SampleRow, token: int) -> Sampled:
        """``token`` as row ``r``'s outcome, with the logprobs ``r`` asks for (speculative
        decoding picks some tokens itself: an accepted proposal, a resampled rejection)."""
        k = r.params.logprobs
        return _with_logprobs(self.logits[r.row], token, k) if k is not None else Sampled(token)


NO_CANDIDATE = "the model produced no finite logits for this request (all NaN or -inf)"


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Row i of ``logits`` (float32 ``[len(rows), vocab]``, modified in place) after ``rows[i]``'s
    ``logit_bias``, ``repetition_penalty``, ``frequency_penalty`` and ``presence_penalty``, in
    that order (vLLM v1's):

        x += bias[t]
        x = x / rep if x > 0 else x * rep              for t in the prompt or the output
        x -= frequency * count[t] + presence * (count[t] > 0)   (two steps; count: in the output)

    Batched: one scatter of every row's token ids builds the ``[rows, vocab]`` output counts.
    ``logit_bias`` is one dense vector per request (``SampleRow.bias``), added to all the rows
    that share it at once: no loop over its entries, however many (a bias over the whole
    vocabulary at n = 128 took minutes per request that way). Token ids outside the vocabulary are
    ignored here (the engine refuses such a logit_bias and such prompt ids at admission).
    """
    m, vocab = logits.shape
    biased: dict[int, tuple[torch.Tensor, list[int]]] = {}  # id(vector) -> (vector, its rows)
    for i, r in enumerate(rows):
        if r.params.logit_bias:
            vec = r.bias
            if vec is None or vec.shape[0] != vocab or vec.dtype != logits.dtype:
                vec = logit_bias_vector(r.params.logit_bias, vocab, logits.dtype)
            biased.setdefault(id(vec), (vec, []))[1].append(i)
    for vec, idx in biased.values():
        if len(idx) == 1:
            logits[idx[0]] += vec
        else:
            logits.index_add_(0, torch.tensor(idx), vec.expand(len(idx), vocab))
    rep = [r.params.repetition_penalty for r in rows]
    freq = [r.params.frequency_penalty for r in rows]
    pres = [r.params.presence_penalty for r in rows]
    use_rep, use_counts = any(x != 1.0 for x in rep), any(x != 0.0 for x in freq + pres)
    if not (use_rep or use_counts):
        return logits
    ids = [torch.as_tensor(r.token_ids, dtype=torch.long) if use_rep or _uses_counts(r.params)
           else torch.empty(0, dtype=torch.long) for r in rows]
    outputs = [t[r.prompt_len:] for t, r in zip(ids, rows)]
    counts = _bin_counts(outputs, m, vocab, logits.dtype)  # [m, vocab]
    if use_rep:
        seen = counts > 0
        prompts = [t[:r.prompt_len] for t, r in zip(ids, rows)]
        seen |= _bin_counts(prompts, m, vocab, logits.dtype) > 0
        # A penalty below the dtype's smallest normal number would round to 0 and turn -inf
        # (a grammar's masked token) into NaN; the clamp keeps every factor a positive number.
        info = torch.finfo(logits.dtype)
        factor = torch.tensor(rep, dtype=torch.float64).clamp_(info.tiny, info.max).to(logits.dtype)
        factor = torch.where(seen, factor[:, None], 1.0)
        penalized = torch.where(logits > 0, logits / factor, logits * factor)
        # An extreme penalty overflows a finite logit to +-inf; a grammar that allows only seen
        # tokens would then have no finite candidate left. A finite logit stays finite (the dtype's
        # largest magnitude); only what was already -inf (a masked token) stays -inf.
        logits = torch.where(torch.isfinite(logits), penalized.clamp(info.min, info.max), penalized)
    if use_counts:
        logits -= torch.tensor(freq, dtype=logits.dtype)[:, None] * counts
        logits -= torch.tensor(pres, dtype=logits.dtype)[:, None] * (counts > 0)
    return logits


def logit_bias_vector(bias: dict[int, float], vocab: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``bias`` ({token id: bias}) as a dense ``[vocab]`` vector, zero elsewhere (ids outside the
    vocabulary dropped). Adding it gives exactly what adding each entry did (x + 0 is x)."""
    vec = torch.zeros(vocab, dtype=dtype)
    ids = [t for t in bias if t < vocab]
    if ids:
        vec[torch.tensor(ids)] = torch.tensor([bias[t] for t in ids], dtype=dtype)
    return vec


def _uses_counts(p: SamplingParams) -> bool:
    return p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _bin_counts(ids: list[torch.Tensor], m: int, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """``[m, vocab]``: how often each token occurs in ``ids[i]`` (ids outside the vocabulary skipped)."""
    counts = torch.zeros(m, vocab, dtype=dtype)
    flat = torch.cat(ids)
    if flat.numel():
        row = torch.repeat_interleave(torch.arange(m), torch.tensor([len(t) for t in ids]))
        ok = (flat >= 0) & (flat < vocab)
        counts.view(-1).index_add_(0, (row * vocab + flat)[ok], torch.ones(int(ok.sum()), dtype=dtype))
    return counts


def argmax_rows(x: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """``x.argmax(-1)`` of ``x`` ``[rows, vocab]`` (no NaN; ties: the first maximum, as argmax), ~5x faster.

    Why: torch's CPU argmax is a scalar reduction, ~8 ns per value: ~13 ms for 32 rows of a 49k
    vocabulary (2.5 ms this way), a few percent of a decode step that does not need to be there.
    ``amax`` is vectorized, so take each ``chunk``'s maximum
    (a strided view, no copy), pick each row's first chunk holding the row's maximum, and
    search only that chunk for its first occurrence.
    """
    rows, vocab = x.shape
    chunks = vocab // chunk
    if chunks < 2 or x.stride(-1) != 1:
        return x.argmax(-1)
    peaks = x.as_strided((rows, chunks, chunk), (x.stride(0), chunk, 1)).amax(-1)  # [rows, chunks]
    if chunks * chunk < vocab:
        peaks = torch.cat((peaks, x[:, chunks * chunk:].amax(-1, keepdim=True)), dim=1)
    best = peaks.amax(-1, keepdim=True)  # [rows, 1]
    start = (peaks == best).int().argmax(-1) * chunk  # [rows]: the first chunk that holds it
    window = x.gather(1, (start.unsqueeze(1) + torch.arange(chunk)).clamp_(max=vocab - 1))
    return start + (window == best).int().argmax(-1)


def sanitize_logits(logits: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf; in a row with +inf values, those become 0 and every other value -inf.

    Returns ``logits`` itself (no copy) when every value is finite, the common case.
    """
    # A finite sum means every value is finite (inf and NaN propagate through a sum); the sum is
    # one vectorized pass, several times cheaper than isfinite(...).all() at a 50k vocabulary.
    # Finite values that overflow the sum take the full check below, which returns them unchanged.
    if bool(torch.isfinite(logits.sum())):
        return logits
    x = logits.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    pos = x == float("inf")
    rows = pos.any(dim=-1)
    if bool(rows.any()):
        x[rows] = torch.where(pos[rows], 0.0, float("-inf"))
    return x


def filtered_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The sampling distribution of one sanitized logits row (float64 ``[vocab]``).

    Raises SamplingError when the row has no finite value.
    """
    x = row.double()
    top = x.max()
    if top == float("-inf"):
        raise SamplingError(NO_CANDIDATE)
    x = (x - top) / p.temperature  # <= 0, exactly 0 at the maximum: exp cannot overflow
    if 0 < p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)  # the maximum contributes exp(0) = 1: the sum is >= 1
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p) >= p.top_p  # keep the smallest prefix reaching top_p (>= 1 token)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return probs


def _with_logprobs(row: torch.Tensor, token: int, k: int) -> Sampled:
    lp = torch.log_softmax(row, dim=-1).clamp_(min=MIN_LOGPROB)  # the model's distribution
    chosen = float(lp[token])
    rank = int((lp > lp[token]).sum()) + 1
    top = {token: Logprob(chosen, rank)}
    if k:
        values, ids = torch.topk(lp, min(k, lp.numel()))
        for i, (v, t) in enumerate(zip(values.tolist(), ids.tolist())):
            top.setdefault(t, Logprob(v, i + 1))
    return Sampled(token, chosen, top)


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[dict[int, Logprob]]:
    """Row i's log-probability and rank of ``tokens[i]``, plus its top-``k`` alternatives (prompt
    logprobs). ``logits``: ``[len(tokens), vocab]``; worked through in slices to bound memory."""
    out: list[dict[int, Logprob]] = []
    for start in range(0, len(tokens), _SLICE):
        lp = torch.log_softmax(sanitize_logits(logits[start:start + _SLICE]), dim=-1)
        lp = lp.clamp_(min=MIN_LOGPROB).nan_to_num_(nan=MIN_LOGPROB)  # a row without candidates
        wanted = torch.tensor(tokens[start:start + _SLICE])
        chosen = lp.gather(1, wanted[:, None])  # [m, 1]
        ranks = ((lp > chosen).sum(-1) + 1).tolist()
        tops = lp.topk(min(k, lp.shape[-1]), dim=-1) if k else None
        for i, (token, value) in enumerate(zip(wanted.tolist(), chosen.squeeze(1).tolist())):
            entry = {token: Logprob(value, ranks[i])}
            if tops is not None:
                for r, (v, t) in enumerate(zip(tops.values[i].tolist(), tops.indices[i].tolist())):
                    entry.setdefault(t, Logprob(v, r + 1))
            out.append(entry)
    return out


_SLICE = 256


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Top-k log-probabilities and token ids of each row (beam search's candidates)."""
    lp = torch.log_softmax(sanitize_logits(logits), dim=-1).clamp_(min=MIN_LOGPROB)
    values, ids = torch.topk(lp, k, dim=-1)
    return values.tolist(), ids.tolist()
