"""``pagedkv serve`` as a process: flags, where it listens, and draining on SIGTERM."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from pagedkv.engine.flags import engine_options
from pagedkv.server.cli import add_serve_parser
from pagedkv_testing.server import free_port, spawn_server
from pagedkv_testing.tiny_model import write_tiny_model

pytestmark = [pytest.mark.timeout(120), pytest.mark.serial]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagedkv")
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_flags_use_vllm_names() -> None:
    args = parse(["m", "--block-size", "32", "--no-enable-prefix-caching", "--kv-cache-memory", "64MiB",
                  "--max-num-seqs", "8", "--preemption-mode", "swap", "--swap-space", "0.5", "--seed", "3"])
    assert args.model == "m" and args.host == "127.0.0.1" and args.port == 8000
    assert engine_options(args) == {"block_size": 32, "enable_prefix_caching": False,
                                    "kv_cache_memory": "64MiB", "max_num_seqs": 8,
                                    "preemption_mode": "swap", "swap_space": 0.5, "seed": 3}
    assert engine_options(parse([])) == {}
    assert parse([]).model is None
    assert engine_options(parse(["--kv-cache-memory", "1048576", "--threads", "2"])) == {
        "kv_cache_memory": 1048576, "threads": 2}


def _start(model_dir: Path, port: int, *extra: str) -> subprocess.Popen[str]:
    proc, line = spawn_server([str(model_dir), "--port", str(port), "--num-kv-blocks", "128",
                               "--max-model-len", "512", *extra], env={"PAGEDKV_API_KEY": "env-key"})
    assert f"http://127.0.0.1:{port}" in line
    return proc


def test_sigterm_drains_in_flight_requests(tmp_path: Path) -> None:
    # Wide enough that 300 tokens take seconds: the drain is observable from outside.
    model_dir = write_tiny_model(tmp_path / "tiny", hidden_size=256, num_layers=6, intermediate_size=1024)
    port = free_port()
    proc = _start(model_dir, port)
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": "Bearer env-key"}
    try:
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 401
        events: list[str] = []
        first_event = threading.Event()

        def stream() -> None:
            body = {"prompt": "keep going", "max_tokens": 300, "stream": True, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_event.set()

        t = threading.Thread(target=stream)
        t.start()
        assert first_event.wait(60)
        proc.send_signal(signal.SIGTERM)
        # While the stream drains, the listener stays open and answers new requests with 503.
        late = None
        while t.is_alive():
            try:
                late = httpx.post(f"{url}/v1/completions", json={"prompt": "late", "max_tokens": 2},
                                  headers=headers, timeout=10)
                health = httpx.get(f"{url}/health", timeout=10)
            except httpx.HTTPError:
                break  # already closed: only allowed once the stream is done
            if late.status_code == 503:
                break
        assert t.is_alive(), "the stream finished before the drain could be observed"
        assert late is not None and late.status_code == 503, late.text if late is not None else None
        assert late.json()["error"]["code"] == "server_draining" and late.headers["Retry-After"]
        assert health.status_code == 503
        t.join(60)
        # The stream that was running when SIGTERM came finished in full.
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 300
        assert proc.wait(60) == 0
        out = proc.stdout.read() if proc.stdout else ""
        assert "draining" in out
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_writes_the_prefix_cache_to_the_disk_tier_and_a_restart_hits_it(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "tiny")
    kv_dir = tmp_path / "kv"
    headers = {"Authorization": "Bearer env-key"}
    body = {"prompt": "the same long system prompt " * 12, "max_tokens": 4, "temperature": 0}
    texts, hits = [], []
    for _ in range(2):
        port = free_port()
        proc = _start(model_dir, port, "--kv-offload-dir", str(kv_dir), "--block-size", "4")
        try:
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers, timeout=60)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
            metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=headers, timeout=10).text
            hits.append(next(float(line.split()[-1]) for line in metrics.splitlines()
                             if line.startswith("pagedkv_kv_tier_hit_tokens_total") and 'tier="disk"' in line))
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert list((kv_dir / "blocks").glob("*/*.kvb")), "nothing reached the disk tier at shutdown"
    assert texts[0] == texts[1]
    assert hits[0] == 0 and hits[1] > 0
