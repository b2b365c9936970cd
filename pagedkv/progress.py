"""Saying what a long start-up phase is doing, so that a first start is never silent.

A phase that can take tens of seconds (building the native kernels, converting a GGUF file,
downloading a model, loading the weights) prints one line on stderr when it starts and one when it
ends, with its duration. On a terminal a ticker shows the elapsed time in between (on a pipe or in a
log file, no ticker: two lines per phase). ``PAGEDKV_QUIET=1`` silences it (the tests' servers do not
need it; the user's terminal does).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from pagedkv import envs

PREFIX = "pagedkv: "
_TICK_S = 1.0


def quiet() -> bool:
    return envs.QUIET.get()


def interactive() -> bool:
    """Whether stderr is a terminal (progress bars and tickers are for people, not for log files)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def notice(message: str) -> None:
    """One line on stderr, unless ``PAGEDKV_QUIET``."""
    if not quiet():
        print(PREFIX + message, file=sys.stderr, flush=True)


_open: list[object] = []  # the phases under way, innermost last: only the innermost ticks


@contextmanager
def phase(message: str, done: str = "done", ticker: bool = True) -> Iterator[None]:
    """Print ``message`` now and ``message: done in N s`` at the end (``failed after N s`` if the
    block raises); on a terminal, an elapsed-time ticker line between them (unless ``ticker`` is
    False: the block shows a progress bar of its own; a phase inside another silences the outer's)."""
    if quiet():
        yield
        return
    start = time.monotonic()
    stop = threading.Event()
    token = object()
    if _open and interactive():
        print("\r\x1b[K", end="", file=sys.stderr, flush=True)  # the outer phase's ticker line
    notice(message + " ...")
    _open.append(token)
    thread = None
    if ticker and interactive():
        def tick() -> None:
            while not stop.wait(_TICK_S):
                if _open and _open[-1] is token:
                    print(f"\r\x1b[K  ... {time.monotonic() - start:.0f} s", end="", file=sys.stderr, flush=True)

        thread = threading.Thread(target=tick, name="pagedkv-progress", daemon=True)
        thread.start()
    outcome = "failed after"
    try:
        yield
        outcome = done + " in"
    finally:
        stop.set()
        _open.remove(token)
        if thread is not None:
            thread.join()
            print("\r\x1b[K", end="", file=sys.stderr)  # the ticker's line, cleared
        notice(f"{message}: {outcome} {time.monotonic() - start:.1f} s")
