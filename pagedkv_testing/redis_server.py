"""A throwaway Redis server for tests and benchmarks: the operating system's ``redis-server`` on a
free loopback port, in a temporary directory, with no persistence (no RDB, no AOF), stopped and
removed on exit. Safe under pytest-xdist: each server has its own port and directory.

    with RedisServer() as redis:
        LLM(model, kv_remote_url=redis.url, ...)
        redis.stop(); redis.start()     # a restart (the data is gone: nothing persists)
        redis.client().flushall()

``redis_server_binary()`` is None where the server is not installed (``scripts/setup.sh --test``
installs it with apt where it can); tests skip with that reason.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

MISSING = ("redis-server is not installed (apt-get install -y redis-server; scripts/setup.sh --test "
           "installs it where it can)")


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process (see the module docstring). ``password``: ``requirepass``
    (the URL then carries it); ``maxmemory``: bytes, with ``allkeys-lru`` eviction; ``tls``: TLS
    only, with a self-signed certificate for 127.0.0.1 made by ``openssl`` (``ca_file``; the URL
    is ``rediss://`` and names it)."""

    def __init__(self, *, password: str | None = None, maxmemory: int | None = None, tls: bool = False) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError(MISSING)
        self.binary = binary
        self.password = password
        self.maxmemory = maxmemory
        self.tls = tls
        self.port = 0
        self.directory = Path(tempfile.mkdtemp(prefix="pagedkv-redis-"))
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f"default:{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.ca_file}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def ca_file(self) -> Path:
        return self.directory / "cert.pem"

    def _make_certificate(self) -> None:
        if self.ca_file.exists():
            return
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-keyout", str(self.directory / "key.pem"), "-out", str(self.ca_file),
                        "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                       check=True, capture_output=True)

    def start(self, timeout: float = 10.0) -> None:
        """Start the server (on its old port after a ``stop``, so clients reconnect to it)."""
        if self.tls:
            self._make_certificate()
        for _ in range(5):  # a free port may be taken between asking and binding: try another
            port = self.port or _free_port()
            listen = (["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(self.ca_file),
                       "--tls-key-file", str(self.directory / "key.pem"), "--tls-auth-clients", "no"]
                      if self.tls else ["--port", str(port)])
            args = [self.binary, *listen, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                    "--dir", str(self.directory), "--protected-mode", "no", "--enable-debug-command", "yes",
                    "--logfile", str(self.directory / "redis.log")]
            if self.password:
                args += ["--requirepass", self.password]
            if self.maxmemory:
                args += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", "allkeys-lru"]
            self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.process.poll() is None:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                        self.port = port
                        return
                except OSError:
                    time.sleep(0.02)
            self.stop()
            if self.port:  # its own port after a restart: not free again yet, wait and retry
                time.sleep(0.2)
        raise RuntimeError(f"redis-server did not start: {self._log_tail()}")

    def stop(self) -> None:
        """Stop the server (its data is gone: nothing persists)."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def client(self) -> Any:
        """A ``redis.Redis`` client of this server (raw bytes)."""
        import redis
        if self.tls:
            return redis.Redis.from_url(self.url)
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _log_tail(self) -> str:
        try:
            return (self.directory / "redis.log").read_text()[-1000:]
        except OSError:
            return "(no log)"
