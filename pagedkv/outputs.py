"""What the engine returns for a request: vLLM's output shapes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token, with its rank among the vocabulary (1 = most likely)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a request (``index`` in ``0 .. n-1``).

    ``logprobs`` (when asked) holds one dict per generated token: token id -> Logprob, always
    including the chosen token plus the top-k alternatives.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request: its prompt, cached-prefix count and completions so far.

    ``prompt_logprobs`` (when asked): one entry per prompt token, None for the first (nothing
    predicts it), else token id -> Logprob for that token and the top-k alternatives.
    ``error`` says why the engine failed this request (its completions then end with
    finish_reason "error"); the engine's other requests go on unaffected.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # the prefix-cache outcome at first admission (memory.miss_reasons.CacheDetails; None with
    # prefix caching off): hit tokens per tier, why the first missed block missed
    cache_details: Any = None
