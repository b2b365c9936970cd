"""Grammar compilation with bounded cost: off the event loop, off the engine thread, cached.

    submit(so) ─ size checks (choices, characters: cheap, on the caller's thread) ─ cache hit? done
        └─▶ [queue] ─▶ compiler thread ─▶ worker process (grammar_worker.py): compile + first mask
                           │               under RLIMIT_AS, niced; killed past the time limit
                           │◀── grammar text, or the limit that fired (a short message)
                           ├─ build this process's matcher from the accepted text, warm its lexer
                           └─ cache it by the digest of its text (bounded in bytes) ─▶ future

Why two compiles: an llguidance matcher cannot cross processes, and some grammars cost without
bound where llguidance's own limits do not reach (the worker's docstring has the example). The
worker finds out, under a memory cap and a clock, what a grammar costs; the server process then
builds only grammars that fit, so its own build is bounded by the same limits and never grows the
server by more than the worker measured. llguidance's own limits (lexer states, fuel, grammar
size) hold in both, and keep holding at every step of generation (a mask that hits one ends that
sequence: see ``GrammarState.fill_bitmask``).

Refusals are cached too (by digest, message only), so a repeated heavy grammar costs nothing
after its first refusal. Every error and log line repeats at most ``ERROR_EXCERPT`` characters
of llguidance's message, never the grammar.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import io
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from pagedkv.engine.grammar_worker import excerpt, write_frame
from pagedkv.sampling_params import StructuredOutput

logger = logging.getLogger(__name__)

WORKER_SCRIPT = Path(__file__).with_name("grammar_worker.py")
_WORKER_START_TIMEOUT_S = 60.0  # the worker's setup: a Python start and the tokenizer's trie
_REFUSED_CACHE = 256  # refused grammars remembered (digest -> message)
# After building a grammar too large to cache, the compiler thread hands freed heap back to the
# system every _TRIM_EVERY_S while idle, for _TRIM_FOR_S (its requests drop their copies later,
# on the engine thread, and glibc would keep the memory).
_TRIM_EVERY_S, _TRIM_FOR_S = 2.0, 60.0
_WORKER_IDLE_S = 120.0  # an idle worker exits after this (the next grammar starts one: about a second)


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """What compiling one structured-output grammar may cost: EngineConfig's fields of the same
    names (their defaults and checks live there; ``pagedkv serve``'s flags have dashes). Past any
    of them the request is refused with a :class:`GrammarLimitError` naming the field."""

    grammar_compile_timeout_s: float  # wall time of one compile in the worker
    grammar_memory_mib: int  # memory the worker may map for one compile
    grammar_max_lexer_states: int  # llguidance's max_lexer_states (~1-2 kB each), also per step
    grammar_max_spec_chars: int  # characters of the schema, regex or choice list (as JSON)
    max_guided_choices: int  # strings in a choice list
    grammar_cache_mib: int  # compiled grammars kept in this process, by estimated bytes

    @classmethod
    def of(cls, config: Any) -> GrammarLimits:
        """The limits set on ``config`` (an EngineConfig, which has these fields)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})

    def parser_limits(self) -> dict[str, Any]:
        """llguidance's LLParserLimits arguments: its defaults, fewer lexer states, and errors
        that do not quote the grammar."""
        return {"max_lexer_states": self.grammar_max_lexer_states, "verbose_errors": False}

    def check_size(self, so: StructuredOutput) -> tuple[str, str]:
        """``so.key`` once its size is within the limits (the choice count first, before any work
        in proportion to the input); GrammarLimitError otherwise."""
        if so.choice is not None and len(so.choice) > self.max_guided_choices:
            raise GrammarLimitError(f"{len(so.choice)} choices; this server allows {self.max_guided_choices} "
                                    f"(max_guided_choices, --max-guided-choices)", "max_guided_choices")
        key = so.key
        if len(key[1]) > self.grammar_max_spec_chars:
            raise GrammarLimitError(f"the {_KIND_NAMES[key[0]]} has {len(key[1])} characters; this server allows "
                                    f"{self.grammar_max_spec_chars} (grammar_max_spec_chars, "
                                    f"--grammar-max-spec-chars)", "grammar_max_spec_chars")
        return key


_KIND_NAMES = {"json": "schema", "regex": "regex", "choice": "choice list"}


class GrammarError(ValueError):
    """A schema, regex or choice list that cannot be turned into a grammar (the message quotes at
    most ``ERROR_EXCERPT`` characters of llguidance's reason)."""


class GrammarLimitError(GrammarError):
    """A grammar past one of the limits; ``limit`` names the option (GrammarLimits' field, or
    llguidance's LLParserLimits field for one of its own)."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class CompiledGrammar:
    """A grammar compiled in this process: a matcher at its start (copied for each sequence) and
    what it cost in the worker."""

    __slots__ = ("digest", "matcher", "nbytes", "seconds", "__weakref__")

    def __init__(self, digest: bytes, matcher: Any, nbytes: int, seconds: float) -> None:
        self.digest, self.matcher, self.nbytes, self.seconds = digest, matcher, nbytes, seconds


@dataclass(frozen=True, slots=True)
class GrammarStats:
    compiled: int  # grammars compiled (worker and this process), each distinct text once while cached
    cache_hits: int  # submits answered from the cache, or joined to a compile in progress
    refused: int  # submits refused (a limit, or an invalid grammar), cached refusals included
    worker_starts: int  # worker processes started (one more after each kill: a timeout or memory)
    cached: int
    cached_bytes: int


@dataclass(slots=True)
class TokenizerSetup:
    """What the worker and this process need of the model's tokenizer."""

    llg_tokenizer: Any  # llguidance.LLTokenizer
    json_text: str  # tokenizer.json's text
    n_vocab: int
    eos: list[int]


class _WorkerDied(Exception):
    pass


class _Worker:
    """One worker process and its pipes; used by the compiler thread only."""

    def __init__(self, setup: TokenizerSetup, limits: GrammarLimits) -> None:
        env = {**os.environ, "RAYON_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-P", str(WORKER_SCRIPT)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        # the three pipes asked for above (Popen types each as optional), buffered (bufsize=-1)
        self.stdin = cast(io.BufferedWriter, self.proc.stdin)
        self.stdout = cast(io.BufferedReader, self.proc.stdout)
        self.stderr = cast(io.BufferedReader, self.proc.stderr)
        self._stderr_tail = b""
        threading.Thread(target=self._drain_stderr, name="pagedkv-grammar-stderr", daemon=True).start()
        try:
            write_frame(self.stdin, {"tokenizer": setup.json_text, "n_vocab": setup.n_vocab, "eos": setup.eos,
                                     "limits": limits.parser_limits(),
                                     "memory_bytes": limits.grammar_memory_mib << 20})
            if not self._read(time.monotonic() + _WORKER_START_TIMEOUT_S).get("ready"):
                raise _WorkerDied(self.stderr_tail())
        except BaseException:
            self.kill()
            raise

    def _drain_stderr(self) -> None:
        for chunk in iter(lambda: self.stderr.read1(4096), b""):
            self._stderr_tail = (self._stderr_tail + chunk)[-4096:]

    def stderr_tail(self) -> str:
        return self._stderr_tail.decode(errors="replace")

    def run(self, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        """The worker's reply; TimeoutError past ``timeout`` s, _WorkerDied if it exits."""
        try:
            write_frame(self.stdin, job)
        except (BrokenPipeError, OSError) as exc:
            raise _WorkerDied(str(exc)) from exc
        return self._read(time.monotonic() + timeout)

    def _read(self, deadline: float) -> dict[str, Any]:
        fd = self.stdout.fileno()
        buf = bytearray()
        while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self.proc.wait()
                raise _WorkerDied(self.stderr_tail())
            buf += chunk
        return json.loads(bytes(buf[4:]))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.stdin, self.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class GrammarCompiler:
    """Compiles grammars one at a time on its own thread (through the worker), caches them.

    Thread-safe: any thread may :meth:`submit`; a repeated grammar joins the compile in progress
    or is answered from the cache. ``tokenizer_setup`` is called once, on the compiler thread,
    before the first compile (GrammarError there refuses every grammar with its message).
    """

    def __init__(self, tokenizer_setup: Callable[[], TokenizerSetup], limits: GrammarLimits) -> None:
        self.limits = limits
        self._tokenizer_setup = tokenizer_setup
        self._setup: TokenizerSetup | None = None
        self._setup_lock = threading.Lock()
        self._lock = threading.Condition()
        self._queue: deque[tuple[bytes, str, str]] = deque()
        self._waiters: dict[bytes, list[Future[CompiledGrammar]]] = {}
        self._cache: OrderedDict[bytes, CompiledGrammar] = OrderedDict()
        self._cached_bytes = 0
        # grammars alive anywhere (a handler holding one until its request is added): the engine
        # finds them even after the cache evicted them, so it never compiles on its own thread
        self._live: weakref.WeakValueDictionary[bytes, CompiledGrammar] = weakref.WeakValueDictionary()
        self._refused: OrderedDict[bytes, tuple[str, str | None]] = OrderedDict()
        self._counts = {"compiled": 0, "cache_hits": 0, "refused": 0, "worker_starts": 0}
        self._worker: _Worker | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._trim_until = 0.0
        self._idle_since = 0.0

    # ------------------------------------------------------------------ any thread
    def submit(self, so: StructuredOutput) -> Future[CompiledGrammar]:
        """A future of ``so``'s compiled grammar (or of its GrammarError). The size checks run
        here and raise at once; their cost and the key's are in proportion to the input's size,
        so call this off the event loop for a large one."""
        try:
            kind, spec = self.limits.check_size(so)
        except GrammarLimitError:
            with self._lock:
                self._counts["refused"] += 1
            raise
        digest = _digest(kind, spec)
        future: Future[CompiledGrammar] = Future()
        with self._lock:
            if self._closed:
                raise GrammarError("the engine is shut down")
            hit = self.lookup(digest)
            if hit is not None:
                self._counts["cache_hits"] += 1
                future.set_result(hit)
                return future
            refused = self._refused.get(digest)
            if refused is not None:
                self._counts["refused"] += 1
                future.set_exception(_error(*refused))
                return future
            waiting = self._waiters.get(digest)
            if waiting is not None:
                self._counts["cache_hits"] += 1
                waiting.append(future)
                return future
            self._waiters[digest] = [future]
            self._queue.append((digest, kind, spec))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pagedkv-grammar", daemon=True)
                self._thread.start()
            self._lock.notify()
        return future

    def prepare(self) -> None:
        """Build the tokenizer info now (llguidance holds the GIL for it: about 1 s at a 49152-token
        vocabulary, so a server does this before it serves, not at its first grammar). A
        tokenizer it cannot use is left for the first compile to report."""
        try:
            self._tokenizer_info()
        except GrammarError:
            pass

    def _tokenizer_info(self) -> TokenizerSetup:
        with self._setup_lock:
            if self._setup is None:
                self._setup = self._tokenizer_setup()
            return self._setup

    def compile(self, so: StructuredOutput) -> CompiledGrammar:
        """:meth:`submit` and wait (the offline engine's path: it has no one else to stall)."""
        return self.submit(so).result()

    def lookup(self, digest: bytes) -> CompiledGrammar | None:
        """The compiled grammar of ``digest`` if this process holds it (cached, or alive)."""
        with self._lock:
            hit = self._cache.get(digest)
            if hit is not None:
                self._cache.move_to_end(digest)
                return hit
            return self._live.get(digest)

    @staticmethod
    def digest_of(so: StructuredOutput) -> bytes:
        """The cache key of ``so``'s grammar: the digest of its text."""
        return _digest(*so.key)

    def stats(self) -> GrammarStats:
        with self._lock:
            return GrammarStats(cached=len(self._cache), cached_bytes=self._cached_bytes, **self._counts)

    def close(self) -> None:
        """Stop the compiler thread and the worker; pending submits fail. Idempotent."""
        with self._lock:
            self._closed = True
            pending = [f for fs in self._waiters.values() for f in fs]
            self._waiters.clear()
            self._queue.clear()
            self._lock.notify_all()
            thread = self._thread
            worker = self._worker
        if worker is not None and worker.proc.poll() is None:
            worker.proc.kill()  # a compile in progress ends now (the compiler thread reaps it)
        for f in pending:
            _settle(f, exception=GrammarError("the engine is shut down"))
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)

    # ------------------------------------------------------------------ compiler thread
    def _run(self) -> None:
        _lower_thread_priority()
        try:
            while True:
                with self._lock:
                    while not self._queue and not self._closed:
                        self._wait_idle()
                    if self._closed:
                        return
                    digest, kind, spec = self._queue.popleft()
                result: CompiledGrammar | None = None
                error: GrammarError | None = None
                try:
                    result = self._compile(digest, kind, spec)
                except GrammarError as exc:
                    error = exc
                except Exception as exc:  # one grammar's failure must not stop the thread
                    logger.exception("compiling a grammar failed")
                    error = GrammarError(f"compiling the grammar failed: {excerpt(repr(exc))}")
                with self._lock:
                    waiters = self._waiters.pop(digest, [])
                    if result is not None:
                        self._counts["compiled"] += 1
                        self._live[digest] = result
                        self._remember(result)
                    else:
                        self._counts["refused"] += len(waiters)
                        self._refused[digest] = (str(error), getattr(error, "limit", None))
                        if len(self._refused) > _REFUSED_CACHE:
                            self._refused.popitem(last=False)
                for f in waiters:
                    if result is not None:
                        _settle(f, result=result)
                    else:
                        _settle(f, exception=_error(str(error), getattr(error, "limit", None)))
                del result, waiters
                if error is not None:
                    _trim_memory()
                self._idle_since = time.monotonic()
        finally:
            if self._worker is not None:
                self._worker.kill()
                self._worker = None

    def _wait_idle(self) -> None:
        """Wait for work (the lock held): meanwhile trim freed memory while a large grammar may
        have been dropped, and stop an idle worker."""
        now = time.monotonic()
        waits: list[float] = []
        if now < self._trim_until:
            waits.append(_TRIM_EVERY_S)
        if self._worker is not None:
            idle_left = self._idle_since + _WORKER_IDLE_S - now
            if idle_left <= 0:
                self._kill_worker()
                return
            waits.append(idle_left)
        woken = self._lock.wait(min(waits) if waits else None)
        if not woken and now < self._trim_until:
            _trim_memory()

    def _remember(self, grammar: CompiledGrammar) -> None:
        """Cache ``grammar`` within grammar_cache_mib (least recently used out first); one larger
        than a quarter of it is not cached (it stays reachable while a request holds it)."""
        budget = self.limits.grammar_cache_mib << 20
        if grammar.nbytes > budget // 4:
            self._trim_until = time.monotonic() + _TRIM_FOR_S
            return
        self._cache[grammar.digest] = grammar
        self._cached_bytes += grammar.nbytes
        evicted = False
        while self._cached_bytes > budget or len(self._cache) > 1024:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.nbytes
            evicted = True
        if evicted:
            _trim_memory()

    def _compile(self, digest: bytes, kind: str, spec: str) -> CompiledGrammar:
        import llguidance

        setup = self._tokenizer_info()
        reply = self._in_worker({"kind": kind, "spec": spec})
        if not reply["ok"]:
            limit = reply.get("limit")
            if limit:
                raise GrammarLimitError(f"the grammar is too complex: {reply['error']} (llguidance's {limit} "
                                        f"limit{_flag_note(limit)})", limit)
            raise GrammarError(reply["error"])
        limits = llguidance.LLParserLimits(**self.limits.parser_limits())
        matcher = llguidance.LLMatcher(setup.llg_tokenizer, reply["grammar"], log_level=0, limits=limits)
        if not matcher.is_error():
            matcher.compute_bitmask()  # the first mask builds the lexer: here, not on the engine thread
        if matcher.is_error():  # the worker accepted it, so this is a difference between the two
            raise GrammarError(f"the grammar does not compile: {excerpt(matcher.get_error())}")
        logger.debug("grammar compiled in %.2f s (%d kB held)", reply["seconds"], reply["bytes"] >> 10)
        return CompiledGrammar(digest, matcher, int(reply["bytes"]), float(reply["seconds"]))

    def _in_worker(self, job: dict[str, Any]) -> dict[str, Any]:
        limits = self.limits
        setup = self._setup
        assert setup is not None
        if self._worker is None or self._worker.proc.poll() is not None:
            self._kill_worker()
            self._counts["worker_starts"] += 1
            try:
                self._worker = _Worker(setup, limits)
            except (TimeoutError, _WorkerDied, OSError) as exc:
                logger.warning("the grammar worker did not start: %s", excerpt(repr(exc)))
                raise GrammarError("the grammar compiler could not start (the server log says why)") from None
        try:
            return self._worker.run(job, limits.grammar_compile_timeout_s)
        except TimeoutError:
            self._kill_worker()
            raise GrammarLimitError(f"compiling the grammar took longer than {limits.grammar_compile_timeout_s:g} s "
                                    f"(grammar_compile_timeout_s, --grammar-compile-timeout-s)",
                                    "grammar_compile_timeout_s") from None
        except _WorkerDied:
            tail = self._worker.stderr_tail() if self._worker is not None else ""
            self._kill_worker()
            if "memory" in tail.lower() or not tail.strip():
                raise GrammarLimitError(f"compiling the grammar needed more than {limits.grammar_memory_mib} MiB "
                                        f"(grammar_memory_mib, --grammar-memory-mib)", "grammar_memory_mib") from None
            logger.warning("the grammar worker exited: %s", excerpt(tail))
            raise GrammarError("the grammar compiler failed on this grammar") from None

    def _kill_worker(self) -> None:
        if self._worker is not None:
            self._worker.kill()
            self._worker = None


def _digest(kind: str, spec: str) -> bytes:
    return hashlib.sha256(f"{kind}\x00{spec}".encode()).digest()


def _flag_note(limit: str) -> str:
    return "; --grammar-max-lexer-states" if limit == "max_lexer_states" else ""


def _error(message: str, limit: str | None) -> GrammarError:
    return GrammarLimitError(message, limit) if limit else GrammarError(message)


def _settle(future: Future, *, result: Any = None, exception: BaseException | None = None) -> None:
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except InvalidStateError:  # the waiter gave up (its client left)
        pass


def _lower_thread_priority() -> None:
    """Linux nice values are per thread: this one yields the CPU to the engine and the event loop."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (OSError, AttributeError):
        pass


def _trim_memory() -> None:
    """Hand freed heap back to the system (glibc keeps it otherwise: a dropped grammar's memory
    would stay counted in the server's RSS)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
