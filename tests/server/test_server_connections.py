"""Issue 27, item 9: connections and uploads have limits (server/connections.py).

Against a ``pagedkv serve`` process with short timeouts: 500 idle and half-sent connections and
40 stalled 15 MB uploads leave /health answering within 1 s and the server's RSS within 100 MB;
the idle ones are closed by the header timeout (a half-sent request gets 408), uploads beyond
--max-uploads get 503 at once, the others 408 at the body timeout. At --max-connections a new
connection closes the longest-idle one, or gets 503 when none is idle. Out-of-descriptor errors
are logged once per interval. The KV-events replay socket bounds what it keeps per peer.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagedkv.server import connections
from pagedkv.server.connections import RateLimitedLog, fd_budget, install_fd_exhaustion_handler
from pagedkv_testing.latency_probe import rss_bytes
from pagedkv_testing.server import free_port, spawn_server, stop_server
from pagedkv_testing.tiny_model import write_tiny_model

pytestmark = [pytest.mark.timeout(180), pytest.mark.serial]

HEADER_TIMEOUT = 3.0
BODY_TIMEOUT = 8.0
MAX_UPLOADS = 4
MAX_CONNECTIONS = 700


@pytest.fixture(scope="module", autouse=True)
def enough_fds() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 4096:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[object, str]]:
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny-conn"))
    port = free_port()
    proc, _ = spawn_server([str(model_dir), "--port", str(port), "--num-kv-blocks", "128", "--max-model-len", "256",
                            "--header-timeout", str(HEADER_TIMEOUT), "--body-timeout", str(BODY_TIMEOUT),
                            "--max-uploads", str(MAX_UPLOADS), "--max-connections", str(MAX_CONNECTIONS)])
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        stop_server(proc)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _reply(s: socket.socket, timeout: float) -> bytes:
    """What the server sends until it closes (b"" when it closes silently); None-like b"?" on timeout."""
    s.settimeout(timeout)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except TimeoutError:
        return data or b"?"
    except ConnectionResetError:
        pass
    return data


class HealthWatch:
    """/health polled every 0.1 s in a thread; ``check()`` asserts each was a 200 within 1 s."""

    def __init__(self, url: str) -> None:
        self.url, self.results = url, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll)

    def _poll(self) -> None:
        with httpx.Client(timeout=10) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    status = c.get(self.url + "/health").status_code
                except httpx.HTTPError as exc:
                    status = repr(exc)
                self.results.append((status, time.monotonic() - t0))
                time.sleep(0.1)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def check(self) -> float:
        assert self.results and all(s == 200 for s, _ in self.results), [r for r in self.results if r[0] != 200][:5]
        worst = max(t for _, t in self.results)
        assert worst < 1.0, f"/health took {worst:.2f} s"
        return worst


def test_idle_sockets_and_stalled_uploads(server) -> None:
    proc, url = server
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    before = rss_bytes(proc.pid)
    payload = b"x" * (14 << 20)
    with HealthWatch(url) as watch:
        idle = [_connect(url) for _ in range(250)]
        partial = [_connect(url) for _ in range(250)]
        for s in partial:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        uploads, refused = [], 0
        for _ in range(40):
            s = _connect(url)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % (15 << 20))
            s.settimeout(0.3)
            try:
                early = s.recv(65536)  # beyond --max-uploads: 503 at once
            except TimeoutError:
                early = b""
            if early:
                early += _reply(s, 5)
                assert early.startswith(b"HTTP/1.1 503") and b"too_many_uploads" in early, early[:200]
                refused += 1
                s.close()
                continue
            s.settimeout(30)
            s.sendall(payload)  # most of it, then nothing more
            uploads.append(s)
        assert len(uploads) == MAX_UPLOADS and refused == 40 - MAX_UPLOADS
        time.sleep(0.5)
        held = rss_bytes(proc.pid) - before
        assert held < 100 << 20, f"{held >> 20} MB held"
        # the body timeout: 408 and closed
        for s in uploads:
            reply = _reply(s, BODY_TIMEOUT + 5)
            assert reply.startswith(b"HTTP/1.1 408") and b"--body-timeout" in reply, reply[:200]
        # the header timeout: idle ones closed silently, half-sent ones with 408
        for s in idle:
            assert _reply(s, HEADER_TIMEOUT + 5) == b""
        for s in partial:
            assert _reply(s, HEADER_TIMEOUT + 5).startswith(b"HTTP/1.1 408")
        for s in [*idle, *partial, *uploads]:
            s.close()
    worst = watch.check()
    time.sleep(1.5)  # memory handed back after the last large request
    after = rss_bytes(proc.pid) - before
    assert after < 100 << 20, (held >> 20, after >> 20, worst)
    r = httpx.post(url + "/v1/completions", json={"prompt": "still serving", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200


def test_the_connection_cap(server) -> None:
    proc, url = server
    idle = [_connect(url) for _ in range(MAX_CONNECTIONS)]
    time.sleep(0.5)
    # At the cap, a request still gets through: the longest-idle connection makes room.
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert _reply(idle[0], 2) == b""  # the first (oldest) was closed
    for s in idle:
        s.close()
    time.sleep(0.5)
    # Busy connections (a body still coming) are never closed to make room: past them, 503.
    busy = []
    for _ in range(MAX_CONNECTIONS):
        s = _connect(url)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        busy.append(s)
    time.sleep(1.0)
    extra = _connect(url)
    reply = _reply(extra, 5)
    assert reply.startswith(b"HTTP/1.1 503") and b"too_many_connections" in reply, reply[:200]
    for s in busy:
        s.close()
    time.sleep(0.5)
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_fd_exhaustion_is_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    loop = asyncio.new_event_loop()
    others: list[dict] = []
    loop.set_exception_handler(lambda loop, context: others.append(context))
    try:
        install_fd_exhaustion_handler(loop, RateLimitedLog(interval=60))
        with caplog.at_level(logging.ERROR, logger=connections.__name__):
            for _ in range(1000):
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": OSError(errno.EMFILE, "Too many open files")})
            loop.call_exception_handler({"message": "something else", "exception": ValueError("x")})
    finally:
        loop.close()
    lines = [r for r in caplog.records if r.name == connections.__name__]
    assert len(lines) == 1 and "Too many open files" in lines[0].getMessage()
    assert [c["message"] for c in others] == ["something else"]  # the rest goes where it went


def test_the_connection_cap_fits_the_fd_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resource, "getrlimit", lambda which: (512, 512))
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: None)
    monkeypatch.setattr(os, "listdir", lambda path: ["0"] * 40)  # 40 descriptors open
    assert fd_budget(1024) == (512 - 40 - 2 * 64 - connections._RESERVED_FDS, 64)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, 100_000))
    assert fd_budget(1024) == (1024, 2048)  # raised towards the hard limit first


def test_the_replay_socket_bounds_what_it_keeps_per_peer() -> None:
    """50 peers ask for a replay of ~16 MB of batches, over and over, and never read: the publisher
    keeps at most REPLAY_HWM messages for each (it kept up to ZMQ's default 1,000, or everything
    asked); a reader gets the batches in replies of at most REPLAY_MAX_BYTES, then the end mark."""
    zmq = pytest.importorskip("zmq")
    from pagedkv.kv_events import BlockStored
    from pagedkv.server.kv_events import END_SEQ, REPLAY_HWM, REPLAY_MAX_BYTES, KVEventPublisher, KVEventsConfig

    pub_port, replay_port = free_port(), free_port()
    publisher = KVEventPublisher(KVEventsConfig(endpoint=f"tcp://127.0.0.1:{pub_port}", buffer_steps=2000,
                                                replay_endpoint=f"tcp://127.0.0.1:{replay_port}"))
    ctx = zmq.Context()
    try:
        for i in range(2000):  # ~8 KB each: a 500-token prefill's blocks
            publisher.publish([BlockStored([i.to_bytes(4, "big") + bytes(28)] * 32, None,
                                           list(range(70_000, 71_600)), 16, "GPU")])
        deadline = time.monotonic() + 60
        while publisher.published < 2000 and time.monotonic() < deadline:
            time.sleep(0.05)
        buffered = sum(len(p) for _, p in publisher._buffer)
        assert publisher.published == 2000 and buffered > 12 << 20
        before = rss_bytes_self()
        peers = []
        for _ in range(50):
            peer = ctx.socket(zmq.DEALER)
            peer.setsockopt(zmq.RCVHWM, 1)  # (it reads nothing anyway)
            peer.connect(f"tcp://127.0.0.1:{replay_port}")
            peers.append(peer)
        for _ in range(4):
            for peer in peers:
                peer.send_multipart([b"", (0).to_bytes(8, "big")])
            time.sleep(1.0)
        time.sleep(2.0)
        held = rss_bytes_self() - before
        largest = max(len(p) for _, p in publisher._buffer)
        assert held < 50 * REPLAY_HWM * largest + (16 << 20), f"{held >> 20} MB held for 50 peers"
        assert publisher.replays_cut > 0
        for peer in peers:
            peer.close(linger=0)
        # A reader: replies of at most REPLAY_MAX_BYTES, each ending with the end mark, from where it asks.
        reader = ctx.socket(zmq.DEALER)
        reader.connect(f"tcp://127.0.0.1:{replay_port}")
        seqs: list[int] = []
        for _ in range(40):
            reader.send_multipart([b"", (seqs[-1] + 1 if seqs else 0).to_bytes(8, "big")])
            size = 0
            while True:
                assert reader.poll(10_000)
                _, seq, payload = reader.recv_multipart()
                if seq == END_SEQ:
                    break
                seqs.append(int.from_bytes(seq, "big"))
                size += len(payload)
            assert size <= REPLAY_MAX_BYTES
            if seqs[-1] == 1999:
                break
        assert seqs == list(range(2000))
        reader.close(linger=0)
    finally:
        publisher.close()
        ctx.destroy(linger=0)


def rss_bytes_self() -> int:
    return rss_bytes(os.getpid())


def test_a_low_fd_limit_is_not_exhausted_by_idle_sockets(tmp_path: Path) -> None:
    """The finding: with a low open-file limit, 320 idle sockets hung every request and the log grew
    104 MB in 40 s. With the limit at 400 the cap is lowered to fit: 500 idle sockets make the
    oldest idle ones close, /health answers each time, no accept fails, and the log stays small."""
    import subprocess
    import sys

    model_dir = write_tiny_model(tmp_path / "tiny")
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedkv.server.cli", str(model_dir), "--port", str(port), "--num-kv-blocks",
             "128", "--max-model-len", "256", "--log-level", "info"], stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (400, 400)))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while "listening on" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        lowered = re.search(r"max_connections lowered from 1024 to (\d+)", log.read_text())
        assert lowered, log.read_text()[-2000:]
        cap = int(lowered.group(1))
        sockets = []
        with HealthWatch(url) as watch:
            for _ in range(500):
                sockets.append(_connect(url))
            time.sleep(1.0)
        watch.check()
        closed = sum(_reply(s, 0.05) == b"" for s in sockets)
        assert closed >= 500 - cap  # the oldest idle ones made room
        for s in sockets:
            s.close()
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200
        assert log.stat().st_size < 64 << 10, log.read_text()[-2000:]
        assert "Too many open files" not in log.read_text()
    finally:
        stop_server(proc)
