"""The remote tier's store on a real Redis server (``memory/tiers/remote_store.py``) and the tier's
own rules without a model (``memory/tiers/remote.py``): keys under the deployment's fingerprint,
values checked before use (corrupt, truncated, wrong version, another key's, another size: deleted
and counted), writes that never rewrite a key, the server down / restarted / flushed as misses with
back-off and reconnection, the bounded write queue, the URL's password kept out of logs and
figures, and pagedkv without the client library.

Each test module starts its own ``redis-server`` (``pagedkv_testing/redis_server.py``: a free
loopback port, a temporary directory, no persistence) and stops it.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time

import pytest

from pagedkv.memory.block import Block
from pagedkv.memory.block_pool import BlockPool
from pagedkv.memory.tiers.base import StepCopies
from pagedkv.memory.tiers.costs import TierCosts
from pagedkv.memory.tiers.disk_files import HEADER, HEADER_SIZE, block_head
from pagedkv.memory.tiers.host import HostTier
from pagedkv.memory.tiers.remote import RemoteTier
from pagedkv.memory.tiers.remote_store import RemoteStore, RemoteTierError, check_url, redact_url
from pagedkv.memory.tiers.stack import TierStack
from pagedkv_testing.redis_server import MISSING, RedisServer, redis_server_binary

pytest.importorskip("redis", reason="the remote tier's tests need the Redis client (pip install 'pagedkv[redis]')")
pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason=MISSING)

FP = {"model": "m", "block_size": "4", "payload": "p1"}
PAYLOAD = 64


def _payload(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(PAYLOAD))


def _key(i: int) -> bytes:
    return bytes([i]) * 32


@pytest.fixture(scope="module")
def server():
    with RedisServer() as s:
        yield s


@pytest.fixture
def redis_db(server):
    server.client().flushall()
    return server


def _store(server, **kw) -> RemoteStore:
    return RemoteStore(server.url, kw.pop("fingerprint", FP), payload_bytes=PAYLOAD, **kw)


def test_blocks_round_trip_under_the_fingerprint_and_are_never_rewritten(redis_db):
    store = _store(redis_db)
    assert store.exists([_key(1), _key(2)]) == [False, False]
    assert store.put_missing([(_key(1), _payload(1)), (_key(2), _payload(2))]) == [True, True]
    assert store.exists([_key(1), _key(2), _key(3)]) == [True, True, False]
    assert store.get([_key(2), _key(3), _key(1)]) == [_payload(2), None, _payload(1)]
    # the key: prefix, the fingerprint's digest, the block hash
    keys = sorted(redis_db.client().keys("*"))
    assert keys == sorted(store.key(_key(i)) for i in (1, 2))
    assert all(k.startswith(b"pagedkv:" + store.digest.encode() + b":") for k in keys)
    # a second writer (another replica) neither sends nor rewrites what is there
    other = _store(redis_db)
    assert other.put_missing([(_key(1), _payload(9))]) == [True]
    assert store.get([_key(1)]) == [_payload(1)]
    s, o = store.stats(), other.stats()
    assert (s.blocks_written, s.blocks_read, s.misses, s.errors) == (2, 3, 1, 0)
    assert (o.blocks_written, o.already_present, o.bytes_written) == (0, 1, 0)
    assert s.bytes_written == 2 * (HEADER_SIZE + len(store.key(_key(1))) + PAYLOAD) and s.connected
    # another prefix is another namespace on the same server
    assert RemoteStore(redis_db.url, FP, key_prefix="other:", payload_bytes=PAYLOAD).exists([_key(1)]) == [False]


def test_bad_values_are_deleted_counted_and_read_as_misses(redis_db, caplog):
    store = _store(redis_db)
    blocks = [(_key(i), _payload(i)) for i in range(6)]
    store.put_missing(blocks)
    r = redis_db.client()
    good = r.get(store.key(_key(0)))
    flipped = bytearray(good)
    flipped[-1] ^= 1
    r.set(store.key(_key(0)), bytes(flipped))  # a bit flipped in the payload: checksum
    r.set(store.key(_key(1)), good[:HEADER_SIZE + 10])  # truncated
    header = list(HEADER.unpack_from(r.get(store.key(_key(2)))))
    header[1] = 99  # another format version
    r.set(store.key(_key(2)), HEADER.pack(*header) + r.get(store.key(_key(2)))[HEADER_SIZE:])
    r.set(store.key(_key(3)), r.get(store.key(_key(4))))  # a good value copied under another key
    r.set(store.key(_key(4)), b"\x80\x04\x95pickle")  # not even a header (never unpickled)
    with caplog.at_level(logging.WARNING, logger="pagedkv.memory.tiers.remote_store"):
        assert store.get([k for k, _ in blocks]) == [None] * 5 + [_payload(5)]
    assert store.stats().corrupt_discarded == 5 and "checksum" in caplog.text and "version" in caplog.text
    assert store.exists([k for k, _ in blocks]) == [False] * 5 + [True]  # deleted: a good write can land
    assert store.put_missing(blocks[:1]) == [True] and store.get([_key(0)]) == [_payload(0)]
    # a payload of another size than this engine's blocks, well checksummed: discarded too
    key = store.key(_key(7))
    r.set(key, block_head(key, b"x" * 10) + b"x" * 10)
    assert store.get([_key(7)]) == [None] and store.stats().corrupt_discarded == 6


def test_another_fingerprint_never_reads_the_values(redis_db):
    a = _store(redis_db)
    b = _store(redis_db, fingerprint={**FP, "block_size": "8"})
    assert a.digest != b.digest
    a.put_missing([(_key(1), _payload(1))])
    assert b.exists([_key(1)]) == [False] and b.get([_key(1)]) == [None]
    redis_db.client().set(b.key(_key(1)), redis_db.client().get(a.key(_key(1))))  # copied across
    assert b.get([_key(1)]) == [None] and b.stats().corrupt_discarded == 1


def test_a_server_down_is_a_miss_with_back_off_then_a_reconnect(caplog):
    with RedisServer() as server:
        store = _store(server)
        assert store.put_missing([(_key(1), _payload(1))]) == [True] and store.epoch == 1
        server.stop()
        with caplog.at_level(logging.WARNING, logger="pagedkv.memory.tiers.remote_store"):
            start = time.monotonic()
            assert store.exists([_key(1)]) is None
            assert time.monotonic() - start < 2.0  # the connect fails at once on loopback
            assert not store.available()  # backing off: nothing is sent
            assert store.get([_key(1)]) is None and store.put_missing([(_key(2), _payload(2))]) is None
        assert store.stats().errors == 1 and not store.stats().connected and "unreachable" in caplog.text
        server.start()  # restarted on its port, empty (no persistence)
        deadline = time.monotonic() + 10
        while store.exists([_key(1)]) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.exists([_key(1)]) == [False]  # flushed by the restart: a miss
        s = store.stats()
        assert s.reconnects == 1 and s.connected and store.epoch == 2


def test_the_password_is_never_logged_nor_reported(caplog):
    secret = "s3cr3t-pw"
    with RedisServer(password=secret) as server:
        url = server.url
        assert secret in url and secret not in redact_url(url) and "***" in redact_url(url)
        store = RemoteStore(url, FP, payload_bytes=PAYLOAD)
        assert store.put_missing([(_key(1), _payload(1))]) == [True]
        wrong = RemoteStore(url.replace(secret, "wrong-pw"), FP, payload_bytes=PAYLOAD)
        with caplog.at_level(logging.DEBUG):
            assert wrong.exists([_key(1)]) is None  # refused: a miss, counted
            server.stop()
            assert store.exists([_key(1)]) is None
        assert wrong.stats().errors == 1
        for text in (caplog.text, repr(store), store.url, str(store.stats()), str(wrong.stats())):
            assert secret not in text and "wrong-pw" not in text
        assert redact_url("rediss://u:p@h:1/0?ssl_ca_certs=/x&password=p") == "rediss://u:***@h:1/0?***"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test's certificate")
def test_tls_with_the_servers_certificate_and_a_miss_without_it():
    with RedisServer(tls=True, password="tls-pw") as server:
        assert server.url.startswith("rediss://")
        store = RemoteStore(server.url, FP, payload_bytes=PAYLOAD)
        assert store.put_missing([(_key(1), _payload(1))]) == [True] and store.get([_key(1)]) == [_payload(1)]
        untrusted = RemoteStore(server.url.split("?")[0], FP, payload_bytes=PAYLOAD)  # no CA: verification fails
        assert untrusted.exists([_key(1)]) is None and untrusted.stats().errors == 1
        plain = RemoteStore(server.url.replace("rediss://", "redis://").split("?")[0] + "?socket_timeout=0.3", FP,
                            payload_bytes=PAYLOAD)
        assert plain.exists([_key(1)]) is None  # TLS only: a plain connection is refused (a miss)


@pytest.mark.parametrize("url, message", [
    ("http://h:1", "must start with redis://"), ("redis://", "names no host"), ("redis://h:1/x", "must be a number"),
    ("redis://u:pw@h:99999", "not a valid URL"), (5, "must be a URL")])
def test_bad_urls_say_what_to_give_without_the_password(url, message):
    with pytest.raises(ValueError, match=message) as e:
        check_url(url)
    assert "pw" not in str(e.value)


def test_pagedkv_imports_without_the_client_and_says_what_to_install():
    code = ("import sys; sys.modules['redis'] = None\n"
            "import pagedkv, pagedkv.engine, pagedkv.memory.tiers.remote\n"
            "from pagedkv.engine import EngineConfig\n"
            "from pagedkv.memory.tiers.remote_store import RemoteStore, RemoteTierError\n"
            "for make in (lambda: RemoteStore('redis://127.0.0.1:1', {}),\n"
            "             lambda: EngineConfig(kv_remote_url='redis://127.0.0.1:1')):  # before any model loads\n"
            "    try:\n        make()\n    except RemoteTierError as e:\n        print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.count("pip install 'pagedkv[redis]'") == 2
    assert issubclass(RemoteTierError, Exception)


# ---------------------------------------------------------------------------- the tier, no model
def _tier(server, host_blocks: int = 8, **kw) -> tuple[RemoteTier, HostTier]:
    host = HostTier(BlockPool(host_blocks, name="host"))
    return RemoteTier(_store(server), host=host, costs=TierCosts(4), block_size=4, **kw), host


def _cached(block_id: int, key: bytes) -> Block:
    block = Block(block_id)
    block.block_hash = key
    return block


def test_new_blocks_are_serialized_once_and_written_where_missing(redis_db):
    tier, _ = _tier(redis_db, max_queued_writes=3)
    try:
        tier.on_cached([_cached(i, _key(i)) for i in range(5)])  # 3 fit the queue, 2 are dropped
        tier.on_cached([_cached(0, _key(0))])  # listed already: once
        copies = StepCopies()
        tier.take_copies(copies)
        assert copies.to_disk == [(i, _key(i)) for i in range(3)] and tier.io_stats().writes_dropped == 2
        assert tier.offer_payload(_key(9), b"x") is False  # not this tier's block (the disk's)
        for i in range(3):
            assert tier.offer_payload(_key(i), _payload(i))
        tier.finish_step(True)
        assert tier.flush(timeout=10)
        assert tier.store.exists([_key(i) for i in range(5)]) == [True] * 3 + [False] * 2
        tier.on_cached([_cached(1, _key(1))])  # known to be there: not serialized again
        copies = StepCopies()
        tier.take_copies(copies)
        assert copies.to_disk == []
        tier.check_integrity()
        stats = tier.stats()
        assert stats["remote_blocks_written"] == 3 and stats["remote_writes_dropped"] == 2
    finally:
        tier.close()


def test_read_ahead_looks_up_then_loads_the_run_into_the_host_tier(redis_db):
    writer = _store(redis_db)
    writer.put_missing([(_key(i), _payload(i)) for i in (0, 1, 2, 4)])  # 3 is missing: the run is 0..2
    tier, host = _tier(redis_db)
    device = BlockPool(4)
    stack = TierStack(host, None, more=(tier,))
    try:
        keys = [_key(i) for i in range(6)]
        deadline = time.monotonic() + 10
        while stack.prefetch("s", keys, True, device, 4) and time.monotonic() < deadline:
            stack.wait_for_loads(0.5)
        assert host.pool.cached.keys() == {_key(0), _key(1), _key(2)}
        copies = stack.take_copies()
        assert sorted(copies.from_disk) == sorted((host.pool.cached[_key(i)].block_id, _payload(i)) for i in range(3))
        stack.finish_step(True)
        assert tier.stats()["remote_hit_tokens"] == 12 and tier.stats()["remote_query_tokens"] == 24
        assert tier.lookup(keys) == 3  # 3 was found missing: not asked again for a while
        stack.forget("s")
        stack.check_integrity()
    finally:
        tier.close()


def test_a_tier_below_another_is_asked_past_the_run_above_it(redis_db):
    class HoldsTwo:
        name = "disk"

        def __init__(self) -> None:
            self.asked: list[bytes] = []

        def lookup(self, keys):
            return min(2, len(keys))

        def prepare_load(self, seq_id, keys, query_tokens, count, tokens_of=None):
            self.asked = list(keys)
            return False

        def complete_loads(self, device):
            pass

    tier, host = _tier(redis_db)
    above = HoldsTwo()
    stack = TierStack(host, None, more=(above, tier))  # type: ignore[arg-type]  # a stand-in with the verbs used
    try:
        keys = [_key(i) for i in range(5)]
        stack.prefetch("s", keys, True, BlockPool(4), 4)
        assert above.asked == keys[:2] and tier.stats()["remote_query_tokens"] == 12  # blocks 2..4
    finally:
        tier.close()
