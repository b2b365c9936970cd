"""Request work too big for the event loop: decoding large bodies, building large responses.

The event loop answers ``/health`` and ``/metrics`` and moves every stream's tokens; anything it
computes delays all of them. So what grows with a request's size runs on a small pool of worker
threads (``HeavyWork``, bounded: a burst of heavy requests queues here instead of taking every
core), and the loop only awaits it:

    body bytes ─ json.loads + validation: inline under INLINE_BYTES, else in the pool
    prompts    ─ tokenization (serving.py, app.py): in a worker thread already, after the
                 character pre-check (``check_text_length``) so huge text is never tokenized
    responses  ─ a whole JSON body (choices, logprobs) built and encoded in the pool, one choice
                 per json.dumps call, so no single C call holds the GIL for long

A worker still takes the GIL; Python switches threads every few milliseconds, so the loop waits
at most one switch interval, or one C call (hence encoding choice by choice).

After a large request, memory the allocator keeps is handed back to the OS (glibc's
``malloc_trim``), so a burst of big bodies does not leave the process gigabytes larger.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from starlette.types import ASGIApp, Receive, Scope, Send

from pagedkv.server.protocol import Body, parse_body

T = TypeVar("T")

INLINE_BYTES = 64 << 10  # bodies below this are parsed on the loop (a thread hop costs more)
TRIM_AFTER_BYTES = 1 << 20  # request bytes handled before memory is handed back
_TRIM_INTERVAL_S = 1.0
_PLACEHOLDER = "\x00pagedkv-choices\x00"


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to hand back this way
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_malloc_trim = _load_malloc_trim()


def dumps(obj: Any, allow_nan: bool = False) -> bytes:
    """JSON as starlette's JSONResponse writes it (no spaces, UTF-8; NaN only if allowed)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=allow_nan, indent=None, separators=(",", ":")).encode()


def dumps_response(body: dict[str, Any], allow_nan: bool = False) -> bytes:
    """``dumps(body)``, its ``choices`` encoded one at a time (a 30 MB body is not one GIL hold)."""
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) < 2:
        return dumps(body, allow_nan)
    head = dumps({**body, "choices": _PLACEHOLDER}, allow_nan)
    marker = dumps(_PLACEHOLDER)
    at = head.index(marker)
    return b"".join((head[:at], b"[", b",".join(dumps(c, allow_nan) for c in choices), b"]",
                     head[at + len(marker):]))


class HeavyWork:
    """A bounded pool of worker threads for request work that grows with the request's size."""

    def __init__(self, workers: int = 2) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="pagedkv-heavy")
        self._lock = threading.Lock()
        self._bytes_since_trim = 0
        self._last_trim = 0.0
        self._trim_scheduled = False
        self.trims = 0

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the pool; its exception is raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def parse(self, raw: bytes, model: type[Body]) -> Body:
        """``parse_body(raw, model)``: on the loop for a small body, in the pool for a large one."""
        if len(raw) < INLINE_BYTES:
            return parse_body(raw, model)
        self.handled(len(raw))
        return await self.run(parse_body, raw, model)

    def handled(self, nbytes: int) -> None:
        """Count ``nbytes`` of request or response data; memory is trimmed after enough of it."""
        with self._lock:
            self._bytes_since_trim += nbytes

    def trim_if_due(self) -> None:
        """Hand freed memory back to the OS (in the pool) once enough data passed since last time:
        at once, or, within a second of the last trim, a second after it (so the end of a burst
        of large requests is trimmed too). Call on the event loop."""
        with self._lock:
            if _malloc_trim is None or self._bytes_since_trim < TRIM_AFTER_BYTES or self._trim_scheduled:
                return
            wait = self._last_trim + _TRIM_INTERVAL_S - time.monotonic()
            self._trim_scheduled = True
        if wait > 0:
            asyncio.get_running_loop().call_later(wait, self._submit_trim)
        else:
            self._submit_trim()

    def _submit_trim(self) -> None:
        with self._lock:
            self._bytes_since_trim, self._last_trim, self._trim_scheduled = 0, time.monotonic(), False
        try:
            self._pool.submit(self._trim)
        except RuntimeError:  # the pool was shut down with the app
            pass

    def _trim(self) -> None:
        assert _malloc_trim is not None
        _malloc_trim(0)
        self.trims += 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class TrimAfterRequests:
    """ASGI middleware: after each HTTP request, ``heavy.trim_if_due()`` (the request's objects
    are gone by then, so what they held can be handed back)."""

    def __init__(self, app: ASGIApp, heavy: HeavyWork) -> None:
        self.app, self.heavy = app, heavy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            if scope["type"] == "http":
                self.heavy.trim_if_due()
