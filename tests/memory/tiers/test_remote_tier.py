"""The remote tier end to end: two engines on one Redis server share what each computed.

Engine B's request for a prefix only engine A computed (A still running, its pool not under
pressure) is loaded from the server: B's greedy output equals a run without tiers and the KV of
the blocks it loaded is bit-identical to A's. Then the faults: the server stopped mid-run,
restarted, flushed, slow; a corrupted value; another fingerprint's values under the same prefix; a
full write queue; each run's outputs equal the clean run's, nothing hangs, and the counters say
what happened. Shutdown writes the blocks the server lacks; the password stays out of logs and
``/metrics``.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from pagedkv import SamplingParams
from pagedkv.engine import LLMEngine, kv_tiers
from pagedkv.kv_events import BlockStored
from pagedkv.memory.prefix_hash import chain_hashes, root_hash
from pagedkv.memory.tiers.remote import RemoteTier
from pagedkv_testing.hf_checkpoints import make_hf_checkpoint
from pagedkv_testing.redis_server import MISSING, RedisServer, redis_server_binary

pytest.importorskip("redis", reason="the remote tier's tests need the Redis client (pip install 'pagedkv[redis]')")
pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason=MISSING)

B = 4
PREFIX = [(7 * i + 3) % 97 + 5 for i in range(48)]  # 12 blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
HASHES = chain_hashes(root_hash(None, None), PREFIX, B, 0, len(PREFIX) // B)


def _prompt(i: int) -> list[int]:
    return PREFIX + [200 + 3 * i, 201 + i]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_hf_checkpoint(tmp_path_factory.mktemp("remote"), "llama", seed=5))


@pytest.fixture(scope="module")
def reference(model):
    with LLMEngine.from_options(model, block_size=B, num_kv_blocks=200, enable_prefix_caching=False) as engine:
        return [_generate(engine, [_prompt(i)])[0] for i in range(3)]


@pytest.fixture(scope="module")
def server():
    with RedisServer() as s:
        yield s


@pytest.fixture
def redis_db(server):
    if server.process is None:
        server.start()
    server.client().flushall()
    return server


def _engine(model: str, url: str, **kw) -> LLMEngine:
    return LLMEngine.from_options(model, block_size=B, num_kv_blocks=40, kv_offloading_size=0.002,
                                  debug_integrity=True, kv_remote_url=url, **kw)


def _generate(engine: LLMEngine, prompts: list[list[int]], timeout: float = 60.0,
              details: list | None = None) -> list[list[int]]:
    ids = [f"r{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, GREEDY)
    done: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine hung"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
                if details is not None:
                    details.append(out.cache_details)
    return [done[rid] for rid in ids]


def _remote(engine: LLMEngine) -> RemoteTier:
    tier = engine.tiers.remote
    assert tier is not None
    return tier


def _written(engine: LLMEngine, blocks: int = len(HASHES)) -> None:
    """Wait until the engine's remote writer has written (or skipped) ``blocks`` blocks."""
    tier = _remote(engine)
    assert tier.flush(timeout=10)
    s = tier.store.stats()
    assert s.blocks_written + s.already_present >= blocks


def test_b_loads_what_a_computed_with_a_still_running(model, reference, redis_db):
    a, b = _engine(model, redis_db.url, kv_events=True), _engine(model, redis_db.url)
    try:
        assert _generate(a, [_prompt(0)]) == reference[:1]
        _written(a)  # written as they became cached: A's pool is not under pressure
        assert a.kv.stats().evictions == 0 and a.kv.stats().remote_blocks_written >= len(HASHES)
        _remote(a).take_events()  # (the engine takes them each step; the last writes landed after it)
        stored = {h for e in a.take_kv_events() if isinstance(e, BlockStored) and e.medium == "REMOTE"
                  for h in e.block_hashes}
        assert set(HASHES) <= stored
        details: list = []
        assert _generate(b, [_prompt(1)], details=details) == reference[1:2]
        assert details[0].tier_hits == {"device": 0, "host": 0, "disk": 0, "remote": len(PREFIX)}
        s = b.kv.stats()
        assert s.remote_hit_tokens == len(PREFIX) and s.tier_hit_tokens["remote"] == len(PREFIX)
        assert s.host_hit_tokens >= len(PREFIX) and s.remote_blocks_read == len(HASHES)
        loaded = b.runner.block_payloads([b.kv.pool.cached[h].block_id for h in HASHES])
        assert loaded == a.runner.block_payloads([a.kv.pool.cached[h].block_id for h in HASHES])
        assert b.stats().tier_costs["decisions_remote_reload"] >= 1
        assert b.stats().tier_costs["remote_read_s_per_block"] is not None
    finally:
        a.close()
        b.close()


def test_server_stopped_restarted_and_flushed_are_misses(model, reference, redis_db):
    a = _engine(model, redis_db.url + "?socket_timeout=0.5")
    try:
        redis_db.stop()  # down mid-run
        start = time.monotonic()
        assert _generate(a, [_prompt(0), _prompt(1)]) == reference[:2]
        assert time.monotonic() - start < 30
        s = a.kv.stats()
        assert s.remote_errors >= 1 and not s.remote_connected and s.remote_hit_tokens == 0
        redis_db.start()  # restarted, empty
        time.sleep(0.3)  # past the first back-off
        assert _generate(a, [_prompt(2)]) == reference[2:3]
        redis_db.client().flushall()  # flushed: what the replica believed is there is not
        b = _engine(model, redis_db.url)
        try:
            assert _generate(b, [_prompt(0)]) == reference[:1]
            assert b.kv.stats().remote_hit_tokens == 0
        finally:
            b.close()
        a.close()  # shutdown writes what the server lacks
        assert redis_db.client().dbsize() >= len(HASHES)
        c = _engine(model, redis_db.url)
        try:
            assert _generate(c, [_prompt(1)]) == reference[1:2]
            assert c.kv.stats().remote_hit_tokens == len(PREFIX)
        finally:
            c.close()
    finally:
        a.close()


def test_a_slow_server_is_a_miss_and_nothing_hangs(model, reference, redis_db):
    a = _engine(model, redis_db.url)
    b = _engine(model, redis_db.url + "?socket_timeout=0.2")
    try:
        _generate(a, [_prompt(0)])
        _written(a)
        sleeper = threading.Thread(target=lambda: redis_db.client().execute_command("DEBUG", "SLEEP", "1.0"))
        sleeper.start()
        time.sleep(0.05)
        assert _generate(b, [_prompt(1)]) == reference[1:2]
        sleeper.join()
        s = b.kv.stats()
        assert s.remote_errors >= 1 and s.remote_hit_tokens == 0
    finally:
        a.close()
        b.close()


def test_a_corrupted_value_is_discarded_and_recomputed(model, reference, redis_db):
    a = _engine(model, redis_db.url)
    b = _engine(model, redis_db.url)
    try:
        _generate(a, [_prompt(0)])
        _written(a)
        r = redis_db.client()
        key = _remote(a).store.key(HASHES[5])
        value = bytearray(r.get(key))
        value[-3] ^= 0x40
        r.set(key, bytes(value))
        assert _generate(b, [_prompt(1)]) == reference[1:2]
        s = b.kv.stats()
        assert s.remote_corrupt_discarded == 1 and s.host_hit_tokens == 5 * B  # the run before it
    finally:
        a.close()
        b.close()


def test_another_fingerprint_under_the_same_prefix_is_never_read(model, tmp_path, redis_db):
    other_model = str(make_hf_checkpoint(tmp_path, "llama", seed=6))  # another model, the same shapes
    a = _engine(other_model, redis_db.url)
    try:
        _generate(a, [_prompt(0)])
        _written(a)
    finally:
        a.close()
    b = _engine(model, redis_db.url)
    try:
        r = redis_db.client()
        # the other model's values copied under this engine's keys: "written for another key"
        for h in HASHES[:3]:
            r.set(_remote(b).store.key(h), r.get(_remote(a).store.key(h)))
        with LLMEngine.from_options(model, block_size=B, num_kv_blocks=200, enable_prefix_caching=False) as ref:
            want = _generate(ref, [_prompt(0)])
        assert _generate(b, [_prompt(0)]) == want
        s = b.kv.stats()
        assert s.remote_hit_tokens == 0 and s.remote_corrupt_discarded == 3  # each discarded, none read
    finally:
        b.close()


def test_a_full_write_queue_drops_and_counts_and_shutdown_writes_the_rest(model, reference, redis_db,
                                                                          monkeypatch):
    monkeypatch.setattr(kv_tiers, "REMOTE_QUEUE_BYTES", 1)  # 8 blocks, the least
    a = _engine(model, redis_db.url)
    try:
        assert _generate(a, [_prompt(0)]) == reference[:1]  # 12 blocks cached in one step
        assert a.kv.stats().remote_writes_dropped >= 1 and a.kv.stats().remote_queue_depth <= 8
        a.close()
        assert redis_db.client().dbsize() >= len(HASHES)  # the shutdown wrote the dropped ones
    finally:
        a.close()


def test_the_password_stays_out_of_logs_and_metrics(model, reference, caplog):
    from pagedkv.server.metrics import ServerMetrics

    secret = "pw-9f8e7d"
    with RedisServer(password=secret) as server:
        with caplog.at_level(logging.DEBUG):
            a = _engine(model, server.url)
            try:
                assert _generate(a, [_prompt(0)]) == reference[:1]
                text = ServerMetrics("m").render(a.stats()).decode()
                assert 'pagedkv_kv_tier_hit_tokens_total{model_name="m",tier="remote"}' in text
                assert "pagedkv_kv_remote_blocks_written_total" in text and "pagedkv_kv_remote_connected" in text
                assert secret not in repr(a.config) and secret not in str(a.stats())
                server.stop()
                assert _generate(a, [_prompt(1)]) == reference[1:2]
            finally:
                a.close()
        assert secret not in caplog.text and "KV remote tier redis://default:***@" in caplog.text
        assert secret not in text
