"""Test and benchmark helpers (not shipped in the package): the app in a background thread on a
free loopback port, a server process, an engine on the tiny model.

    with ServerThread(engine, api_key="k") as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="k")
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from pagedkv.server.app import create_app
from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.serving import ServerState


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def spawn_server(args: list[str], *, env: dict[str, str] | None = None,
                 timeout: float = 90.0) -> tuple[subprocess.Popen[str], str]:
    """Start ``python -m pagedkv.server.cli ARGS`` and wait until it says where it listens.

    Returns the process and that line; raises RuntimeError (with the server's output) if it
    exits or stays silent for ``timeout`` seconds.
    """
    # serve's default block size is auto (docs/block_size.md), which follows the machine's kernel
    # table; tests size their pools in blocks of 16 unless they say otherwise
    if not any(a.startswith("--block-size") for a in args):
        args = [*args, "--block-size", "16"]
    cmd = [sys.executable, "-m", "pagedkv.server.cli", *args]
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    _widen_pipe(proc.stdout)
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if "listening on" in line:
            return proc, line
    proc.kill()
    raise RuntimeError(f"server did not start: {proc.stdout.read()[-2000:]}")


def _widen_pipe(stream: Any) -> None:
    """Let the server's output pipe hold 1 MiB (Linux; 64 KiB by default): a test that reads only
    the listening line must not block the server once its request log lines fill the pipe."""
    try:
        import fcntl
        fcntl.fcntl(stream.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except (ImportError, OSError):
        pass


class ServerThread:
    """An in-process server around ``engine``; ``app_options`` go to :func:`create_app`."""

    def __init__(self, engine: Any, *, host: str = "127.0.0.1", **app_options: Any) -> None:
        self.engine = engine
        self.async_engine = AsyncEngine(engine)
        self.app = create_app(self.async_engine, **app_options)
        self.host = host
        self.port = free_port(host)
        config = uvicorn.Config(self.app, host=host, port=self.port, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=30)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name="pagedkv-test-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def state(self) -> ServerState:
        return self.app.state.server

    def engine_stats(self) -> Any:
        """``engine.stats()`` taken on the engine thread (safe while requests run)."""
        return self.async_engine.call_threadsafe(lambda engine: engine.stats()).result(timeout=30)

    def wait_idle(self, timeout: float = 30.0) -> Any:
        """Wait until no request is in flight in the server or the engine; returns the stats then."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine_stats()
            idle = self.state.active == 0 and self.async_engine.num_in_flight == 0
            if idle and stats.num_running == 0 and stats.num_waiting == 0 and stats.num_swapped == 0:
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not idle: active={self.state.active}, stats={stats}")
            time.sleep(0.05)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(60)



def stop_server(proc: subprocess.Popen[str], timeout: float = 60.0) -> None:
    """SIGTERM a server process (it drains), killing it if it has not exited after ``timeout`` s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

def tiny_engine(folder: str | Path, **options: Any) -> Any:
    """An engine on the tiny model folder written by :func:`write_tiny_model`."""
    from pagedkv.engine import LLMEngine

    return LLMEngine.from_options(model=str(folder), **options)


def run_engine(engine: Any, requests: Any) -> dict[str, Any]:
    """Add ``(request id, prompt, SamplingParams)`` requests, step the engine until all finish, and
    return each request's final ``RequestOutput``; no KV block may be left in use."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.stats().kv.used_blocks == 0
    return done
