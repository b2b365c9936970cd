"""Concurrency, client disconnects and the /metrics endpoint against the real engine."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedkv_testing.server import ServerThread, tiny_engine
from pagedkv_testing.tiny_model import write_tiny_model

pytestmark = [pytest.mark.timeout(180), pytest.mark.serial]

NUM_CONCURRENT = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    engine = tiny_engine(model_dir, block_size=16, num_kv_blocks=512, max_num_seqs=NUM_CONCURRENT,
                         max_model_len=512, enable_prefix_caching=True, seed=0)
    with ServerThread(engine, served_model_names=["tiny"]) as s:
        yield s


def test_many_simultaneous_streams(server: ServerThread) -> None:
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=200)))

    async def one(i: int) -> tuple[int, int, int, str]:
        max_tokens = 4 + i % 13
        prompt = f"request number {i} says hello"
        chunks = [ch async for ch in await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True, seed=i,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})]
        usage = chunks[-1].usage
        finish = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
        assert finish == ["length"]
        assert usage.prompt_tokens == len(server.engine.tokenizer.encode(prompt))
        return i, max_tokens, usage.completion_tokens, prompt

    async def all_of_them() -> list[tuple[int, int, int, str]]:
        async with client:
            return await asyncio.gather(*(one(i) for i in range(NUM_CONCURRENT)))

    start = time.monotonic()
    results = asyncio.run(all_of_them())
    assert len(results) == NUM_CONCURRENT
    for _, max_tokens, completion_tokens, _ in results:
        assert completion_tokens == max_tokens
    stats = server.wait_idle()
    assert stats.kv.used_blocks == 0
    print(f"{NUM_CONCURRENT} streams in {time.monotonic() - start:.1f}s")


def _open_stream_and_drop(server: ServerThread, body: dict) -> None:
    """Send a streaming request over a raw socket, read the first event, then vanish."""
    payload = httpx.Request("POST", f"{server.url}/v1/completions", json=body)
    raw = (f"POST /v1/completions HTTP/1.1\r\nHost: {server.host}\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(payload.read())}\r\n\r\n").encode() + payload.read()
    with socket.create_connection((server.host, server.port), timeout=30) as sock:
        sock.sendall(raw)
        received = b""
        while b"data: " not in received:
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
        assert received.startswith(b"HTTP/1.1 200"), received


def test_disconnect_mid_stream_frees_blocks(server: ServerThread) -> None:
    before = server.wait_idle().generation_tokens_total
    body = {"prompt": "a long story " * 8, "max_tokens": 400, "stream": True, "ignore_eos": True}
    for _ in range(3):
        _open_stream_and_drop(server, body)
    # An httpx client that closes the stream early (the usual client-side cancel).
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "go on"}], "max_tokens": 400, "stream": True,
                "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content":""' not in line:
                    break
    stats = server.wait_idle(timeout=30)
    assert stats.kv.used_blocks == 0
    # Far fewer tokens were generated than the 4 x 400 asked for.
    assert stats.generation_tokens_total - before < 4 * 400


def test_disconnect_while_waiting_for_a_full_response(server: ServerThread) -> None:
    engine = server.engine
    real_step = engine.step

    def slow_step():  # 10 ms a step: 480 tokens take ~5 s, far longer than the client waits
        time.sleep(0.01)
        return real_step()

    before = server.wait_idle().generation_tokens_total
    engine.step = slow_step
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", timeout=0.5,
                       json={"prompt": "never read", "max_tokens": 480, "ignore_eos": True})
        stats = server.wait_idle(timeout=10)
    finally:
        del engine.step
    assert stats.kv.used_blocks == 0
    assert stats.generation_tokens_total - before < 300


def _samples(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[key] = s.value
    return out


def test_metrics_agree_with_engine(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.post("/v1/completions", json={"prompt": "metrics please", "max_tokens": 5}).status_code == 200
        stats = server.wait_idle()
        r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = _samples(r.text)
    kv = stats.kv
    assert m["pagedkv_kv_blocks_total"] == kv.num_blocks
    assert m[f"pagedkv_kv_cache_dtype_info,kv_cache_dtype={stats.kv_cache_dtype}"] == 1
    assert m["pagedkv_kv_bytes_per_block"] == stats.kv_bytes_per_block > 0
    assert m["pagedkv_kv_offloaded_blocks_total"] == kv.offloaded_blocks
    assert m["pagedkv_prefix_cache_host_hits_total"] == kv.host_hit_tokens  # KVStats fields
    assert m["pagedkv_kv_blocks_used"] == kv.used_blocks == 0
    assert m["pagedkv_kv_blocks_free"] == kv.free_blocks
    assert m["pagedkv_kv_blocks_cached"] == kv.cached_blocks
    assert m["pagedkv_kv_blocks_evictable"] == kv.evictable_blocks
    assert m["pagedkv_kv_cache_usage_ratio"] == pytest.approx(kv.usage)
    assert m["pagedkv_kv_fragmentation_ratio"] == pytest.approx(kv.fragmentation)
    assert m["pagedkv_prefix_cache_queries_total"] == kv.prefix_query_tokens
    assert m["pagedkv_prefix_cache_hits_total"] == kv.prefix_hit_tokens
    assert m["pagedkv_kv_evictions_total"] == kv.evictions
    assert m["pagedkv_preemptions_total,mode=recompute"] == stats.preemptions_recompute
    assert m["pagedkv_preemptions_total,mode=swap"] == stats.preemptions_swap
    assert m["pagedkv_swapped_blocks_total,direction=out"] == kv.swapped_out_blocks
    assert m["pagedkv_swapped_blocks_total,direction=in"] == kv.swapped_in_blocks
    assert m["pagedkv_num_requests_running"] == stats.num_running == 0
    assert m["pagedkv_num_requests_waiting"] == stats.num_waiting == 0
    assert m["pagedkv_num_requests_swapped"] == stats.num_swapped == 0
    assert m["pagedkv_prompt_tokens_total"] == stats.prompt_tokens_total > 0
    assert m["pagedkv_generation_tokens_total"] == stats.generation_tokens_total > 0
    assert m["pagedkv_time_to_first_token_seconds_count"] >= 1
    assert m["pagedkv_time_per_output_token_seconds_count"] >= 1
    assert m["pagedkv_e2e_request_latency_seconds_count"] >= 1
    assert m["pagedkv_requests_finished_total,finish_reason=length"] >= 1
