"""The disk store: a persistent, crash-safe, content-addressed store of KV blocks on local disk.

What the disk tier (``tiers/disk.py``: the I/O worker, the write queue, read-ahead) keeps its
blocks in; the bottom tier, below the device and host pools. Pure Python (standard library only). A block is
an opaque ``bytes`` payload (the caller serializes its K/V and scales) stored under its key, the
block's chained content hash (tenant salt already mixed in by the caller). One directory belongs
to one engine at a time::

    DIR/                          0700, owned by the user running pagedkv
      lock                        flock()ed while an engine has the tier open
      fingerprint.json            {"layout_version": 1, "fingerprint": {model, tokenizer, ...}}
      blocks/ab/abcd...89.kvb     one file per block, fanned out by the key's first byte (hex)
      blocks/ab/abcd...89.kvb.<pid>-<n>.tmp   a write in progress (a crash leaves these; open removes them)

A block file, little-endian::

    offset  0  magic b"PKVB"                  4 bytes
            4  layout version                 u16
            6  key length k                   u16
            8  payload length n               u64
           16  blake2b-256(key + payload)     32 bytes
           48  key                            k bytes
         48+k  payload                        n bytes

Why these rules:
- A block file is written to a temporary name, fsync()ed, then renamed over the final name, so a
  crash leaves either no file or a complete one; never a torn block that a later run would serve.
- Every read checks magic, version, key, length and checksum, and (``payload_bytes``) that the
  payload is exactly the size the engine's blocks take. A bad file (bit rot, truncation, a file
  copied under another key's name, a well-checksummed file of another size) is deleted and
  counted; ``get`` never raises for it, and nothing bad reaches the caller.
- ``fingerprint.json`` ties the blocks to the model, tokenizer, block size and KV dtype that wrote
  them. Blocks written under another fingerprint are removed at open, not served.
- A failed write (disk full, read-only, directory gone) never stops serving: ``put`` returns False
  and the tier stops writing (``stats().enabled``); reads of the blocks already there go on. A
  block whose own path is taken (a directory, a link, a file where its fan-out folder goes) is
  that block's problem only: an empty directory there is removed, anything else skipped
  (``blocked_writes``), and writing goes on.
- The tier touches only its own files and never follows a link inside its directory: a link at
  ``blocks/`` is refused at open, files are opened with ``O_NOFOLLOW``, and only files whose
  header pagedkv wrote are ever deleted (``remove_block_files``; ``clear_directory`` also
  refuses a directory without pagedkv's fingerprint).

Threads: one background worker calls ``put``/``get`` while the engine thread calls ``in``,
``touch`` and ``stats``. The index is guarded by one lock; file I/O happens outside it. A ``put``
reserves its bytes (evicting first) before writing, so the capacity holds while it writes, and
its key becomes visible only once the file is complete.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
from collections import OrderedDict, deque
from contextlib import suppress
from dataclasses import asdict, dataclass
from itertools import count
from pathlib import Path

from pagedkv.memory.errors import IntegrityError
from pagedkv.memory.tiers.disk_files import (
    BLOCK_SUFFIX,
    BLOCKS_DIR,
    FINGERPRINT_FILE,
    HEADER,
    HEADER_SIZE,
    LAYOUT_VERSION,
    LOCK_FILE,
    MAX_KEY_BYTES,
    TMP_SUFFIX,
    BlockedPath,
    CorruptBlock,
    DiskTierError,
    block_file_size,
    block_head,
    check_block,
    describe_change,
    is_block_file,
    is_block_tmp,
    is_fingerprint_tmp,
    is_tier_fingerprint,
    key_from_name,
    make_private_directory,
    read_fingerprint,
    real_directory,
    remove_block_files,
    try_lock,
    unlock,
    write_durably,
)

logger = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class DiskStoreStats:
    """The disk store at one instant. ``enabled`` is False once the tier stopped writing (after a
    write error, or closed); ``disabled_reason`` says why. Sizes are whole files, header included."""

    blocks: int
    bytes_used: int
    capacity_bytes: int
    hits: int
    misses: int
    bytes_written: int
    bytes_read: int
    corrupt_discarded: int
    write_errors: int
    evictions: int
    blocked_writes: int
    enabled: bool
    disabled_reason: str | None


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    corrupt_discarded: int = 0
    write_errors: int = 0
    evictions: int = 0
    blocked_writes: int = 0  # blocks not written: their path was taken (the tier goes on writing)


class DiskStore:
    """KV blocks on local disk, least recently used evicted first (see the module docstring).

    Opening creates ``directory`` (mode 0700) if needed, takes its lock, drops blocks written
    under another fingerprint and indexes the rest, oldest modification time first. Raises
    DiskTierError if the directory is used by another engine, is writable by group or others, is
    not owned by the current user, has a link (or a file) at ``blocks/``, or cannot be created or
    read; ValueError for a bad argument. ``payload_bytes``: the exact payload size of every block
    (None: any); a file of another size is discarded like a checksum failure.
    """

    def __init__(self, directory: str | Path, capacity_bytes: int, fingerprint: dict[str, str],
                 payload_bytes: int | None = None) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        if payload_bytes is not None and (isinstance(payload_bytes, bool) or not isinstance(payload_bytes, int)
                                          or payload_bytes < 0):
            raise ValueError(f"payload_bytes must be an int >= 0 or None, got {payload_bytes!r}")
        self.payload_bytes = payload_bytes
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in fingerprint.items()):
            raise ValueError("fingerprint must map str to str (model, tokenizer, block size, KV dtype, ...)")
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self._blocks_dir = self.directory / BLOCKS_DIR
        self._mutex = threading.Lock()
        # key -> file size. One structure is both the index and the LRU order (least recent first).
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._bytes_used = 0  # sum of self._index's sizes
        self._reserved = 0  # bytes of puts being written: held against the capacity until they land
        self._writing: set[bytes] = set()
        self._discarded_while_writing: set[bytes] = set()
        self._counters = _Counters()
        self._disabled_reason: str | None = None
        self._closed = False
        self._tmp_ids = count()
        self.discarded_keys: set[bytes] = set()  # block keys removed at open for another fingerprint
        # ("stored" | "removed", key) as the index changes, when the owner wants them (KV events);
        # appended under the mutex from whichever thread changes it, taken by the owner
        self.changes: deque[tuple[str, bytes]] | None = None
        make_private_directory(self.directory)
        self._lock_fd = try_lock(self.directory)
        if self._lock_fd is None:
            raise DiskTierError(f"the KV disk tier directory {self.directory} is in use by another pagedkv "
                                "engine; give each engine its own directory")
        try:
            if real_directory(self._blocks_dir) is False:
                raise DiskTierError(f"{self._blocks_dir} is a link or not a directory; pagedkv never follows "
                                    f"links in its KV disk tier: remove it, or give another --kv-offload-dir")
            self._adopt_fingerprint({"layout_version": LAYOUT_VERSION, "fingerprint": dict(fingerprint)})
            self._load_index()
        except BaseException as e:
            self.close()
            if isinstance(e, OSError):
                raise DiskTierError(f"cannot open the KV disk tier in {self.directory}: {e}") from e
            raise

    # ------------------------------------------------------------------ blocks
    def put(self, key: bytes, payload: bytes) -> bool:
        """Store ``payload`` under ``key``, evicting least recently used blocks until it fits.

        Returns False, storing nothing, if the block alone is bigger than the capacity, if the tier
        is disabled or closed, or if the write fails (which disables the tier). Re-putting a key
        rewrites it; callers that only need it present check ``key in tier`` first and save the
        write. Raises ValueError for a key that is not 1..64 bytes.
        """
        if not isinstance(key, bytes) or not 0 < len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"a disk tier key must be 1..{MAX_KEY_BYTES} bytes, got {key!r:.80}")
        size = block_file_size(key, payload)
        with self._mutex:
            if self._disabled_reason is not None or size > self.capacity_bytes:
                return False
            if self._drop_locked(key):
                self._changed("removed", key)
            victims = []
            while self._index and self._bytes_used + self._reserved + size > self.capacity_bytes:
                victim, victim_size = self._index.popitem(last=False)
                self._bytes_used -= victim_size
                self._counters.evictions += 1
                self._changed("removed", victim)
                victims.append(victim)
            fits = self._bytes_used + self._reserved + size <= self.capacity_bytes  # False only under a racing put
            if fits:
                self._reserved += size
                self._writing.add(key)
        try:
            for victim in victims:
                with suppress(FileNotFoundError):
                    os.unlink(self._block_path(victim))
            if fits:
                self._write_block(key, payload)
        except BlockedPath as e:
            self._write_blocked(e, size, key)
            return False
        except OSError as e:
            self._write_failed(e, size if fits else 0, key)
            return False
        if not fits:
            return False
        with self._mutex:
            self._reserved -= size
            self._writing.discard(key)
            cancelled = key in self._discarded_while_writing
            self._discarded_while_writing.discard(key)
            if not cancelled:
                if self._drop_locked(key):
                    self._changed("removed", key)
                self._index[key] = size
                self._bytes_used += size
                self._counters.bytes_written += size
                self._changed("stored", key)
        if cancelled:
            with suppress(OSError):
                os.unlink(self._block_path(key))
        return not cancelled

    def get(self, key: bytes) -> bytes | None:
        """The payload stored under ``key``, or None on a miss. A hit makes the key most recent.

        A file that fails a check (magic, version, key, length, checksum) or cannot be read is
        deleted, counted in ``corrupt_discarded`` and reported as a miss; this never raises for a
        bad or vanished file.
        """
        with self._mutex:
            if self._closed:
                return None
            if key not in self._index:
                self._counters.misses += 1
                return None
        path = self._block_path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)  # (a link: ELOOP, discarded)
            with open(fd, "rb") as f:
                head = f.read(HEADER_SIZE + len(key))
                # read no more than a good file holds (plus one byte to see a longer one)
                wanted = self.payload_bytes
                if wanted is None and len(head) >= HEADER_SIZE:
                    wanted = HEADER.unpack_from(head)[3]
                payload = f.read(-1 if wanted is None else wanted + 1)
            check_block(key, head, payload, self.payload_bytes)
        except FileNotFoundError:  # removed underneath us: nothing to discard
            self._forget(key, corrupt=False)
            return None
        except (OSError, CorruptBlock) as e:
            logger.warning("KV disk tier: discarding block file %s: %s", path, e)
            with suppress(OSError):
                os.unlink(path)
            self._forget(key, corrupt=True)
            return None
        with self._mutex:
            if key in self._index:
                self._index.move_to_end(key)
            self._counters.hits += 1
            self._counters.bytes_read += len(head) + len(payload)
        with suppress(OSError):
            os.utime(path)  # the next open orders blocks by modification time
        return payload

    def __contains__(self, key: bytes) -> bool:
        """Whether ``key`` is indexed (no I/O: ``get`` may still miss if its file went bad)."""
        with self._mutex:
            return key in self._index

    def __len__(self) -> int:
        with self._mutex:
            return len(self._index)

    def touch(self, key: bytes) -> None:
        """Make ``key`` most recently used without reading it (in memory only; no-op if absent)."""
        with self._mutex:
            if key in self._index:
                self._index.move_to_end(key)

    def discard(self, key: bytes) -> None:
        """Remove ``key`` and its file if present (also a write of it still in progress)."""
        with self._mutex:
            dropped = self._drop_locked(key)
            if dropped:
                self._changed("removed", key)
            if key in self._writing:
                self._discarded_while_writing.add(key)
        if dropped:
            with suppress(OSError):
                os.unlink(self._block_path(key))

    def watch_changes(self) -> deque[tuple[str, bytes]]:
        """Record index changes in ``changes`` from now on, starting with a "stored" for every
        block already here (what an earlier run left); returns the deque to take them from."""
        with self._mutex:
            if self.changes is None:
                self.changes = deque(("stored", key) for key in self._index)
            return self.changes

    def keys_lru(self) -> list[bytes]:
        """Every key, least recently used first."""
        with self._mutex:
            return list(self._index)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop reading and writing and release the directory's lock. Idempotent."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
            if self._disabled_reason is None:
                self._disabled_reason = "closed"
        if self._lock_fd is not None:
            unlock(self._lock_fd)

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ inspection
    def stats(self) -> DiskStoreStats:
        """A snapshot of the index and counters."""
        with self._mutex:
            return DiskStoreStats(
                blocks=len(self._index), bytes_used=self._bytes_used, capacity_bytes=self.capacity_bytes,
                enabled=self._disabled_reason is None, disabled_reason=self._disabled_reason,
                **asdict(self._counters))

    def check_integrity(self) -> None:
        """Raise IntegrityError (an AssertionError) unless the index agrees with itself: the byte
        count is the sum of the sizes, each size covers at least a header and its key, and the
        blocks plus writes in progress fit the capacity. The LRU order is the index itself, so it
        holds each key exactly once by construction."""
        with self._mutex:
            total = sum(self._index.values())
            if total != self._bytes_used:
                raise IntegrityError(f"disk tier: bytes_used {self._bytes_used} != sum of sizes {total}")
            for key, size in self._index.items():
                if size < HEADER_SIZE + len(key):
                    raise IntegrityError(f"disk tier: block {key.hex()} has size {size} < its header")
            if self._reserved < 0 or self._bytes_used + self._reserved > self.capacity_bytes:
                raise IntegrityError(f"disk tier: {self._bytes_used} used + {self._reserved} reserved "
                                     f"bytes exceed the capacity {self.capacity_bytes}")
            if not self._discarded_while_writing <= self._writing:
                raise IntegrityError("disk tier: a discarded in-flight key is not being written")

    def __repr__(self) -> str:
        s = self.stats()
        return f"DiskStore({str(self.directory)!r}, {s.blocks} blocks, {s.bytes_used}/{s.capacity_bytes} bytes)"

    # ------------------------------------------------------------------ internals
    def _block_path(self, key: bytes) -> Path:
        name = key.hex()
        return self._blocks_dir / name[:2] / (name + BLOCK_SUFFIX)

    def _drop_locked(self, key: bytes) -> bool:
        size = self._index.pop(key, None)
        if size is None:
            return False
        self._bytes_used -= size
        return True

    def _changed(self, kind: str, key: bytes) -> None:
        if self.changes is not None:
            self.changes.append((kind, key))

    def _forget(self, key: bytes, corrupt: bool) -> None:
        with self._mutex:
            if self._drop_locked(key):
                self._changed("removed", key)
            self._counters.misses += 1
            if corrupt:
                self._counters.corrupt_discarded += 1

    def _write_block(self, key: bytes, payload: bytes) -> None:
        final = self._block_path(key)
        self._clear_way(final)
        try:
            write_durably(final, self._tmp_path(final), (block_head(key, payload), payload))
        except (IsADirectoryError, NotADirectoryError) as e:  # taken since _clear_way looked
            raise BlockedPath(f"{final}: {e}") from e

    def _clear_way(self, final: Path) -> None:
        """Make sure ``final`` can be written without following a link: its fan-out folder a real
        directory (made if missing), nothing at its name but a file. An empty directory at its
        name is removed; anything else raises BlockedPath (this block is skipped)."""
        fan = final.parent
        kind = real_directory(fan)
        if kind is None:
            with suppress(FileExistsError):
                os.mkdir(fan, 0o700)
            kind = real_directory(fan)
        if not kind:
            raise BlockedPath(f"{fan} is a link or not a directory")
        if real_directory(final):
            try:
                os.rmdir(final)
            except OSError as e:
                raise BlockedPath(f"{final} is a directory that cannot be removed ({e.strerror})") from e
            logger.warning("KV disk tier: removed an empty directory at block path %s", final)

    def _tmp_path(self, final: Path) -> Path:
        return final.with_name(f"{final.name}.{os.getpid()}-{next(self._tmp_ids)}{TMP_SUFFIX}")

    def _write_failed(self, error: OSError, reserved: int, key: bytes) -> None:
        with self._mutex:
            self._reserved -= reserved
            self._writing.discard(key)
            self._discarded_while_writing.discard(key)
            self._counters.write_errors += 1
            first = self._disabled_reason is None
            if first:
                self._disabled_reason = f"a write failed ({error}); no more blocks are written"
        if first:
            logger.warning("KV disk tier %s: write failed (%s); the disk tier stops writing and keeps "
                           "serving the blocks it has", self.directory, error)

    def _write_blocked(self, error: BlockedPath, reserved: int, key: bytes) -> None:
        with self._mutex:
            self._reserved -= reserved
            self._writing.discard(key)
            self._discarded_while_writing.discard(key)
            self._counters.blocked_writes += 1
        logger.warning("KV disk tier: block not written, its path is taken: %s", error)

    def _adopt_fingerprint(self, wanted: dict[str, object]) -> None:
        path = self.directory / FINGERPRINT_FILE
        for entry in os.scandir(self.directory):  # a fingerprint write a crash interrupted
            if entry.is_file(follow_symlinks=False) and is_fingerprint_tmp(entry.path, entry.name):
                os.unlink(entry.path)
        found = read_fingerprint(self.directory)
        if found == wanted:
            return
        removed = remove_block_files(self._blocks_dir, self.discarded_keys)
        if found is not None or removed:
            logger.warning("KV disk tier %s: %s; removed %d block files written for another setup",
                           self.directory, describe_change(found, wanted), removed)
        text = json.dumps(wanted, indent=1, sort_keys=True).encode()
        write_durably(path, path.with_name(f"{FINGERPRINT_FILE}.{os.getpid()}{TMP_SUFFIX}"), (text,))

    def _load_index(self) -> None:
        with suppress(FileExistsError):
            os.mkdir(self._blocks_dir, 0o700)
        if not real_directory(self._blocks_dir):  # (checked at open; a race since is refused too)
            raise DiskTierError(f"{self._blocks_dir} is a link or not a directory; pagedkv never follows links")
        found = []  # (mtime, name, key, size)
        for fan in os.scandir(self._blocks_dir):
            if not fan.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(fan.path):
                if not entry.is_file(follow_symlinks=False):
                    continue
                if entry.name.endswith(TMP_SUFFIX):  # a block write a crash interrupted
                    if is_block_tmp(entry.path, entry.name):
                        os.unlink(entry.path)
                    continue
                key = key_from_name(fan.name, entry.name)
                if key is None:
                    continue
                st = entry.stat(follow_symlinks=False)
                good = HEADER_SIZE + len(key) + (self.payload_bytes or 0)
                if st.st_size < HEADER_SIZE + len(key) or (self.payload_bytes is not None and st.st_size != good):
                    if st.st_size < HEADER_SIZE + len(key) or is_block_file(entry.path, key):
                        os.unlink(entry.path)  # (ours, of the wrong size: as a failed check would)
                        self._counters.corrupt_discarded += 1
                    continue
                found.append((st.st_mtime_ns, entry.name, key, st.st_size))
        found.sort()
        for _, _, key, size in found:
            self._index[key] = size
            self._bytes_used += size
        while self._bytes_used > self.capacity_bytes:  # the capacity shrank since the last run
            key, size = self._index.popitem(last=False)
            self._bytes_used -= size
            self._counters.evictions += 1
            os.unlink(self._block_path(key))


def clear_directory(directory: str | Path) -> int:
    """Remove every block file and all metadata pagedkv wrote in ``directory``, keeping the
    directory itself and any file pagedkv did not write (only files whose header it recognizes
    go; no link is followed). Returns the number of block files removed (0 if the directory does
    not exist). Raises DiskTierError, removing nothing, if the directory has no pagedkv
    fingerprint, if ``blocks/`` is a link or not a directory, or if an engine has it open; and if
    a file cannot be removed."""
    directory = Path(directory)
    if not directory.is_dir():
        return 0
    blocks = directory / BLOCKS_DIR
    if not is_tier_fingerprint(read_fingerprint(directory)):
        raise DiskTierError(f"{directory} is not a pagedkv KV disk tier (no readable {FINGERPRINT_FILE} written by "
                            "pagedkv); nothing was removed")
    if real_directory(blocks) is False:
        raise DiskTierError(f"{blocks} is a link or not a directory; pagedkv never follows links, so nothing "
                            "was removed: remove it yourself if it is yours")
    fd = try_lock(directory)
    if fd is None:
        raise DiskTierError(f"cannot clear {directory}: another pagedkv engine is using it as its KV disk "
                            "tier; stop that engine first")
    try:
        removed = remove_block_files(blocks)
        for entry in os.scandir(directory):
            if entry.is_file(follow_symlinks=False) and (
                    entry.name == FINGERPRINT_FILE or is_fingerprint_tmp(entry.path, entry.name)):
                os.unlink(entry.path)
        lock = os.lstat(directory / LOCK_FILE)
        if stat.S_ISREG(lock.st_mode) and lock.st_size == 0:  # (ours: pagedkv's lock file is empty)
            os.unlink(directory / LOCK_FILE)  # last: while we hold it, no engine can open the directory
    except OSError as e:
        raise DiskTierError(f"cannot clear the KV disk tier in {directory}: {e}") from e
    finally:
        unlock(fd)
    return removed
