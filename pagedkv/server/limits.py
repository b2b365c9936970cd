"""What one request may cost the server, checked before any work is done for it.

    body bytes      ─ read with a running count: a body over max_request_bytes is a 413 before
                      it is held in memory in full (Content-Length is checked first)
    prompt text     ─ the engine refuses, before tokenizing, text longer than max_model_len
                      tokens can stand for (LLMEngine.tokenize); tokenization runs in a worker
                      thread, never on the event loop or the engine thread
    prompt tokens   ─ the engine's max_model_len check, as for any request
    generated work  ─ choices (prompts x n) x max_tokens, plus choices x prompt tokens when the
                      prompt's logprobs are echoed, <= max_tokens_per_request
    stop strings    ─ their total length <= max_stop_chars; stop token ids <= max_stop_token_ids

Each default lives here once; ``pagedkv serve`` builds its flags from these fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

MAX_CHOICES = 128  # the most completions one request may ask for (prompts times n)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Per-request limits of the HTTP server (flag names: dashes for underscores)."""

    max_request_bytes: int = 16 << 20
    max_tokens_per_request: int = 1 << 18
    max_stop_chars: int = 4096
    max_stop_token_ids: int = 1024

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")


LIMIT_HELP = {
    "max_request_bytes": "largest request body in bytes; larger bodies get 413",
    "max_tokens_per_request": "most tokens one request may ask to generate in all: choices (prompts x n) "
                              "x max_tokens (or, for chat without max_tokens, the rest of the context), "
                              "plus choices x prompt tokens with echo and logprobs",
    "max_stop_chars": "most characters of stop strings one request may give, all together",
    "max_stop_token_ids": "most stop token ids one request may give",
}
