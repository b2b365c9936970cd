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
    logit_bias      ─ at most max_logit_bias entries (default: no limit; the engine applies a
                      bias as one vector per request, so its size costs a step nothing)
    priority        ─ an integer in [min_priority, max_priority] (vLLM's rule: lower runs first,
                      and may preempt); when API keys map to tenants, a priority below 0 (ahead of
                      the default) only for the tenants named in priority_tenants

Each default lives here once; ``pagedkv serve`` builds its flags from these fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

MAX_CHOICES = 128  # the most completions one request may ask for (prompts times n)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """Per-request limits of the HTTP server (flag names: dashes for underscores)."""

    max_request_bytes: int = 16 << 20
    max_tokens_per_request: int = 1 << 18
    max_stop_chars: int = 4096
    max_stop_token_ids: int = 1024
    max_logit_bias: int | None = None  # None: no limit
    min_priority: int = field(default=-100, metadata={"type": int, "metavar": "INT"})
    max_priority: int = field(default=100, metadata={"type": int, "metavar": "INT"})
    # tenants (of API keys) that may ask for a priority below 0; None: none of them
    priority_tenants: tuple[str, ...] | None = field(
        default=None, metadata={"action": "extend", "nargs": "+", "metavar": "TENANT"})

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _NOT_COUNTS or (value is None and f.name == "max_logit_bias"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")
        for name in ("min_priority", "max_priority"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not self.min_priority <= 0 <= self.max_priority:
            raise ValueError(f"min_priority must be <= 0 <= max_priority (0 is a request's default priority), got "
                             f"[{self.min_priority}, {self.max_priority}]")
        if self.priority_tenants is not None:
            names = (self.priority_tenants,) if isinstance(self.priority_tenants, str) else self.priority_tenants
            if not all(isinstance(t, str) and t.strip() for t in names):
                raise ValueError(f"priority_tenants must be tenant names, got {self.priority_tenants!r}")
            object.__setattr__(self, "priority_tenants", tuple(t.strip() for t in names))

    def priority_error(self, priority: int, tenant: str | None) -> tuple[int, str] | None:
        """(HTTP status, message) when a request may not run at ``priority``; None when it may.
        ``tenant``: its API key's (None: keys do not map to tenants, the range alone applies)."""
        if not self.min_priority <= priority <= self.max_priority:
            return 400, (f"priority must be an integer in [{self.min_priority}, {self.max_priority}] (the "
                         f"server's --min-priority and --max-priority; lower runs first), got {priority}")
        if priority < 0 and tenant is not None and tenant not in (self.priority_tenants or ()):
            return 403, (f"priority {priority} would run ahead of other clients' requests, and this API key's "
                         f"tenant may not ask for that (the server's --priority-tenants); use 0 or more")
        return None


_NOT_COUNTS = ("min_priority", "max_priority", "priority_tenants")


LIMIT_HELP = {
    "max_request_bytes": "largest request body in bytes; larger bodies get 413",
    "max_tokens_per_request": "most tokens one request may ask to generate in all: choices (prompts x n) "
                              "x max_tokens (or, for chat without max_tokens, the rest of the context), "
                              "plus choices x prompt tokens with echo and logprobs",
    "max_stop_chars": "most characters of stop strings one request may give, all together",
    "max_stop_token_ids": "most stop token ids one request may give",
    "max_logit_bias": "most entries one request's logit_bias may hold; more get 400 (default: no limit)",
    "min_priority": "lowest priority a request may ask for (lower runs first and may preempt others); outside "
                    "[--min-priority, --max-priority] a request gets 400",
    "max_priority": "highest priority a request may ask for",
    "priority_tenants": "tenants (of --api-keys-file, or key1, key2, ... of several --api-key) that may ask for a "
                        "priority below 0; when keys map to tenants, the others get 403 for one (default: none)",
}


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What one connection may hold of the server, and for how long (flag names: dashes for
    underscores). uvicorn closes a keep-alive connection idle after a response, but not one that
    never sends a request, sends half its headers, or trickles its body; every connection and
    every body buffered is memory and a file descriptor, so each is bounded here
    (server/connections.py enforces them)."""

    max_connections: int = 1024
    header_timeout: float = 10.0
    keep_alive_timeout: float = 5.0
    body_timeout: float = 60.0
    max_uploads: int = 4

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_uploads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("header_timeout", "keep_alive_timeout", "body_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


# A body over this many bytes is an upload: it counts against max_uploads while it is read.
LARGE_BODY_BYTES = 1 << 20

CONNECTION_HELP = {
    "max_connections": "most open HTTP connections; a new one beyond it closes the longest-idle connection, "
                       "or gets 503 when none is idle (lowered to fit the process's open-file limit)",
    "header_timeout": "seconds a connection may take to send a request's headers, from its opening or its "
                      "previous response (an idle or half-sent request is closed after it)",
    "keep_alive_timeout": "seconds an idle keep-alive connection stays open after a response",
    "body_timeout": "seconds a request may take to send its whole body; slower bodies get 408",
    "max_uploads": f"request bodies over {LARGE_BODY_BYTES >> 20} MiB read at once; more get 503 with "
                   "Retry-After (each may hold up to --max-request-bytes)",
}
