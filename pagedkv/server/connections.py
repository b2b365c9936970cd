"""Connection and upload limits uvicorn lacks (``ConnectionLimits`` in server/limits.py).

uvicorn closes a keep-alive connection that stays idle after a response, and nothing else: a
connection that never sends a request, or sends half of its headers, stays open for ever, and
each holds a file descriptor; a body is read as slowly as the client likes, and a handler keeps
what arrived. So, per connection and per body:

    accept ── at max_connections: close the longest-idle connection; none idle: 503 and close
      │
    headers ── header_timeout from the opening (or from the previous response): closed (408
      │        when part of a request arrived)
    body ──── over LARGE_BODY_BYTES it is an upload: max_uploads at once, more get 503;
      │        the whole body within body_timeout, or 408 and the connection closed
    response ─ keep-alive: uvicorn's keep_alive_timeout, then header_timeout again

``max_connections`` is lowered, and the listen backlog (how many connections asyncio accepts at
once) sized, to fit the process's open-file limit after raising its soft value to the hard one,
as vLLM does (``fd_budget``), so connections alone never exhaust the descriptors; if something
else does, ``accept`` failing is logged once per ``LOG_INTERVAL_S`` with a count, not once per
attempt.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import resource
import time
from typing import Any, ClassVar, NamedTuple

from starlette.requests import ClientDisconnect, Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedkv.server.limits import LARGE_BODY_BYTES, ConnectionLimits
from pagedkv.server.protocol import APIError

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 10.0
# Descriptors kept beyond those open at start and two accept bursts (asyncio accepts up to the
# listen backlog at once, before any connection_made, and closes an evicted socket one loop turn
# later): disk-tier files, ZMQ sockets, the odd log or cache file.
_RESERVED_FDS = 32
_FD_TARGET = 65536
_MAX_BACKLOG = 2048  # uvicorn's default
_FD_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class FdBudget(NamedTuple):
    max_connections: int
    backlog: int  # the listen backlog, which is also how many connections asyncio accepts at once


def fd_budget(wanted: int) -> FdBudget:
    """``wanted`` connections, or fewer, and a listen backlog, so that connections never exhaust
    the open-file limit: the limit's soft value is first raised towards the hard one (as vLLM
    does), then what is open now, two accept bursts and ``_RESERVED_FDS`` are kept back."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _FD_TARGET if hard == resource.RLIM_INFINITY else min(hard, _FD_TARGET)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return FdBudget(wanted, _MAX_BACKLOG)
    backlog = max(16, min(_MAX_BACKLOG, soft // 8))
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:  # no procfs: assume a loaded engine's share
        open_now = 128
    usable = max(soft - open_now - 2 * backlog - _RESERVED_FDS, 1)
    if usable < wanted:
        logger.warning("max_connections lowered from %d to %d to fit the open-file limit (%d, %d open)",
                       wanted, usable, soft, open_now)
    return FdBudget(min(wanted, usable), backlog)


class RateLimitedLog:
    """Logs a recurring condition once per ``interval`` seconds, with how often it happened since."""

    def __init__(self, interval: float = LOG_INTERVAL_S) -> None:
        self.interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def __call__(self, key: str, message: str) -> bool:
        """Log ``message`` unless ``key`` was logged within the interval; True when it was logged."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        since = self._suppressed.pop(key, 0)
        self._last[key] = now
        logger.error("%s%s", message, f" ({since} more since the last report)" if since else "")
        return True


def install_fd_exhaustion_handler(loop: asyncio.AbstractEventLoop, log: RateLimitedLog) -> None:
    """Route the loop's errors for exhausted descriptors (``accept`` failing with EMFILE, ...)
    through ``log``; every other error goes to the handler that was there."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in _FD_ERRNOS:
            log("fd", f"out of file descriptors or socket memory ({exc.strerror}): new connections wait; "
                      f"{context.get('message', '')}")
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def _raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "service_unavailable" if status == 503 else
                                 "invalid_request_error", "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"retry-after: 1\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a connection cap and a header timeout.

    A connection is *idle* while no request is in progress on it: before its first request's
    headers are complete, and between a response and the next request. Idle connections are the
    ones closed to make room, and the header timeout runs only while one is idle.
    """

    limits: ClassVar[ConnectionLimits]
    max_connections: ClassVar[int]
    refused: ClassVar[int] = 0  # new connections answered 503 at the cap
    evicted: ClassVar[int] = 0  # idle connections closed to make room
    timed_out: ClassVar[int] = 0  # connections closed by the header timeout

    _idle_since: float | None = None
    _idle_cycle: object = None
    _timer: asyncio.TimerHandle | None = None
    _partial: bool = False

    @classmethod
    def bound_to(cls, limits: ConnectionLimits, max_connections: int) -> type[GuardedH11Protocol]:
        """A subclass for one server: its limits (``max_connections``: ``limits``' or fewer, from
        ``fd_budget``), and counters of its own."""
        return type("GuardedH11Protocol", (cls,), {"limits": limits, "refused": 0, "evicted": 0, "timed_out": 0,
                                                   "max_connections": max_connections})

    # uvicorn hands it an asyncio.Transport (written to below); H11Protocol declares a BaseTransport
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections and not self._make_room():
            type(self).refused += 1
            self.transport = transport
            transport.write(_raw_error(503, "Service Unavailable", f"the server holds its most connections "
                                       f"({self.max_connections}, --max-connections) and none is idle: retry",
                                       "too_many_connections"))
            transport.close()
            return
        super().connection_made(transport)
        self._await_request()

    def _make_room(self) -> bool:
        idle = [c for c in self.connections if isinstance(c, GuardedH11Protocol) and c._idle_since is not None]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c._idle_since or 0.0)  # (never None here: filtered above)
        type(self).evicted += 1
        victim._close()
        return True

    def _busy(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _await_request(self) -> None:
        """The connection waits for a request's headers: idle, with header_timeout to send them."""
        self._cancel_timer()
        if self._busy() or self.transport is None or self.transport.is_closing():
            return
        self._idle_since, self._idle_cycle, self._partial = time.monotonic(), self.cycle, False
        self._timer = self.loop.call_later(self.limits.header_timeout, self._header_timeout)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._idle_since = None, None

    def _header_timeout(self) -> None:
        self._timer = None
        if self.cycle is not self._idle_cycle or self.transport.is_closing():
            return
        type(self).timed_out += 1
        if self._partial:  # part of a request came: say why it is dropped
            self.transport.write(_raw_error(408, "Request Timeout", f"the request's headers did not arrive within "
                                            f"{self.limits.header_timeout} s (--header-timeout)", "request_timeout"))
        self._close()

    def _close(self) -> None:
        self._cancel_timer()
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._timer is not None:
            if self.cycle is not self._idle_cycle:  # a request started: no longer idle
                self._cancel_timer()
            else:
                self._partial = True

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        super().connection_lost(exc)


class UploadSlots:
    """At most ``limit`` bodies over LARGE_BODY_BYTES being read at once (each may hold up to
    max_request_bytes), so stalled uploads cannot hold the server's memory; more get 503."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0
        self.refused = 0

    def acquire(self) -> None:
        """Take a slot, or raise 503 (with Retry-After) when all are taken."""
        if self.in_use >= self.limit:
            self.refused += 1
            raise APIError(503, f"{self.limit} large request bodies are being received already (--max-uploads): "
                           "retry", type="service_unavailable", code="too_many_uploads",
                           headers={"Retry-After": "1", "Connection": "close"})
        self.in_use += 1

    def release(self) -> None:
        self.in_use -= 1


async def read_limited_body(request: Request, limit: int, timeout: float, uploads: UploadSlots) -> bytes:
    """The request body, or: 413 as soon as it is known to exceed ``limit`` bytes (from
    Content-Length, else while it streams in), so an oversized body is never held in full; 503
    when it is an upload (over LARGE_BODY_BYTES) and ``uploads`` has no slot; 408 when it takes
    longer than ``timeout`` seconds. The connection is closed after a 408, 413 or 503."""
    close = {"Connection": "close"}  # the rest of the body is not read: the connection cannot be reused
    too_large = APIError(413, f"the request body exceeds {limit} bytes (the server's --max-request-bytes)",
                         code="request_too_large", headers=close)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    holds_slot = False
    try:
        async with asyncio.timeout(timeout):
            if declared.isdigit() and int(declared) > LARGE_BODY_BYTES:
                uploads.acquire()
                holds_slot = True
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                if not holds_slot and size > LARGE_BODY_BYTES:  # chunked: an upload once this large
                    uploads.acquire()
                    holds_slot = True
                chunks.append(chunk)
    except TimeoutError as exc:
        raise APIError(408, f"the request body did not arrive within {timeout} s (--body-timeout)",
                       code="request_timeout", headers=close) from exc
    except ClientDisconnect as exc:  # nobody is left to answer; not a server error
        raise APIError(499, "the client disconnected while sending the body",
                       code="client_closed_request") from exc
    finally:
        if holds_slot:
            uploads.release()
    return b"".join(chunks)
