"""Sampling parameters of one request, validated once at construction (vLLM's names)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# generation_config.json keys that become sampling defaults, by SamplingParams' names (vLLM's list:
# ModelConfig.get_diff_sampling_param; max_new_tokens is max_tokens). Others (do_sample, ...) are
# ignored. models/hf_loader.py reads them; the server checks --override-generation-config by them.
GENERATION_DEFAULT_KEYS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature",
                           "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What a completion must match: exactly one of ``json`` (a JSON schema, a dict or its text),
    ``json_object`` (any JSON object), ``regex`` (Rust regex syntax, the whole output matches) or
    ``choice`` (one of these strings). vLLM's ``StructuredOutputsParams`` names. The output is
    constrained token by token (pagedkv.engine.structured_output); a completion that finishes
    with "stop" (EOS) matches, one cut by max_tokens or a stop string may not. Shape errors raise
    ``ValueError`` naming the field; whether the schema or regex compiles is checked when the
    request is added (or by the server, before).
    """

    json: dict[str, Any] | None = field(default=None, hash=False)  # a dict: not hashed
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except ValueError as exc:
                raise ValueError(f"json must be a JSON schema (an object), got text that is not JSON: {exc}") from None
        if self.json is not None and not isinstance(self.json, Mapping):
            raise ValueError(f"json must be a JSON schema (an object), got {self.json!r:.80}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise ValueError(f"choice must be a non-empty list of strings, got {self.choice!r:.80}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"regex must be a non-empty string, got {self.regex!r:.80}")
        given = [self.json is not None, self.regex is not None, self.choice is not None, bool(self.json_object)]
        if sum(given) != 1:
            raise ValueError("structured_output must set exactly one of json, json_object, regex and choice")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal keys compile to the same grammar."""
        if self.json is not None:
            return "json", json.dumps(self.json, sort_keys=True, separators=(",", ":"))
        if self.json_object:
            return "json", '{"type":"object"}'
        if self.regex is not None:
            return "regex", self.regex
        return "choice", json.dumps(list(self.choice or ()))


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens for one request.

    Greedy when ``temperature == 0``. A per-request ``seed`` makes sampling reproducible whatever
    else shares the batch. ``n > 1`` returns ``n`` completions that share the prompt's KV blocks
    (copy-on-write forks). ``logprobs=k`` returns the chosen token's log-probability and the top
    ``k`` alternatives at every step; ``prompt_logprobs=k`` does the same for every prompt token
    after the first (such a request computes its whole prompt: it takes no prefix-cache hits).
    ``repetition_penalty`` (> 0; HF's and vLLM's rule) divides the positive logits of every token
    in the prompt or the output by it and multiplies the negative ones; ``presence_penalty`` and
    ``frequency_penalty`` (in [-2, 2], OpenAI's rule over the output only) subtract
    ``presence * (count > 0) + frequency * count``; ``logit_bias`` ({token id: bias in [-100, 100]})
    is added first. They change greedy choices too; logprobs stay the model's (vLLM's default).
    ``structured_output`` constrains every token to a JSON schema, a regex or a choice (see
    :class:`StructuredOutput`); not with beam search.
    ``speculative=False`` opts the request out of the engine's speculative decoding (its tokens
    are the same either way for greedy requests, and equally distributed for sampled ones).
    ``kv_cache_dtype`` (None: the engine's) asks for the request's own KV format: a float kind
    (``float32``, ``bfloat16``, ``float16``) keeps its blocks at full precision in an engine with a
    mixed pool (``kv_sink_blocks``), never sharing them with 8-bit blocks of the same tokens.
    Invalid values (NaN and infinities included) raise ``ValueError`` naming the field.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # in the output text (the token ids keep them)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = field(default=None, hash=False)  # a dict: not hashed
    structured_output: StructuredOutput | None = None
    speculative: bool = True
    kv_cache_dtype: str | None = None

    def __post_init__(self) -> None:
        # Accept lists and single strings for convenience, store tuples (hashable, immutable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _check_int("n", self.n, low=1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_number("temperature", self.temperature, low=0.0)
        _check_number("top_p", self.top_p, low=0.0, high=1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0")
        _check_int("top_k", self.top_k, low=-1)
        _check_number("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, low=None)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=20)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=20)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, low=0)
        _check_number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_number("repetition_penalty", self.repetition_penalty, low=0.0)
        if self.repetition_penalty == 0.0:
            raise ValueError("repetition_penalty must be > 0, got 0")
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _checked_logit_bias(self.logit_bias))
        if self.kv_cache_dtype is not None and (not isinstance(self.kv_cache_dtype, str) or not self.kv_cache_dtype):
            raise ValueError(f"kv_cache_dtype must be a KV format name or None, got {self.kv_cache_dtype!r}")
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be true or false, got {self.speculative!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(f"structured_output must be a StructuredOutput, got {self.structured_output!r:.80}")

    @property
    def uses_penalties(self) -> bool:
        """True when the sampler must process this request's logits (a penalty or a bias is set)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0 or bool(self.logit_bias))


def _checked_logit_bias(bias: object) -> dict[int, float]:
    """A copy of ``bias`` with int token ids >= 0 (decimal strings, as OpenAI sends them, are
    read as ints) and finite biases in [-100, 100]; ValueError naming ``logit_bias`` otherwise."""
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a mapping of token ids to biases, got {bias!r}")
    out: dict[int, float] = {}
    for token, value in bias.items():
        if isinstance(token, str) and token.isascii() and token.isdigit():
            token = int(token)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        _check_number("logit_bias", value, low=-100.0, high=100.0)
        out[token] = float(value)
    return out


def _check_int(name: str, value: object, *, low: int | None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def _check_number(name: str, value: object, *, low: float, high: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite or value < low or (high is not None and value > high):
        bound = f"a finite number in [{low}, {high}]" if high is not None else f"a finite number >= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
