"""Response bodies of both endpoints, built from engine outputs (OpenAI's shapes).

A :class:`ResponseFormat` knows how one endpoint spells a choice, a streamed delta and logprobs;
the serving code (``serving.py``) is the same for completions and chat.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedkv.outputs import Logprob, RequestOutput

Json = dict[str, Any]


class TokenDecoder(Protocol):
    def __call__(self, token_id: int) -> str: ...


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # return_cache_details: each prompt's prefix-cache outcome as its caller may see it, in order
    cache_details: list[Json | None] | None = field(default=None)

    def add_request(self, final: RequestOutput) -> None:
        self.prompt_tokens += len(final.prompt_token_ids)
        self.cached_tokens += final.num_cached_tokens
        self.completion_tokens += sum(len(c.token_ids) for c in final.outputs)
        if self.cache_details is not None:
            details = final.cache_details
            self.cache_details.append(details.for_caller() if details is not None else None)

    def to_json(self) -> Json:
        details: Json = {"cached_tokens": self.cached_tokens}
        if self.cache_details is not None:  # one prompt: its details; several: a list, in prompt order
            details["cache_details"] = self.cache_details[0] if len(self.cache_details) == 1 else self.cache_details
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": details,
        }


class ResponseFormat(Protocol):
    id_prefix: str
    prompt_param: str

    def full(self, rid: str, model: str, choices: list[Json], usage: Usage) -> Json: ...
    def choice(self, index: int, text: str, logprobs: Json | None, finish_reason: str | None) -> Json: ...
    def chunk(self, rid: str, model: str, choices: list[Json], usage: Usage | None = None) -> Json: ...
    def delta(self, index: int, text: str, logprobs: Json | None, finish_reason: str | None) -> Json | None: ...
    def first_deltas(self, num_choices: int) -> list[Json]: ...
    def logprobs(
        self, token_ids: list[int], steps: Sequence[dict[int, Logprob] | None], decode: TokenDecoder, offset: int
    ) -> Json: ...


def _token_text(token_id: int, lp: Logprob | None, decode: TokenDecoder) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return decode(token_id)


def _top(step: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    """The alternatives of one step, most likely first (the chosen token is listed only if top-k)."""
    return sorted(step.items(), key=lambda kv: kv[1].rank)


class CompletionFormat:
    id_prefix = "cmpl"
    prompt_param = "prompt"

    def __init__(self, num_top_logprobs: int = 0) -> None:
        self.k = num_top_logprobs

    def full(self, rid: str, model: str, choices: list[Json], usage: Usage) -> Json:
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": usage.to_json()}

    def choice(self, index: int, text: str, logprobs: Json | None, finish_reason: str | None) -> Json:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk(self, rid: str, model: str, choices: list[Json], usage: Usage | None = None) -> Json:
        body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage.to_json()
        return body

    def delta(self, index: int, text: str, logprobs: Json | None, finish_reason: str | None) -> Json:
        return self.choice(index, text, logprobs, finish_reason)

    def first_deltas(self, num_choices: int) -> list[Json]:
        return []

    def logprobs(
        self, token_ids: list[int], steps: Sequence[dict[int, Logprob] | None], decode: TokenDecoder, offset: int
    ) -> Json:
        """OpenAI's legacy logprobs object; a step of None (the first echoed prompt token, which
        nothing predicts) gives null logprobs, as OpenAI's does."""
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for tid, step in zip(token_ids, steps):
            lp = step.get(tid) if step is not None else None
            text = _token_text(tid, lp, decode)
            tokens.append(text)
            token_logprobs.append(lp.logprob if lp is not None else None)
            top: dict[str, float] | None = None
            if step is not None:
                top = {_token_text(alt_id, alt, decode): alt.logprob for alt_id, alt in _top(step)[: max(self.k, 0)]}
                if lp is not None:
                    top.setdefault(text, lp.logprob)
            top_logprobs.append(top)
            text_offset.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}


class ChatFormat:
    id_prefix = "chatcmpl"
    prompt_param = "messages"

    def __init__(self, num_top_logprobs: int = 0) -> None:
        self.k = num_top_logprobs

    def full(self, rid: str, model: str, choices: list[Json], usage: Usage) -> Json:
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": usage.to_json()}

    def choice(self, index: int, text: str, logprobs: Json | None, finish_reason: str | None) -> Json:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk(self, rid: str, model: str, choices: list[Json], usage: Usage | None = None) -> Json:
        body = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                "choices": choices}
        if usage is not None:
            body["usage"] = usage.to_json()
        return body

    def delta(self, index: int, text: str, logprobs: Json | None, finish_reason: str | None) -> Json | None:
        delta = {"content": text} if text or finish_reason is None else {}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def first_deltas(self, num_choices: int) -> list[Json]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(num_choices)]

    def logprobs(
        self, token_ids: list[int], steps: Sequence[dict[int, Logprob] | None], decode: TokenDecoder, offset: int
    ) -> Json:
        content = []
        for tid, step in zip(token_ids, steps):
            step = step or {}  # None (a prompt token nothing predicts) never comes here: chat has no echo
            lp = step.get(tid)
            text = _token_text(tid, lp, decode)
            top = [
                {"token": (t := _token_text(alt_id, alt, decode)), "logprob": alt.logprob,
                 "bytes": list(t.encode())}
                for alt_id, alt in _top(step)[: self.k]
            ]
            content.append({"token": text, "logprob": lp.logprob if lp is not None else None,
                            "bytes": list(text.encode()), "top_logprobs": top})
        return {"content": content}
