"""Probes for the latency tests of issue 27: a victim stream's token times and /health's answer
times, each on a thread of its own, against a server process (tests only)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class HealthProbe:
    """GET each of ``paths`` (default /health) every ``interval`` seconds until stopped;
    ``latencies`` (seconds each, a failure or a status other than 200 counted as infinite) say
    whether the event loop answered throughout."""

    def __init__(self, base: str, interval: float = 0.25, paths: tuple[str, ...] = ("/health",),
                 headers: dict[str, str] | None = None) -> None:
        self.base, self.interval, self.paths, self.headers = base, interval, paths, headers or {}
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10.0, headers=self.headers) as client:
            while not self._stop.is_set():
                for path in self.paths:
                    start = time.monotonic()
                    try:
                        ok = client.get(f"{self.base}{path}").status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    self.latencies.append(time.monotonic() - start if ok else float("inf"))
                self._stop.wait(self.interval)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    @property
    def worst(self) -> float:
        return max(self.latencies, default=0.0)

    def assert_answered_within(self, seconds: float) -> None:
        """Every probe answered 200 within ``seconds`` (and there was at least one)."""
        assert self.latencies, "no probe was answered"
        assert self.worst <= seconds, f"a probe of {self.paths} took {self.worst:.2f} s (inf: failed)"


class StreamProbe:
    """A streamed completion on a thread: the monotonic time of each delivery with a token
    (``times``), from ``sent``. ``stop()`` closes the stream (the server aborts the request)."""

    def __init__(self, base: str, body: dict[str, Any]) -> None:
        self.base, self.body = base, {**body, "stream": True}
        self.sent = 0.0
        self.times: list[float] = []
        self.error: str | None = None
        self.finished = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> StreamProbe:
        self._thread.start()
        return self

    def _run(self) -> None:
        self.sent = time.monotonic()
        try:
            with httpx.stream("POST", f"{self.base}/v1/completions", json=self.body, timeout=600) as r:
                if r.status_code != 200:
                    self.error = f"{r.status_code}: {r.read()[:300]!r}"
                    return
                for line in r.iter_lines():
                    if self._stop.is_set():
                        return
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if any(c.get("text") for c in event.get("choices", [])):
                        self.times.append(time.monotonic())
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        finally:
            self.finished.set()

    def wait_tokens(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.times) < count and not self.finished.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    @property
    def ttft(self) -> float:
        return self.times[0] - self.sent if self.times else float("inf")

    def worst_gap(self, since: float = 0.0, until: float = float("inf")) -> float:
        """The longest wait between two deliveries, counting those from ``since`` to ``until``."""
        times = [t for t in self.times if since <= t <= until]
        return max((b - a for a, b in zip(times, times[1:])), default=0.0)


@contextmanager
def victim_streams(url: str, health: HealthProbe, headers: dict[str, str] | None = None) -> Iterator[None]:
    """Victim streams (200 greedy tokens of the tiny model, one after another) and ``health``'s
    polling while the block runs. On exit asserts: every victim got a 200, its first token within
    10 s and no gap between its tokens over 5 s; every poll of ``health`` a 200 within 1 s."""
    body = {"model": "tiny", "prompt": "the victim streams", "max_tokens": 200, "ignore_eos": True,
            "stream": True, "temperature": 0}
    victims: list[tuple[float, list[float]]] = []  # (sent, token times) per stream
    errors: list[str] = []
    stop = threading.Event()

    def stream() -> None:
        while not stop.is_set():
            times: list[float] = []
            victims.append((time.monotonic(), times))
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers or {},
                                  timeout=60) as r:
                    if r.status_code != 200:
                        errors.append(f"a victim stream got {r.status_code}")
                        return
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            times.append(time.monotonic())
            except httpx.HTTPError as exc:
                errors.append(repr(exc))
                return

    victim = threading.Thread(target=stream, daemon=True)
    with health:
        victim.start()
        time.sleep(0.5)
        try:
            yield
        finally:
            stop.set()
            victim.join(90)
    health.assert_answered_within(1.0)
    assert not errors and victims, errors
    for sent, times in victims:
        assert times, "a victim stream got no token"
        assert times[0] - sent <= 10, f"a victim's first token came after {times[0] - sent:.1f} s"
        gap = max((b - a for a, b in zip(times, times[1:])), default=0.0)
        assert gap <= 5, f"a victim's longest gap was {gap:.2f} s"
