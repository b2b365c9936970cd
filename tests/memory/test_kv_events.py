"""KV cache events (pagedkv/kv_events.py and server/kv_events.py): a model of each tier's prefix
cache rebuilt from the events alone equals the cache the memory core holds, after every step,
across allocations, prefix hits, evictions, forks, preemption by swap and recompute, host-tier
offloads and reloads, speculative rollback and fault injection; and the wire format is vLLM's."""

from __future__ import annotations

import random

import pytest

from pagedkv import SamplingParams
from pagedkv.engine import LLMEngine
from pagedkv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv_testing.hf_checkpoints import make_hf_checkpoint


class CacheModel:
    """What a KV-aware router knows of one replica: hashes per medium, and each stored block's
    parent and tokens."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[bytes]] = {}
        self.parent: dict[bytes, bytes | None] = {}

    def apply(self, events) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                tier = self.tiers.setdefault(e.medium, set())
                assert not tier & set(e.block_hashes), "a block stored twice without its removal"
                tier.update(e.block_hashes)
                if e.medium == "GPU":
                    assert len(e.token_ids) == len(e.block_hashes) * e.block_size
                    for i, h in enumerate(e.block_hashes):
                        self.parent[h] = e.parent_block_hash if i == 0 else e.block_hashes[i - 1]
            elif isinstance(e, BlockRemoved):
                tier = self.tiers.setdefault(e.medium, set())
                assert set(e.block_hashes) <= tier, "a block removed that was never stored"
                tier.difference_update(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                self.tiers.clear()


def group0(pool) -> set[bytes]:
    return {h for h, b in pool.cached.items() if b.kv_group == 0}


def ragged(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(24)]
    return [(shared if i % 2 else []) + [rng.randrange(3, 256) for _ in range(rng.randrange(3, 40))]
            for i in range(n)]


@pytest.mark.parametrize("options", [
    dict(preemption_mode="swap"),
    dict(preemption_mode="recompute", fault_injection="seed=3,rate=0.2"),
    dict(preemption_mode="auto", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                     "prompt_lookup_min": 1}),
], ids=["swap", "recompute-faults", "speculative"])
def test_replayed_events_equal_every_tiers_cache(tmp_path, options):
    folder = make_hf_checkpoint(tmp_path, "llama", seed=3)
    engine = LLMEngine.from_options(str(folder), block_size=4, num_kv_blocks=48, max_num_batched_tokens=40,
                                    kv_offloading_size=0.0004, kv_events=True, debug_integrity=True, **options)
    model = CacheModel()
    prompts = ragged(1, 14)
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0.7 if i % 3 == 0 else 0, seed=i, max_tokens=12 + i % 7, ignore_eos=True,
                                n=2 if i % 4 == 1 else 1)
        engine.add_request(f"r{i}", p, params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        model.apply(engine.kv.events.take())
        assert model.tiers.get("GPU", set()) == group0(engine.kv.pool), f"device tier differs at step {steps}"
        assert model.tiers.get("CPU", set()) == group0(engine.kv.host_pool), f"host tier differs at step {steps}"
        if steps == 30:  # a second wave hits what the first left cached (and reloads from the host)
            for i, p in enumerate(prompts[:6]):
                engine.add_request(f"again{i}", p, SamplingParams(temperature=0, max_tokens=5))
    stats = engine.stats()
    assert stats.kv.evictions > 0 and stats.kv.offloaded_blocks > 0  # evictions and tier moves happened
    # every stored device block's parent chain leads back to a root (None)
    for parent in model.parent.values():
        assert parent is None or parent in model.parent
    engine.kv.clear_prefix_cache()
    model.apply(engine.kv.events.take())
    assert model.tiers["GPU"] == group0(engine.kv.pool) == set() and model.tiers["CPU"] == set()


def test_disk_tier_events_follow_its_index_and_a_restart_announces_what_it_kept(tmp_path):
    """Medium "DISK": blocks written through to disk, evicted by its LRU or discarded, as its
    index changes on the worker thread; a restarted replica first announces the blocks it kept."""
    folder = make_hf_checkpoint(tmp_path, "llama", seed=3)
    kv_dir = tmp_path / "kv"

    def open_engine(disk_size: int | None = None) -> LLMEngine:
        return LLMEngine.from_options(str(folder), block_size=4, num_kv_blocks=40, kv_offloading_size=0.0002,
                                      kv_offload_dir=str(kv_dir), kv_offload_disk_size=disk_size,
                                      kv_events=True, debug_integrity=True)

    def run(engine: LLMEngine, model: CacheModel, prompts: list[list[int]]) -> None:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=6))
        while engine.has_unfinished_requests():
            engine.step()
            model.apply(engine.kv.events.take())
            assert model.tiers.get("GPU", set()) == group0(engine.kv.pool)
            assert model.tiers.get("CPU", set()) == group0(engine.kv.host_pool)
        assert engine.kv.disk.flush(timeout=30)
        engine.kv.disk.take_events()  # (a step takes them; this run has no more steps)
        model.apply(engine.kv.events.take())
        assert model.tiers.get("DISK", set()) == set(engine.kv.disk.store.keys_lru())

    probe = open_engine()  # how big one block file is, to size a disk that must evict
    run(probe, CacheModel(), ragged(2, 6))
    disk = probe.kv.disk.store
    block_file = disk.stats().bytes_used // len(disk)
    probe.close()
    from pagedkv.memory.tiers.disk_store import clear_directory
    clear_directory(kv_dir)

    engine = open_engine(disk_size=12 * block_file)
    model = CacheModel()
    run(engine, model, ragged(3, 16))
    assert engine.kv.disk.store.stats().evictions > 0  # the disk's LRU removed blocks too
    engine.close()  # writes down what the disk lacks: its index changes once more
    kept = set(engine.kv.disk.store.keys_lru())

    again = open_engine(disk_size=12 * block_file)
    restarted = CacheModel()
    again.kv.disk.take_events()
    restarted.apply(again.kv.events.take())
    assert restarted.tiers["DISK"] == set(again.kv.disk.store.keys_lru()) == kept and kept
    run(again, restarted, ragged(3, 4))  # prefixes the disk kept are read back; the events still agree
    again.close()


def test_a_tenant_salt_is_sent_only_as_a_hash(tmp_path):
    folder = make_hf_checkpoint(tmp_path, "llama", seed=3)
    engine = LLMEngine.from_options(str(folder), block_size=4, num_kv_blocks=64, kv_events=True)
    engine.add_request("a", list(range(3, 30)), SamplingParams(max_tokens=2), cache_salt="secret-salt-of-acme")
    engine.add_request("b", list(range(3, 30)), SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    stored = [e for e in engine.kv.events.take() if isinstance(e, BlockStored)]
    salted = [e for e in stored if e.extra_keys]
    plain = [e for e in stored if not e.extra_keys]
    assert salted and plain
    assert all("secret" not in k and len(k) == 64 for e in salted for k in e.extra_keys)
    # the same tokens under another salt are other blocks
    assert not {h for e in salted for h in e.block_hashes} & {h for e in plain for h in e.block_hashes}


def test_events_over_zmq_in_vllms_format_and_replay(tmp_path):
    """A subscriber decodes vLLM's positional msgpack batches from the PUB socket, replays them
    into a model per medium, and finds the replica's caches; the replay socket resends them."""
    import socket
    import time

    import httpx
    import msgpack
    import zmq

    from pagedkv.server.kv_events import KVEventPublisher, KVEventsConfig, hash64
    from pagedkv_testing.server import ServerThread, tiny_engine
    from pagedkv_testing.tiny_model import write_tiny_model

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    folder = write_tiny_model(tmp_path / "tiny")
    engine = tiny_engine(folder, num_kv_blocks=40, block_size=4, kv_offloading_size=0.0002, kv_events=True)
    pub_port, replay_port = port(), port()
    publisher = KVEventPublisher(KVEventsConfig(endpoint=f"tcp://127.0.0.1:{pub_port}",
                                                replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic="kv"))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.3)  # the subscription reaches the publisher
    tiers: dict[str, set[int]] = {}
    seqs: list[int] = []
    payloads = []

    def drain() -> None:
        while sub.poll(200):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            seqs.append(int.from_bytes(seq, "big"))
            payloads.append(payload)
            ts, events, rank = msgpack.unpackb(payload)
            assert isinstance(ts, float) and rank == 0
            for e in events:
                if e[0] == "BlockStored":
                    assert len(e) == 9 and e[5] is None and e[4] == 4
                    tiers.setdefault(e[6], set()).update(e[1])
                elif e[0] == "BlockRemoved":
                    tiers.setdefault(e[2], set()).difference_update(e[1])
                else:
                    assert e == ["AllBlocksCleared"]
                    tiers.clear()

    try:
        with ServerThread(engine, served_model_names=["tiny"]) as server:
            server.async_engine.kv_event_sink = publisher.publish
            for i in range(12):  # more distinct prompts than the pool holds: evictions, host offloads
                prompt = f"request {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3)
                r = httpx.post(f"{server.base_url}/completions", timeout=60,
                               json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "n": 1 + i % 2})
                assert r.status_code == 200
            server.wait_idle()
            time.sleep(0.3)
            drain()
            kv = engine.kv
            device = {hash64(h) for h, b in kv.pool.cached.items() if b.kv_group == 0}
            host = {hash64(h) for h, b in kv.host_pool.cached.items() if b.kv_group == 0}
        assert tiers.get("GPU", set()) == device and device
        assert tiers.get("CPU", set()) == host and host
        assert seqs == list(range(len(seqs))) and publisher.dropped == 0
        replay = ctx.socket(zmq.DEALER)
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send_multipart([b"", (2).to_bytes(8, "big")])
        got = []
        while True:
            assert replay.poll(5000)
            _, seq, payload = replay.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            got.append((int.from_bytes(seq, "big"), payload))
        assert got == list(zip(seqs[2:], payloads[2:]))
    finally:
        publisher.close()
        ctx.destroy(linger=0)


def test_kv_events_flags(tmp_path):
    import argparse

    from pagedkv.server.cli import add_serve_arguments, kv_events_config

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert kv_events_config(parser.parse_args([])) is None
    c = kv_events_config(parser.parse_args(["--kv-events-endpoint", "tcp://127.0.0.1:6000"]))
    assert c.endpoint == "tcp://127.0.0.1:6000" and c.replay_endpoint is None
    c = kv_events_config(parser.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": '
                                            '"zmq", "endpoint": "tcp://*:5557", "topic": "kv"}']))
    assert c.endpoint == "tcp://*:5557" and c.topic == "kv"
    with pytest.raises(ValueError, match="unknown field"):
        kv_events_config(parser.parse_args(["--kv-events-config", '{"endpont": "x"}']))
    from pagedkv.server.kv_events import _binds
    assert _binds("tcp://127.0.0.1:5557") and _binds("tcp://*:5557") and _binds("ipc:///tmp/x")
    assert not _binds("tcp://10.1.2.3:5557")
