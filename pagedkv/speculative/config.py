"""``speculative_config``: which proposer guesses tokens and how many (vLLM's JSON shape).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": "/path/to/small-model", "num_speculative_tokens": 4}

As in vLLM: ``method`` follows from ``model`` when left out (``"ngram"`` / ``"[ngram]"`` as the
model name mean the n-gram proposer); one n-gram bound given alone sets the other when needed;
``disable_by_batch_size`` stops proposing while that many sequences or more run. vLLM fields that
change nothing here are accepted with the one value we implement (``draft_tensor_parallel_size``
1, ``acceptance_method`` "rejection_sampler"; ``disable_logprobs``: logprobs are the target's
either way); any other field is an error.

Pure Python: validated once, every error names the field and what it accepts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

SPEC_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """``num_speculative_tokens`` (k): the most tokens proposed per sequence and step; a step then
    verifies k + 1 positions and emits 1 to k + 1 tokens. ``prompt_lookup_min``/``max``: the
    n-gram lengths the ngram proposer matches (longest first). ``model``: the draft model (a
    folder or GGUF file with the target's tokenizer). ``draft_kv_blocks``: the draft's KV pool in
    blocks (default: as many as the target's, so the draft can hold every running sequence).
    ``backoff``: pause a sequence's speculation after its proposals are rejected outright, for
    more steps each time (doubling up to 32), and shorten its proposals to what it accepts."""

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    draft_kv_blocks: int | None = None
    backoff: bool = True
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config: method must be one of {SPEC_METHODS}, got {self.method!r}")
        _int_in("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _int_in("prompt_lookup_min", self.prompt_lookup_min, 1, 64)
        _int_in("prompt_lookup_max", self.prompt_lookup_max, 1, 64)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model.strip():
                raise ValueError('speculative_config: method "draft_model" needs "model": the path of a smaller '
                                 "model with the target's tokenizer")
        elif self.model is not None:
            raise ValueError(f'speculative_config: "model" is for method "draft_model", not {self.method!r}')
        if self.draft_kv_blocks is not None:
            _int_in("draft_kv_blocks", self.draft_kv_blocks, 1, 1 << 30)
        if self.disable_by_batch_size is not None:
            _int_in("disable_by_batch_size", self.disable_by_batch_size, 1, 1 << 20)
        if not isinstance(self.backoff, bool):
            raise ValueError(f"speculative_config: backoff must be true or false, got {self.backoff!r}")

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From a JSON object (text, as ``--speculative-config`` gives it) or a mapping; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"speculative_config must be a JSON object such as "
                                 f'{{"method": "ngram", "num_speculative_tokens": 4}}: {exc}') from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r:.80}")
        fields = cls.__dataclass_fields__
        # a null is the default, as in vLLM
        value = {n: v for n, v in value.items() if v is not None or (n in fields and fields[n].default is None)}
        if value.get("model") in ("ngram", "[ngram]"):  # vLLM's older spelling of the n-gram proposer
            value["model"] = None
            value.setdefault("method", "ngram")
        if "method" not in value:
            # vLLM infers the method from "model" when it is left out
            value["method"] = "draft_model" if value.get("model") else "ngram"
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if low is None and isinstance(high, int):
            value["prompt_lookup_min"] = min(cast(int, fields["prompt_lookup_min"].default), high)
        elif high is None and isinstance(low, int):
            value["prompt_lookup_max"] = max(cast(int, fields["prompt_lookup_max"].default), low)
        for name, allowed in _VLLM_NO_OPS.items():
            if name in value:
                given = value.pop(name)
                if given is not None and given not in allowed:
                    raise ValueError(f"speculative_config: {name} {given!r} is not supported here; "
                                     f"leave it out or give {' or '.join(map(repr, allowed))}")
        known = set(fields) | set(_VLLM_NO_OPS)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**value)

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


# vLLM's fields that change nothing here, with the values that say what we do anyway
_VLLM_NO_OPS: dict[str, tuple[object, ...]] = {
    "draft_tensor_parallel_size": (1,),
    "acceptance_method": ("rejection_sampler",),
    "disable_logprobs": (True, False),
}


def _int_in(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"speculative_config: {name} must be an integer in [{low}, {high}], got {value!r}")
