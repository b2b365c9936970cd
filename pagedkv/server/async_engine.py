"""The bridge between asyncio request handlers and the (not thread-safe) engine.

One engine thread owns the engine. Handlers never touch it: they post commands (add, abort, call)
to the thread and read outputs from a per-request ``asyncio.Queue`` that the thread feeds with
``loop.call_soon_threadsafe``. The thread steps while any request is unfinished and sleeps on a
condition otherwise, so requests that arrive while others run join the next step (continuous
batching) and an idle server costs nothing.

    handler ──add/abort/call──▶ [commands] ──▶ engine thread: run commands, engine.step()
    handler ◀──RequestOutput── asyncio.Queue ◀──call_soon_threadsafe──┘
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pagedkv.engine import EngineDeadError, RequestFailedError, TokenizedPrompt
from pagedkv.outputs import RequestOutput
from pagedkv.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
STATS_INTERVAL_S = 0.5  # how stale /metrics may be while the engine is busy


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


@dataclass(slots=True)
class _Command:
    fn: Callable[[], Any]
    future: concurrent.futures.Future[Any] | None


class OutputStream:
    """Outputs of a group of requests, in arrival order; ends when all have finished or on abort.

    ``abort`` (idempotent) aborts the unfinished ones and wakes a consumer waiting on the stream.
    An engine failure is raised from ``__anext__`` as EngineDeadError; a request the engine
    failed alone (its output carries ``error``) as RequestFailedError.
    """

    def __init__(self, owner: AsyncEngine, request_ids: list[str], queue: asyncio.Queue[Any]) -> None:
        self._owner = owner
        self._queue = queue
        self.unfinished = set(request_ids)
        self.aborted = False

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self.unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _ABORTED:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.unfinished.clear()
            raise item
        if item.finished:
            self.unfinished.discard(item.request_id)
            if item.error is not None:
                raise RequestFailedError(item.error)
        return item

    def abort(self) -> None:
        if not self.unfinished:
            return
        self.aborted = True
        for rid in self.unfinished:
            self._owner.abort(rid)
        self.unfinished.clear()
        self._queue.put_nowait(_ABORTED)


_ABORTED = object()


def _deliver(batch: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in batch:
        stream.queue.put_nowait(out)


class AsyncEngine:
    """Serve one engine to many asyncio tasks through one engine thread.

    ``add_requests`` returns an :class:`OutputStream` of cumulative RequestOutputs; its owner must
    ``abort()`` it when it stops reading early (a client disconnect), which frees the blocks.
    ``shutdown`` lets unfinished requests run to the end, then stops the thread.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._commands: deque[_Command] = deque()
        self._streams: dict[str, _Stream] = {}  # owned by the engine thread
        self._num_in_flight = 0  # requests added and not finished; read by handlers for admission
        self._stopping = False
        self._dead: BaseException | None = None
        self._stats: Any | None = None  # the last engine stats snapshot (latest_stats)
        self._stats_at = float("-inf")
        # Called on the engine thread after each step with the tokens it computed (the server's
        # iteration-tokens histogram); it must be quick and thread-safe.
        self.step_observer: Callable[[int], None] | None = None
        # KV cache events (pagedkv/kv_events.py): handed over after each step when the engine
        # records them (server/kv_events.py publishes them); must be quick and thread-safe.
        self.kv_event_sink: Callable[[list], None] | None = None
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float | None = None) -> None:
        """Finish every unfinished request, then stop the engine thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    def fail(self, message: str) -> None:
        """Mark the engine dead from any thread (``LLMEngine.on_dead``: a tensor-parallel rank
        died): /health turns 503 and new requests fail at once; requests in flight fail at the
        engine's next step."""
        with self._cond:
            if self._dead is None:
                self._dead = EngineDeadError(message)
            self._cond.notify()

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    # ----------------------------------------------------------------- handler side
    async def add_requests(
        self,
        prompts: list[tuple[str, str | list[int] | TokenizedPrompt]],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
        tenant: str | None = None,
        conversation_id: str | None = None,
        pin_ttl_s: float | None = None,
        lora_request: str | None = None,
    ) -> OutputStream:
        """Add ``(request_id, prompt)`` pairs atomically: all are added, or none and the error is raised.

        Raises what ``engine.add_request`` raises (RequestRejectedError, RequestTooLongError,
        ValueError) or EngineDeadError. The returned stream yields their outputs as they come.
        """
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        request_ids = [rid for rid, _ in prompts]

        def add() -> None:
            self.engine.add_requests([(rid, prompt, params) for rid, prompt in prompts],
                                     cache_salt=cache_salt, priorities=[priority] * len(prompts), tenant=tenant,
                                     conversation_id=conversation_id, pin_ttl_s=pin_ttl_s,
                                     lora_requests=[lora_request] * len(prompts) if lora_request else None)
            for rid in request_ids:
                self._streams[rid] = stream
            self._num_in_flight += len(request_ids)

        try:
            await self._submit(add)
        except asyncio.CancelledError:
            for rid in request_ids:  # the add may still run: undo it
                self.abort(rid)
            raise
        return OutputStream(self, request_ids, stream.queue)

    def abort(self, request_id: str) -> None:
        """Abort a request (fire and forget); unknown or finished ids are ignored."""

        def abort() -> None:
            if self._streams.pop(request_id, None) is not None:
                self._num_in_flight -= 1
                self.engine.abort_request(request_id)

        self._post(_Command(abort, None))

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps, e.g. ``engine.stats()``."""
        return await self._submit(lambda: fn(self.engine))

    def call_threadsafe(self, fn: Callable[[Any], T]) -> concurrent.futures.Future[T]:
        """Like :meth:`call`, from any thread; returns a future of ``fn(engine)``."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._post(_Command(lambda: fn(self.engine), future))
        return future

    async def _submit(self, fn: Callable[[], T]) -> T:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._post(_Command(fn, future))
        return await asyncio.wrap_future(future)

    def _post(self, command: _Command) -> None:
        with self._cond:
            if self._dead is not None:
                if command.future is not None:
                    command.future.set_exception(EngineDeadError(str(self._dead)))
                return
            self._commands.append(command)
            self._cond.notify()

    # ----------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._commands and not self._has_work() and not self._stopping:
                        self._cond.wait()
                    commands, self._commands = self._commands, deque()
                    if self._stopping and not commands and not self._has_work():
                        # Under the lock: a command posted from now on fails at once, never hangs.
                        self._die(EngineDeadError("the engine was shut down"))
                        break
                for command in commands:
                    self._execute(command)
                if self._has_work():
                    self._step()
                self._refresh_stats(force=not self._has_work())
        except BaseException as exc:  # the thread must report, not vanish
            logger.exception("engine thread failed")
            self._die(exc)
        self._close_engine()

    def _close_engine(self) -> None:
        """A clean shutdown: the engine writes what its disk tier lacks (on this thread, which
        owns the engine)."""
        close = getattr(self.engine, "close", None)
        if close is None:
            return
        try:
            close()
        except Exception:  # shutting down: say it, do not hide the exit
            logger.exception("closing the engine failed")

    def _has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def latest_stats(self) -> Any | None:
        """The engine's stats as of the last step (taken at most every ``STATS_INTERVAL_S`` while
        it runs): ``/metrics`` reads it without waiting for the step in progress."""
        return self._stats

    def _refresh_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._stats_at >= STATS_INTERVAL_S:
            try:
                self._stats, self._stats_at = self.engine.stats(), now
            except Exception:  # a metrics snapshot must never stop the engine
                logger.exception("engine stats failed")

    def _execute(self, command: _Command) -> None:
        try:
            result = command.fn()
        except Exception as exc:  # a failed command fails its caller only
            if command.future is not None:
                command.future.set_exception(exc)
            else:
                logger.exception("engine command failed")
            return
        if command.future is not None:
            command.future.set_result(result)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except EngineDeadError:
            raise
        except Exception as exc:  # fail the batch, keep serving if the engine recovers
            logger.exception("engine step failed; failing the %d request(s) in flight", len(self._streams))
            self._fail_all(RuntimeError(f"engine step failed: {exc!r}"))
            if self.engine.has_unfinished_requests():
                raise  # aborting did not clear the engine: it cannot go on
            return
        if self.step_observer is not None and self.engine.last_step_tokens:
            self.step_observer(self.engine.last_step_tokens)
        if self.kv_event_sink is not None and (events := self.engine.take_kv_events()):
            self.kv_event_sink(events)
        # One wake-up of each event loop per step, however many requests progressed.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted while the step ran
            if out.finished:
                del self._streams[out.request_id]
                self._num_in_flight -= 1
            batches.setdefault(stream.loop, []).append((stream, out))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_deliver, batch)
        if self._streams and not self.engine.has_unfinished_requests():
            # Cannot happen with an engine that keeps its contract; never leave a handler waiting.
            self._fail_all(RuntimeError("the engine dropped a request without finishing it"))

    def _fail_all(self, error: BaseException) -> None:
        """Abort every request in flight and hand ``error`` to its handler."""
        for rid, stream in self._streams.items():
            try:
                self.engine.abort_request(rid)
            except Exception:  # best effort, the error is reported below
                logger.exception("abort of %s failed", rid)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
        self._num_in_flight -= len(self._streams)
        self._streams.clear()

    def _die(self, exc: BaseException) -> None:
        error = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"engine stopped: {exc!r}")
        with self._cond:
            self._dead = error
            commands, self._commands = self._commands, deque()
        for command in commands:
            if command.future is not None and not command.future.done():
                command.future.set_exception(error)
        for stream in self._streams.values():
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
        self._streams.clear()
        self._num_in_flight = 0
