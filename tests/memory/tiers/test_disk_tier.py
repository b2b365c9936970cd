"""The disk tier: layout, restart, checksums, crash safety, LRU, lock, permissions, failures, threads."""

import errno
import hashlib
import json
import logging
import os
import random
import shutil
import stat
import subprocess
import sys
import threading
from collections import OrderedDict

import pytest

from pagedkv.memory.errors import IntegrityError
from pagedkv.memory.tiers import disk_store as dt
from pagedkv.memory.tiers.disk_store import (
    HEADER_SIZE,
    LAYOUT_VERSION,
    DiskStore,
    DiskTierError,
    block_file_size,
    clear_directory,
)

FP = {"model": "tiny-llama@3f2a", "tokenizer": "tiny-tok@91bc", "block_size": "16", "kv_dtype": "bfloat16"}


def key(i) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def payload(i, n=100) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(n))


def block_path(directory, k):
    return directory / "blocks" / k.hex()[:2] / f"{k.hex()}.kvb"


def files_under(directory):
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


@pytest.fixture
def kv_dir(tmp_path):
    return tmp_path / "kv"


@pytest.fixture
def tier(kv_dir):
    with DiskStore(kv_dir, 1 << 20, FP) as t:
        yield t


def test_imports_nothing_heavy():
    code = "import sys, pagedkv.memory.tiers.disk_store; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


# ------------------------------------------------------------------ 1. layout and fingerprint
def test_layout_fingerprint_and_fanout(tier, kv_dir):
    k = key(1)
    assert tier.put(k, payload(1))
    assert json.loads((kv_dir / "fingerprint.json").read_text()) == {"layout_version": LAYOUT_VERSION,
                                                                    "fingerprint": FP}
    assert files_under(kv_dir) == sorted(["fingerprint.json", "lock", f"blocks/{k.hex()[:2]}/{k.hex()}.kvb"])
    assert block_path(kv_dir, k).stat().st_size == block_file_size(k, payload(1)) == HEADER_SIZE + 32 + 100
    assert k in tier and key(2) not in tier
    tier.check_integrity()


def test_changed_fingerprint_drops_old_blocks_and_names_the_fields(kv_dir, caplog):
    with DiskStore(kv_dir, 1 << 20, FP) as t:
        assert t.put(key(1), payload(1)) and t.put(key(2), payload(2))
    new_fp = {**FP, "kv_dtype": "fp8_e4m3"}
    with caplog.at_level(logging.WARNING, logger="pagedkv.memory.tiers.disk_store"):
        with DiskStore(kv_dir, 1 << 20, new_fp) as t:
            assert len(t) == 0 and key(1) not in t and t.get(key(1)) is None
    [record] = caplog.records
    assert "kv_dtype 'bfloat16' -> 'fp8_e4m3'" in record.message and "2 block files" in record.message
    assert "model" not in record.message and "block_size" not in record.message
    assert not block_path(kv_dir, key(1)).exists()
    assert json.loads((kv_dir / "fingerprint.json").read_text())["fingerprint"] == new_fp
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedkv.memory.tiers.disk_store"):
        DiskStore(kv_dir, 1 << 20, new_fp).close()  # same fingerprint again: nothing to say
    assert caplog.records == []


@pytest.mark.parametrize("content, expected", [
    (json.dumps({"layout_version": 0, "fingerprint": FP}), "layout_version 0 -> 1"),
    ("{not json", "unreadable"),
])
def test_other_layout_or_unreadable_fingerprint_drops_blocks(kv_dir, caplog, content, expected):
    with DiskStore(kv_dir, 1 << 20, FP) as t:
        assert t.put(key(1), payload(1))
    (kv_dir / "fingerprint.json").write_text(content)
    with caplog.at_level(logging.WARNING, logger="pagedkv.memory.tiers.disk_store"):
        with DiskStore(kv_dir, 1 << 20, FP) as t:
            assert len(t) == 0
    assert expected in caplog.text
    assert not block_path(kv_dir, key(1)).exists()


# ------------------------------------------------------------------ 2. restart
def test_restart_serves_the_same_bytes_in_mtime_order(kv_dir):
    keys = [key(i) for i in range(4)]
    with DiskStore(kv_dir, 1 << 20, FP) as t:
        for i, k in enumerate(keys):
            assert t.put(k, payload(i, 50 + i))
        used = t.stats().bytes_used
    for age, k in zip([10, 40, 20, 30], keys):  # seconds ago: order by age is 1, 3, 2, 0
        os.utime(block_path(kv_dir, k), ns=(0, (1_700_000_000 - age) * 10**9))
    with DiskStore(kv_dir, 1 << 20, FP) as t:
        assert t.keys_lru() == [keys[1], keys[3], keys[2], keys[0]]
        assert t.stats().bytes_used == used
        assert t.get(keys[1]) == payload(1, 51)  # a hit is remembered on disk too (mtime)
        t.check_integrity()
    with DiskStore(kv_dir, 1 << 20, FP) as t:
        assert t.keys_lru() == [keys[3], keys[2], keys[0], keys[1]]
        assert [t.get(k) for k in keys] == [payload(i, 50 + i) for i in range(4)]


# ------------------------------------------------------------------ 3. file format and checksums
def flip(offset):
    def damage(path, other):
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x01
        path.write_bytes(bytes(data))
    return damage


def truncate(n):
    def damage(path, other):
        path.write_bytes(path.read_bytes()[:n])
    return damage


def other_key(path, other):
    shutil.copyfile(other, path)


@pytest.mark.parametrize("damage", [
    flip(0),  # magic
    flip(4),  # layout version
    flip(16),  # checksum
    flip(HEADER_SIZE + 3),  # key
    flip(-1),  # last payload byte
    truncate(HEADER_SIZE + 32 + 99),  # one payload byte short
    truncate(HEADER_SIZE - 5),  # inside the header
    truncate(0),
    other_key,  # a complete, valid file written for another key
], ids=["magic", "version", "checksum", "key", "payload", "short-payload", "short-header", "empty", "other-key"])
def test_bad_file_is_deleted_counted_and_missed(tier, kv_dir, damage):
    a, b = key(1), key(2)
    assert tier.put(a, payload(1)) and tier.put(b, payload(2))
    damage(block_path(kv_dir, a), block_path(kv_dir, b))
    assert tier.get(a) is None
    assert not block_path(kv_dir, a).exists() and a not in tier
    s = tier.stats()
    assert (s.corrupt_discarded, s.misses, s.hits, s.blocks) == (1, 1, 0, 1)
    assert s.bytes_used == block_file_size(b, payload(2))
    assert tier.get(b) == payload(2)
    tier.check_integrity()


def test_file_too_short_for_a_header_is_dropped_at_open(kv_dir):
    with DiskStore(kv_dir, 1 << 20, FP) as t:
        assert t.put(key(1), payload(1)) and t.put(key(2), payload(2))
    block_path(kv_dir, key(1)).write_bytes(b"PKVB")
    (kv_dir / "blocks" / "zz").mkdir()
    (kv_dir / "blocks" / "zz" / "notes.txt").write_text("not ours")  # ignored, not deleted
    with DiskStore(kv_dir, 1 << 20, FP) as t:
        assert t.keys_lru() == [key(2)] and t.stats().corrupt_discarded == 1
    assert not block_path(kv_dir, key(1)).exists() and (kv_dir / "blocks" / "zz" / "notes.txt").exists()


# ------------------------------------------------------------------ 4. crash safety
def test_block_appears_only_complete_after_fsync(tier, kv_dir, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync")
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.dirname(src) == os.path.dirname(dst), os.path.exists(dst),
                       os.path.getsize(src)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    k = key(1)
    assert tier.put(k, payload(1))
    assert events == ["fsync", ("replace", True, False, block_file_size(k, payload(1)))]


def test_crash_before_rename_leaves_no_block_and_temp_files_go_at_open(kv_dir, monkeypatch):
    with DiskStore(kv_dir, 1 << 20, FP) as t:
        assert t.put(key(1), payload(1))
    # What a crash mid-write leaves: temporary files next to the final names, and one for the fingerprint.
    fan = block_path(kv_dir, key(2)).parent
    fan.mkdir(exist_ok=True)
    (fan / f"{key(2).hex()}.kvb.4242-0.tmp").write_bytes(b"PKVB half a bl")
    (kv_dir / "fingerprint.json.4242.tmp").write_text("{")
    with DiskStore(kv_dir, 1 << 20, FP) as t:
        assert t.keys_lru() == [key(1)]
        assert not any(name.endswith(".tmp") for name in files_under(kv_dir))
        # A write interrupted before its rename leaves neither the block nor its temporary file.
        def failing_replace(src, dst):
            raise OSError(errno.EIO, "I/O error")

        with monkeypatch.context() as m:
            m.setattr(os, "replace", failing_replace)
            assert not t.put(key(3), payload(3))
        assert not block_path(kv_dir, key(3)).exists()
        assert not any(name.endswith(".tmp") for name in files_under(kv_dir))
        t.check_integrity()


# ------------------------------------------------------------------ 5. capacity and LRU
def test_lru_eviction_order_and_capacity(kv_dir):
    size = block_file_size(key(0), payload(0))
    with DiskStore(kv_dir, 3 * size, FP) as t:
        a, b, c, d, e = (key(i) for i in range(5))
        for k in (a, b, c):
            assert t.put(k, payload(0))
        assert t.get(a) == payload(0)  # order: b c a
        t.touch(b)  # order: c a b
        t.touch(key(99))  # absent: no-op
        assert t.put(d, payload(0))  # evicts c
        assert t.keys_lru() == [a, b, d] and not block_path(kv_dir, c).exists()
        assert t.put(e, payload(0, 2 * 100 + HEADER_SIZE + 32))  # two blocks' worth: evicts a and b
        assert t.keys_lru() == [d, e]
        assert not t.put(key(7), payload(0, 3 * size))  # bigger than the whole tier: refused, nothing evicted
        assert t.keys_lru() == [d, e]
        assert t.put(d, payload(9, 10))  # a re-put replaces and becomes most recent
        assert t.keys_lru() == [e, d] and t.get(d) == payload(9, 10)
        s = t.stats()
        assert (s.evictions, s.blocks, s.bytes_used) == (3, 2, 3 * size - 90)
        assert s.bytes_used == sum(p.stat().st_size for p in (kv_dir / "blocks").rglob("*.kvb"))
        t.discard(e)
        t.discard(e)
        assert t.keys_lru() == [d] and not block_path(kv_dir, e).exists()
        t.check_integrity()
    with DiskStore(kv_dir, 1, FP) as t:  # capacity shrank since the last run: the oldest go
        assert len(t) == 0 and t.stats().evictions == 1
    assert list((kv_dir / "blocks").rglob("*.kvb")) == []


def test_bad_arguments(kv_dir):
    with pytest.raises(ValueError, match="capacity_bytes"):
        DiskStore(kv_dir, -1, FP)
    with pytest.raises(ValueError, match="fingerprint"):
        DiskStore(kv_dir, 100, {"block_size": 16})
    with DiskStore(kv_dir, 1000, FP) as t:
        for bad in (b"", b"x" * 65, "abc"):
            with pytest.raises(ValueError, match="key"):
                t.put(bad, b"")


def test_check_integrity_catches_a_broken_count(tier):
    assert tier.put(key(1), payload(1))
    tier._bytes_used += 1
    with pytest.raises(IntegrityError, match="bytes_used"):
        tier.check_integrity()
    assert issubclass(IntegrityError, AssertionError)


# ------------------------------------------------------------------ 6. lock
def test_lock_excludes_a_second_engine_until_close(kv_dir):
    t = DiskStore(kv_dir, 1000, FP)
    with pytest.raises(DiskTierError, match="another pagedkv engine") as info:
        DiskStore(kv_dir, 1000, FP)
    assert str(kv_dir) in str(info.value)
    with pytest.raises(DiskTierError, match="another pagedkv engine"):
        clear_directory(kv_dir)
    t.close()
    t.close()
    assert not t.stats().enabled and t.stats().disabled_reason == "closed"
    assert not t.put(key(1), b"x") and t.get(key(1)) is None
    with DiskStore(kv_dir, 1000, FP):
        pass
    DiskStore(kv_dir, 1000, FP).close()


# ------------------------------------------------------------------ 7. permissions
def test_new_directory_and_files_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        with DiskStore(tmp_path / "a" / "kv", 1000, FP) as t:
            assert t.put(key(1), payload(1))
    finally:
        os.umask(old)
    kv = tmp_path / "a" / "kv"
    assert stat.S_IMODE(kv.stat().st_mode) == 0o700
    for name in ("lock", "fingerprint.json", f"blocks/{key(1).hex()[:2]}/{key(1).hex()}.kvb"):
        assert stat.S_IMODE((kv / name).stat().st_mode) == 0o600, name


@pytest.mark.parametrize("mode", [0o770, 0o702, 0o777])
def test_directory_writable_by_others_is_refused(kv_dir, mode):
    kv_dir.mkdir()
    kv_dir.chmod(mode)
    with pytest.raises(DiskTierError, match=f"chmod 700 {kv_dir}"):
        DiskStore(kv_dir, 1000, FP)
    kv_dir.chmod(0o750)  # readable by the group is fine
    DiskStore(kv_dir, 1000, FP).close()


def test_directory_of_another_user_or_not_a_directory_is_refused(kv_dir, monkeypatch, tmp_path):
    kv_dir.mkdir(mode=0o700)
    monkeypatch.setattr(dt.os, "getuid", lambda: kv_dir.stat().st_uid + 1)
    with pytest.raises(DiskTierError, match="not by the current user"):
        DiskStore(kv_dir, 1000, FP)
    monkeypatch.undo()
    (tmp_path / "file").write_text("")
    with pytest.raises(DiskTierError, match="not a directory"):
        DiskStore(tmp_path / "file", 1000, FP)


# ------------------------------------------------------------------ 8. failures never stop serving
def test_disk_full_disables_writes_but_keeps_serving(tier, kv_dir, monkeypatch, caplog):
    assert tier.put(key(1), payload(1))

    def enospc(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with caplog.at_level(logging.WARNING, logger="pagedkv.memory.tiers.disk_store"):
        with monkeypatch.context() as m:
            m.setattr(os, "write", enospc)
            assert not tier.put(key(2), payload(2))
            assert not tier.put(key(3), payload(3))  # disabled: not even tried
    s = tier.stats()
    assert (s.write_errors, s.enabled, s.blocks) == (1, False, 1)
    assert "No space left on device" in s.disabled_reason
    assert len(caplog.records) == 1 and "stops writing" in caplog.text
    assert not tier.put(key(4), payload(4))  # stays disabled once the disk has room again
    assert tier.get(key(1)) == payload(1)
    assert files_under(kv_dir) == sorted(["fingerprint.json", "lock", f"blocks/{key(1).hex()[:2]}/{key(1).hex()}.kvb"])
    tier.check_integrity()


def test_directory_deleted_underneath(tier, kv_dir):
    assert tier.put(key(1), payload(1))
    shutil.rmtree(kv_dir)
    assert tier.get(key(1)) is None
    assert tier.get(key(2)) is None
    assert not tier.put(key(3), payload(3))
    s = tier.stats()
    assert (s.blocks, s.misses, s.corrupt_discarded, s.write_errors, s.enabled) == (0, 2, 0, 1, False)
    tier.check_integrity()
    tier.close()


# ------------------------------------------------------------------ 9. threads
def test_worker_thread_and_engine_thread(kv_dir):
    size = block_file_size(key(0), payload(0))
    errors = []
    with DiskStore(kv_dir, 8 * size, FP) as t:
        def worker():
            try:
                rng = random.Random(1)
                for _ in range(150):
                    i = rng.randrange(20)
                    if rng.random() < 0.5:
                        assert t.put(key(i), payload(i))
                    else:
                        assert t.get(key(i)) in (None, payload(i))
            except BaseException as e:  # noqa: BLE001 - a worker thread's failure is raised below, in the test
                errors.append(e)

        thread = threading.Thread(target=worker)
        thread.start()
        rng = random.Random(2)
        while thread.is_alive():
            k = key(rng.randrange(20))
            if k in t:
                t.touch(k)
            assert t.stats().bytes_used <= 8 * size
            t.check_integrity()
        thread.join()
        assert errors == []
        t.check_integrity()
        assert t.stats().bytes_used == sum(p.stat().st_size for p in (kv_dir / "blocks").rglob("*.kvb"))


def test_discard_during_a_write_wins_and_the_key_is_invisible_until_written(tier, kv_dir, monkeypatch):
    k = key(1)
    in_write, release = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def slow_fsync(fd):
        in_write.set()
        assert release.wait(5)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    results = []
    writer = threading.Thread(target=lambda: results.append(tier.put(k, payload(1))))
    writer.start()
    assert in_write.wait(5)
    assert k not in tier  # half-written: not visible
    tier.check_integrity()  # its bytes are reserved against the capacity meanwhile
    tier.discard(k)
    release.set()
    writer.join()
    assert results == [False] and k not in tier and not block_path(kv_dir, k).exists()
    tier.check_integrity()


# ------------------------------------------------------------------ 10. clear_directory
def test_clear_directory_removes_only_what_pagedkv_wrote(kv_dir, tmp_path):
    assert clear_directory(tmp_path / "missing") == 0
    with DiskStore(kv_dir, 1 << 20, FP) as t:
        for i in range(5):
            assert t.put(key(i), payload(i))
    leftover = block_path(kv_dir, key(9)).with_name(f"{key(9).hex()}.kvb.1-0.tmp")  # a crashed write
    leftover.parent.mkdir(exist_ok=True)
    leftover.write_bytes(b"PKVB partial")
    (kv_dir / "fingerprint.json.7.tmp").write_text("{")
    assert clear_directory(kv_dir) == 5
    assert os.listdir(kv_dir) == []
    with DiskStore(kv_dir, 1 << 20, FP) as t:  # usable again
        assert len(t) == 0 and t.put(key(1), payload(1))


# ------------------------------------------------------------------ randomized against a naive model
class NaiveDiskTier:
    """The same LRU and capacity rule over an OrderedDict of payloads."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.items: OrderedDict[bytes, bytes] = OrderedDict()
        self.hits = self.misses = 0

    def used(self):
        return sum(block_file_size(k, p) for k, p in self.items.items())

    def put(self, k, p):
        size = block_file_size(k, p)
        if size > self.capacity:
            return False
        self.items.pop(k, None)
        while self.used() + size > self.capacity:
            self.items.popitem(last=False)
        self.items[k] = p
        return True

    def get(self, k):
        if k not in self.items:
            self.misses += 1
            return None
        self.hits += 1
        self.items.move_to_end(k)
        return self.items[k]

    def touch(self, k):
        if k in self.items:
            self.items.move_to_end(k)

    def discard(self, k):
        self.items.pop(k, None)


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_match_a_naive_model(tmp_path, monkeypatch, seed):
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # durability is tested above; keep this fast
    rng = random.Random(seed)
    capacity = rng.randrange(200, 1500)
    model = NaiveDiskTier(capacity)
    keys = [key(i) for i in range(12)]
    with DiskStore(tmp_path / "kv", capacity, FP) as t:
        for step in range(250):
            op, k = rng.choice(["put", "put", "get", "get", "touch", "discard"]), rng.choice(keys)
            if op == "put":
                p = rng.randbytes(rng.choice([0, 1, 50, 150, 400, 1500]))
                assert t.put(k, p) == model.put(k, p), step
            elif op == "get":
                assert t.get(k) == model.get(k), step
            else:
                getattr(t, op)(k)
                getattr(model, op)(k)
            t.check_integrity()
            s = t.stats()
            assert t.keys_lru() == list(model.items), step
            assert (s.bytes_used, s.hits, s.misses) == (model.used(), model.hits, model.misses), step
            assert s.bytes_used <= capacity
        assert [t.get(k) for k in model.items] == list(model.items.values())
