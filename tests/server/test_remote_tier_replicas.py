"""Two server replicas sharing one Redis server (the remote KV tier), over HTTP.

Replica A answers a completion; replica B, asked the same prompt afterwards (A still serving),
loads A's prefix from the server: the same greedy text, B's ``/metrics`` count the remote hits,
and neither replica's ``/metrics`` shows the server's password.
"""

from __future__ import annotations

import httpx
import pytest

from pagedkv_testing.redis_server import MISSING, RedisServer, redis_server_binary
from pagedkv_testing.server import ServerThread, tiny_engine
from pagedkv_testing.tiny_model import write_tiny_model

pytest.importorskip("redis", reason="the remote tier's tests need the Redis client (pip install 'pagedkv[redis]')")
pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason=MISSING)

SECRET = "replica-pw-41"


def test_two_replicas_share_a_prefix_through_redis(tmp_path):
    model = write_tiny_model(tmp_path / "tiny")
    prompt = " ".join(f"word{i}" for i in range(120))
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    with RedisServer(password=SECRET) as redis_server:
        options = dict(block_size=16, num_kv_blocks=64, kv_offloading_size=0.01, kv_remote_url=redis_server.url)
        with ServerThread(tiny_engine(model, **options), served_model_names=["m"]) as a, \
                ServerThread(tiny_engine(model, **options), served_model_names=["m"]) as b:
            first = httpx.post(f"{a.base_url}/completions", json=body, timeout=60).json()
            a.wait_idle()
            assert a.async_engine.call_threadsafe(
                lambda engine: engine.tiers.remote.flush(10)).result(timeout=30)
            second = httpx.post(f"{b.base_url}/completions", json=body, timeout=60).json()
            assert second["choices"][0]["text"] == first["choices"][0]["text"]
            assert b.wait_idle().kv.remote_hit_tokens > 0
            metrics = {name: httpx.get(f"{s.url}/metrics", timeout=30).text for name, s in (("a", a), ("b", b))}
            assert 'tier="remote"' in metrics["b"] and "pagedkv_kv_remote_blocks_read_total" in metrics["b"]
            assert all(SECRET not in text for text in metrics.values())
