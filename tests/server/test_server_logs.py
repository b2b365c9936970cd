"""``pagedkv serve``'s logs, read from a real server process: the start-up summary, a line per
request (200, 400, 429, a client that went away), the periodic stats line; then
``--disable-log-requests`` and ``--log-format json``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagedkv_testing.server import free_port, stop_server
from pagedkv_testing.tiny_model import write_tiny_model


class _Log:
    """The server's output lines, read in a thread (the pipe never fills)."""

    def __init__(self, proc) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc) -> None:
        for line in proc.stdout:
            with self._lock:
                self.lines.append(line.rstrip("\n"))

    def wait_for(self, predicate, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                found = [line for line in self.lines if predicate(line)]
            if found:
                return found[-1]
            time.sleep(0.05)
        raise AssertionError("no such log line; the log:\n" + "\n".join(self.lines[-40:]))

    def snapshot(self) -> list[str]:
        with self._lock:
            return list(self.lines)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Wide enough that 1000 tokens take seconds: a stream is still running when the 429 is asked for.
    return write_tiny_model(tmp_path_factory.mktemp("logs") / "tiny", hidden_size=256, num_layers=6,
                            intermediate_size=1024)


def _serve(model_dir: Path, *extra: str):
    """A server process and its whole log (spawn_server keeps only the listening line)."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedkv.server.cli", str(model_dir), "--port", str(port), "--num-kv-blocks", "128",
           "--max-num-seqs", "1", "--max-queue", "0", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PAGEDKV_LOG_STATS_INTERVAL": "0.5"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    log = _Log(proc)
    try:
        log.wait_for(lambda s: "listening on" in s, timeout=120)
    except AssertionError:
        proc.kill()
        raise
    return proc, log, f"http://127.0.0.1:{port}"


def test_startup_summary_request_lines_and_stats_line(model_dir: Path) -> None:
    proc, log, url = _serve(model_dir)
    try:
        lines = "\n".join(log.snapshot())
        assert "[startup] model tiny" in lines and "dtype float32" in lines and "MiB, max_model_len 1024" in lines
        assert "threads" in lines and "max_model_len 1024" in lines
        assert "KV cache: device 128 blocks (" in lines and "16 tokens per block" in lines
        assert f"address {url}: no API key" in lines

        ok = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=30)
        assert ok.status_code == 200
        line = log.wait_for(lambda s: "[requests] 200 POST /v1/completions" in s)
        assert "prompt_tokens=" in line and "output_tokens=4" in line and "cached_tokens=" in line
        assert "ttft_s=0." in line and "total_s=" in line and "tenant=-" in line and "finish=length" in line

        bad = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 0}, timeout=30)
        assert bad.status_code == 400
        log.wait_for(lambda s: "[requests] 400 POST /v1/completions total_s=" in s)

        # One request runs (max_num_seqs 1, no queue): a second one gets 429; then the first
        # one's client leaves mid-stream.
        body = {"prompt": "go", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as stream:
            events = stream.iter_lines()  # (kept: a dropped iterator closes the response)
            next(events)
            busy = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            assert busy.status_code == 429
        log.wait_for(lambda s: "[requests] 429 POST /v1/completions" in s)
        gone = log.wait_for(lambda s: "client disconnected" in s)
        assert "200 POST /v1/completions" in gone and "finish=abort" in gone
        assert int(gone.split("output_tokens=")[1].split()[0]) < 1000

        stats = log.wait_for(lambda s: "[stats] Avg prompt throughput:" in s)
        for part in ("Avg generation throughput:", "Running:", "Waiting:", "Swapped:", "KV cache usage: device",
                     "host", "Prefix cache hit rate:"):
            assert part in stats
        # Probes are not logged at info; an idle server writes no further stats lines.
        httpx.get(f"{url}/health", timeout=10)
        time.sleep(2.0)
        settled = log.snapshot()
        time.sleep(1.5)
        later = log.snapshot()
        assert not any("/health" in s for s in later)
        assert [s for s in later if "[stats]" in s] == [s for s in settled if "[stats]" in s]
    finally:
        stop_server(proc)


def test_disable_log_requests_and_json_format(model_dir: Path) -> None:
    proc, log, url = _serve(model_dir, "--disable-log-requests", "--log-format", "json", "--api-key", "k")
    try:
        headers = {"Authorization": "Bearer k"}
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 3}, headers=headers,
                          timeout=30).status_code == 200
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 3},
                          timeout=30).status_code == 401
        stats = json.loads(log.wait_for(lambda s: '"logger": "pagedkv.server.stats"' in s))
        assert stats["level"] == "INFO" and stats["generation_throughput"] > 0
        assert {"prompt_throughput", "running", "waiting", "swapped", "kv_device_usage", "kv_host_blocks",
                "prefix_cache_hit_rate"} <= stats.keys()
        records = [json.loads(s) for s in log.snapshot() if s.startswith("{")]
        startup = [r for r in records if r["logger"] == "pagedkv.server.startup"]
        assert startup[0]["model"] == "tiny" and startup[0]["weights_bytes"] > 0 and startup[0]["threads"] >= 1
        assert startup[1]["kv_device_blocks"] == 128 and startup[1]["block_size"] == 16
        assert startup[2]["api_key"] is True
        assert not [r for r in records if r["logger"] == "pagedkv.server.requests"]
    finally:
        stop_server(proc)


def test_json_request_lines_at_debug(model_dir: Path) -> None:
    """A request line in JSON carries its figures as fields (a log pipeline reads them); debug
    adds the probes' lines and client addresses."""
    proc, log, url = _serve(model_dir, "--log-format", "json", "--disable-log-stats", "--log-level", "debug")
    try:
        httpx.get(f"{url}/health", timeout=10)  # a probe: logged at debug only, with the client address
        probe = json.loads(log.wait_for(lambda s: '"route": "/health"' in s))
        assert probe["level"] == "DEBUG" and probe["status"] == 200 and probe["client"].startswith("127.0.0.1:")
        httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2}, timeout=30)
        # The request line is written once the response is sent, maybe after the client has it: wait for
        # that route's line (the probe's line above is a request line too).
        line = json.loads(log.wait_for(lambda s: '"pagedkv.server.requests"' in s
                                       and '"route": "/v1/chat/completions"' in s))
        assert line["status"] == 200 and line["output_tokens"] == 2
        assert line["prompt_tokens"] > 0 and line["ttft_s"] > 0 and line["finish_reason"] == "length"
        assert line["client_disconnected"] is False
        time.sleep(1.0)
        assert '"pagedkv.server.stats"' not in "\n".join(log.snapshot())
    finally:
        stop_server(proc)
