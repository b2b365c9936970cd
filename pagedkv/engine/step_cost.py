"""What a step costs in seconds: the estimate the scheduler plans with, fitted to measured steps.

A step's time grows with five things it computes (``StepWork``)::

    seconds ~ overhead                          once per step (planning, launching, bookkeeping)
            + per_token     * tokens            every token through the layers' weights
            + per_attended  * attended          (query, key) pairs: a chunk of c tokens from
                                                position p attends c*p + c*(c+1)/2 of them
            + per_row       * rows              logits rows sampled (the LM head, the sampler;
                                                each of a prompt's n forks is a row)
            + per_processed * processed         of those, rows whose logits are processed
                                                (penalties, a logit_bias vector, a grammar mask)

Why not tokens alone: attention grows with the context a chunk attends to, so a 2,048-token chunk
at position 7,000 costs several times one at position 0; a token budget that is right for short
prompts freezes every stream beside a long one (issue 27: a 42.7 s gap). Planning by seconds
makes the chunks of a long prompt shrink as it grows, and counts a fan-out request's rows.
A chunk estimated at more than ``TRUSTED_SHARE`` of the budget never asks more than ``GROWTH``
times the tokens and attended pairs of the largest step measured so far: on a new engine, or
past anything it has run, long chunks grow geometrically while the fit learns, instead of
betting a whole step on an extrapolation.

The prior comes from the model's shape (FLOPs per token, per attended pair, per LM-head row) at a
deliberately low CPU rate, so that an engine's first chunks err small; the overhead includes
reading every weight once (a decode is bound by it). Each measured step then refits the five
coefficients: least squares on the relative error (a 10 ms decode and a 3 s prefill weigh
alike), old steps forgotten geometrically, and a ridge pulling each coefficient, in proportion
to what the steps say about it, toward the prior's proportions at the fitted common scale, so a
feature a workload never varies (no processed rows, say) keeps a sensible value. A coefficient
never leaves [1/50, 50] times its share of that scale. Checked against measured steps of the
default model (tests/engine/test_step_budget.py): within 1.5x at the median, 2x for nine steps in ten.
Pure Python: ~25 multiply-adds per observed step, a 5x5 solve every ``REFIT_EVERY`` steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FEATURES = ("overhead", "tokens", "attended", "rows", "processed")
REFIT_EVERY = 4          # observations between two refits
PREFILL_FLOOR = 0.25     # share of the step budget one prefill chunk may always take (progress)
WAITING_SHARE = 0.5      # share of the budget running prefills leave to a waiting request
GROWTH = 2.0             # a chunk may ask this many times the largest work measured so far
EXPLORE_TOKENS = 32      # ... and at least this many tokens (a new engine's first chunks)
TRUSTED_SHARE = 0.1      # ... unless its estimate is under this share of the step budget
# The prior's rates: low on purpose (first chunks err small); measured steps replace them.
_WEIGHT_FLOPS_PER_S = 2e10
_ATTENTION_FLOPS_PER_S = 5e9
_SAMPLE_S_PER_ROW = 2e-4
_PROCESS_S_PER_VOCAB = 2e-9
_OVERHEAD_S = 5e-3
_WEIGHT_BYTES_PER_S = 1e10  # a step reads every weight once (2 bytes each assumed): a decode's floor


@dataclass(slots=True)
class StepWork:
    """What one step computes (see the module docstring); the scheduler fills it as it plans."""

    tokens: int = 0
    attended: int = 0
    rows: int = 0
    processed: int = 0

    def add(self, start: int, num_tokens: int, rows: int = 0, processed: int = 0) -> None:
        """A chunk of ``num_tokens`` tokens from position ``start``, sampling ``rows`` rows."""
        self.tokens += num_tokens
        self.attended += num_tokens * start + num_tokens * (num_tokens + 1) // 2
        self.rows += rows
        self.processed += processed

    def features(self) -> tuple[float, float, float, float, float]:
        return (1.0, float(self.tokens), float(self.attended), float(self.rows), float(self.processed))


def prior_coefficients(shape: object | None) -> tuple[float, float, float, float, float]:
    """Seconds per unit of each feature, from a model shape (``model_shape.ModelShape``: its
    ``hidden_size``, ``intermediate_size``, layers, heads, ``vocab_size``); a ~100M-parameter
    model's figures when the shape is unknown (test doubles of the runner)."""
    h = getattr(shape, "hidden_size", 576)
    inter = getattr(shape, "intermediate_size", 1536)
    layers = getattr(shape, "num_hidden_layers", 30)
    heads = getattr(shape, "num_attention_heads", 9)
    kv_heads = getattr(shape, "num_key_value_heads", heads) or heads
    head_dim = getattr(shape, "head_dim", None) or h // max(heads, 1)
    vocab = getattr(shape, "vocab_size", 49152)
    q, kv = heads * head_dim, kv_heads * head_dim
    flops_token = 2 * layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)
    flops_pair = 4 * layers * heads * head_dim  # q.k and p.v
    weight_bytes = 2 * (flops_token // 2 + h * vocab)
    return (_OVERHEAD_S + weight_bytes / _WEIGHT_BYTES_PER_S, flops_token / _WEIGHT_FLOPS_PER_S,
            flops_pair / _ATTENTION_FLOPS_PER_S, 2 * h * vocab / _WEIGHT_FLOPS_PER_S + _SAMPLE_S_PER_ROW,
            vocab * _PROCESS_S_PER_VOCAB)


class StepCostModel:
    """The step-time estimate (``estimate``, ``max_tokens``) and its fit to measured steps
    (``observe``). ``error`` is the mean ratio max(measured/estimated, estimated/measured) over
    the observed steps (each estimated before it was observed); ``as_dict()`` reports it."""

    def __init__(self, prior: tuple[float, ...], max_step_time_s: float | None = None, *,
                 forgetting: float = 0.95, ridge: float = 0.05, growth: float | None = GROWTH) -> None:
        if len(prior) != len(FEATURES) or not all(p > 0 for p in prior):
            raise ValueError(f"prior must be {len(FEATURES)} positive seconds per unit, got {prior!r}")
        self.max_step_time_s = max_step_time_s or None  # EngineConfig's (0: no time limit)
        self.prior = tuple(float(p) for p in prior)
        self.coef = list(self.prior)
        self.forgetting = forgetting
        self.ridge = ridge
        k = len(FEATURES)
        self._A = [[0.0] * k for _ in range(k)]  # sum of r r^T, r = prior-scaled features / seconds
        self._b = [0.0] * k                     # sum of r
        self.observed = 0
        # the largest work measured so far: a chunk may ask ``growth`` times as much, no more
        self.growth = growth
        self.max_tokens_seen = 0
        self.max_attended_seen = 0
        self._error_sum = 0.0

    @classmethod
    def for_model(cls, shape: object | None, max_step_time_s: float | None = None) -> StepCostModel:
        return cls(prior_coefficients(shape), max_step_time_s)

    def budget(self) -> StepBudget:
        """A new step's budget of ``max_step_time_s`` seconds."""
        return StepBudget(self, self.max_step_time_s)

    # ------------------------------------------------------------------ estimates
    def estimate(self, work: StepWork) -> float:
        """Seconds the step ``work`` describes should take."""
        c = self.coef
        return (c[0] + c[1] * work.tokens + c[2] * work.attended + c[3] * work.rows
                + c[4] * work.processed)

    def chunk_seconds(self, start: int, num_tokens: int, rows: int = 0, processed: int = 0) -> float:
        """Seconds a chunk adds to a step (no per-step overhead)."""
        c = self.coef
        return (c[1] * num_tokens + c[2] * (num_tokens * start + num_tokens * (num_tokens + 1) / 2)
                + c[3] * rows + c[4] * processed)

    def explored_tokens(self, start: int) -> int:
        """The most tokens a chunk from ``start`` may hold without asking more than ``growth``
        times the tokens and attended pairs of any step measured so far (at least EXPLORE_TOKENS
        tokens): the fit is trusted near what it has seen, and a long prompt's first chunks on a
        new engine grow geometrically instead of betting a whole step on the prior."""
        if self.growth is None:
            return 1 << 30
        tokens = max(EXPLORE_TOKENS, int(self.growth * self.max_tokens_seen))
        pairs = max(EXPLORE_TOKENS * (EXPLORE_TOKENS + 1) // 2, self.growth * self.max_attended_seen)
        # the largest n with n * start + n (n + 1) / 2 <= pairs
        b = start + 0.5
        by_pairs = int(math.sqrt(b * b + 2 * pairs) - b)
        return max(1, min(tokens, by_pairs))

    def max_tokens(self, start: int, seconds: float, rows: int = 0, processed: int = 0) -> int:
        """The most tokens a chunk from ``start`` may hold to add at most ``seconds`` (0 when
        not even one fits): the root of a/2 n^2 + (t + a (start + 1/2)) n + fixed = seconds."""
        c = self.coef
        room = seconds - c[3] * rows - c[4] * processed
        if room <= 0:
            return 0
        a, lin = c[2], c[1] + c[2] * (start + 0.5)
        n = room / lin if a <= 0 else (math.sqrt(lin * lin + 2 * a * room) - lin) / a
        return int(n) if n < 1 << 30 else 1 << 30

    # ------------------------------------------------------------------ measurements
    def observe(self, work: StepWork, seconds: float) -> None:
        """Fit the step ``work`` that took ``seconds``."""
        if seconds <= 0 or work.tokens + work.rows == 0:
            return
        guess = self.estimate(work)
        self._error_sum += max(seconds / guess, guess / seconds)
        r = [x * p / seconds for x, p in zip(work.features(), self.prior)]
        lam, A, b = self.forgetting, self._A, self._b
        for i, ri in enumerate(r):
            row = A[i]
            for j, rj in enumerate(r):
                row[j] = lam * row[j] + ri * rj
            b[i] = lam * b[i] + ri
        self.observed += 1
        self.max_tokens_seen = max(self.max_tokens_seen, work.tokens)
        self.max_attended_seen = max(self.max_attended_seen, work.attended)
        if self.observed <= REFIT_EVERY or self.observed % REFIT_EVERY == 0:
            self._refit()

    def _refit(self) -> None:
        """min sum (m.r - 1)^2 + sum_i ridge * A_ii * (m_i - s)^2, s: the best common scale."""
        A, b, k = self._A, self._b, len(FEATURES)
        total = sum(sum(row) for row in A)
        if total <= 0:
            return
        s = sum(b) / total  # every m_i = s: the prior's proportions at the measured speed
        # each coefficient pulled in proportion to what the steps say about it (a decode-heavy
        # workload still fits the overhead), one never varied by a trace's hair
        floor = 1e-6 * sum(A[i][i] for i in range(k)) / k
        lam = [self.ridge * A[i][i] + floor for i in range(k)]
        M = [[A[i][j] + (lam[i] if i == j else 0.0) for j in range(k)] + [b[i] + lam[i] * s] for i in range(k)]
        m = _solve(M)
        if m is None:
            m = [s] * k
        self.coef = [min(max(mi, s / 50), s * 50) * p for mi, p in zip(m, self.prior)]

    @property
    def error(self) -> float | None:
        return self._error_sum / self.observed if self.observed else None

    def as_dict(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {f"s_per_{name}": c for name, c in zip(FEATURES, self.coef)}
        out["steps_observed"] = self.observed
        out["mean_error_factor"] = self.error
        return out


class StepBudget:
    """One step's seconds of prefill as the scheduler spends them (``seconds`` None: no time
    limit, only the token budget). Decode rows always run and are not charged to it (a stream
    waits for the decodes of every stream anyway; charging them would only slow admissions
    beside a full batch); prefill chunks take what is left (less a ``reserve`` for a waiting
    request), the step's first at least ``PREFILL_FLOOR`` of the budget."""

    def __init__(self, model: StepCostModel, seconds: float | None) -> None:
        self.model = model
        self.seconds = seconds
        self.left = math.inf if seconds is None else seconds - model.coef[0]
        self.work = StepWork()
        self._floor_taken = False

    def charge(self, start: int, num_tokens: int, rows: int = 0, processed: int = 0, *,
               prefill: bool | None = None) -> None:
        """Count a chunk in the step's work; a prefill chunk (default: more than one token) also
        spends the budget, a decode row (or a speculating decode) only counts for the fit."""
        self.work.add(start, num_tokens, rows, processed)
        if not (num_tokens > 1 if prefill is None else prefill):
            return
        self._floor_taken = True
        if self.seconds is not None:
            self.left -= self.model.chunk_seconds(start, num_tokens, rows, processed)

    def reserve(self) -> float:
        """The seconds running prefills leave to a waiting request."""
        return 0.0 if self.seconds is None else WAITING_SHARE * self.seconds

    def chunk(self, start: int, wanted: int, rows: int = 0, processed: int = 0, reserve: float = 0.0,
              floor: bool = True) -> int:
        """Tokens (0 to ``wanted``) of a prefill chunk from ``start`` that fit what is left less
        ``reserve``; with ``floor``, and no prefill charged yet in this step, at least the tokens
        of ``PREFILL_FLOOR`` of the budget (and 1). ``rows``/``processed``: what it samples when it
        completes its prompt."""
        if self.seconds is None:
            return wanted
        model = self.model
        n = model.max_tokens(start, self.left - reserve, rows, processed)
        if floor and not self._floor_taken:
            n = max(n, model.max_tokens(start, PREFILL_FLOOR * self.seconds, rows, processed), 1)
        n = min(wanted, n)
        if n > 0 and model.chunk_seconds(start, n, rows, processed) > TRUSTED_SHARE * self.seconds:
            # beyond what was measured only as far as a small share of the step risks
            n = min(n, max(model.explored_tokens(start),
                           model.max_tokens(start, TRUSTED_SHARE * self.seconds, rows, processed)))
        return n


def _solve(M: list[list[float]]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on an augmented k x (k+1) matrix (changed in
    place); None when singular."""
    k = len(M)
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(M[r][col]))
        if abs(M[pivot][col]) < 1e-300:
            return None
        M[col], M[pivot] = M[pivot], M[col]
        p = M[col]
        for r in range(col + 1, k):
            f = M[r][col] / p[col]
            if f:
                row = M[r]
                for j in range(col, k + 1):
                    row[j] -= f * p[j]
    x = [0.0] * k
    for i in range(k - 1, -1, -1):
        x[i] = (M[i][k] - sum(M[i][j] * x[j] for j in range(i + 1, k))) / M[i][i]
    return x
