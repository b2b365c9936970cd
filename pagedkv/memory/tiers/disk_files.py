"""The disk tier's files: the block file format, its checks, crash-safe writes, the directory's
permissions and lock (see ``pagedkv.memory.tiers.disk_store`` for the layout and why).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import struct
from contextlib import suppress
from pathlib import Path

from pagedkv.errors import PagedKVError

logger = logging.getLogger("pagedkv.memory.tiers.disk_store")

LAYOUT_VERSION = 1
MAGIC = b"PKVB"
HEADER = struct.Struct("<4sHHQ32s")  # magic, version, key length, payload length, checksum
HEADER_SIZE = HEADER.size
MAX_KEY_BYTES = 64  # its hex file name stays far below the 255-byte name limit

BLOCKS_DIR = "blocks"
FINGERPRINT_FILE = "fingerprint.json"
LOCK_FILE = "lock"
BLOCK_SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"


class DiskTierError(PagedKVError):
    """The disk tier's directory cannot be used (unsafe permissions, in use, not creatable)."""


class CorruptBlock(Exception):
    """A block file failed a check; the message says which."""


class BlockedPath(Exception):
    """A block's path is taken by something pagedkv did not write there (a directory, a link, a
    file where its fan-out folder should be): that one block is not written, the tier goes on."""


# what a write leaves when a crash interrupts it: "<hex key>.kvb.<pid>-<n>.tmp" and
# "fingerprint.json.<pid>.tmp" (write_durably's temporary names)
_BLOCK_TMP = re.compile(r"[0-9a-f]{2,128}\.kvb\.[0-9]+-[0-9]+\.tmp")
_FINGERPRINT_TMP = re.compile(re.escape(FINGERPRINT_FILE) + r"\.[0-9]+\.tmp")


def block_file_size(key: bytes, payload: bytes) -> int:
    """Bytes a block takes on disk: what counts against ``capacity_bytes``."""
    return HEADER_SIZE + len(key) + len(payload)



def block_head(key: bytes, payload: bytes) -> bytes:
    """The header and key that go before ``payload`` in a block file (and in a remote tier's
    value: ``tiers/remote_store.py`` stores the same bytes, so the format lives here once)."""
    checksum = hashlib.blake2b(key, digest_size=32)
    checksum.update(payload)
    return HEADER.pack(MAGIC, LAYOUT_VERSION, len(key), len(payload), checksum.digest()) + key


def unpack_block(key: bytes, data: bytes, payload_bytes: int | None = None) -> bytes:
    """The payload of ``data``, a whole block (``block_head`` + payload) stored for ``key``;
    raises CorruptBlock like ``check_block``."""
    split = HEADER_SIZE + len(key)
    payload = data[split:]
    check_block(key, data[:split], payload, payload_bytes)
    return payload


def check_block(key: bytes, head: bytes, payload: bytes, payload_bytes: int | None = None) -> None:
    """Raise CorruptBlock unless ``head`` (header and key) and ``payload`` make a good block file
    for ``key``; ``payload_bytes``: the exact payload size the reader's blocks take (a file that
    checks out but is of another size would fail the step that loads it)."""
    if len(head) < HEADER_SIZE + len(key):
        raise CorruptBlock(f"truncated: {len(head) + len(payload)} bytes")
    magic, version, key_len, payload_len, checksum = HEADER.unpack_from(head)
    if magic != MAGIC:
        raise CorruptBlock(f"bad magic {magic!r}")
    if version != LAYOUT_VERSION:
        raise CorruptBlock(f"layout version {version}, expected {LAYOUT_VERSION}")
    if key_len != len(key) or head[HEADER_SIZE:] != key:
        raise CorruptBlock("written for another key")
    if payload_bytes is not None and payload_len != payload_bytes:
        raise CorruptBlock(f"payload of {payload_len} bytes, this engine's blocks take {payload_bytes}")
    if payload_len != len(payload):
        raise CorruptBlock(f"payload of {len(payload)} bytes, header says {payload_len}")
    digest = hashlib.blake2b(key, digest_size=32)
    digest.update(payload)
    if digest.digest() != checksum:
        raise CorruptBlock("checksum mismatch")


def key_from_name(fan: str, name: str) -> bytes | None:
    if not name.endswith(BLOCK_SUFFIX):
        return None
    hex_key = name[:-len(BLOCK_SUFFIX)]
    try:
        key = bytes.fromhex(hex_key)
    except ValueError:
        return None
    if key.hex() != hex_key or hex_key[:2] != fan or not 0 < len(key) <= MAX_KEY_BYTES:
        return None
    return key


def describe_change(found: object, wanted: dict[str, object]) -> str:
    if found is None:
        return "no fingerprint.json"
    if not isinstance(found, dict) or not isinstance(found.get("fingerprint"), dict):
        return "fingerprint.json is unreadable"
    old, new = found["fingerprint"], wanted["fingerprint"]
    assert isinstance(new, dict)
    changes = [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(old.keys() | new.keys())
               if old.get(k) != new.get(k)]
    if found.get("layout_version") != LAYOUT_VERSION:
        changes.insert(0, f"layout_version {found.get('layout_version')!r} -> {LAYOUT_VERSION}")
    return "fingerprint changed: " + (", ".join(changes) or "unexpected content")


def make_private_directory(directory: Path) -> None:
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(directory, 0o700)
        os.chmod(directory, 0o700)  # mkdir's mode passes through the umask
    except FileExistsError:
        pass
    except OSError as e:
        raise DiskTierError(f"cannot create the KV disk tier directory {directory}: {e}") from e
    try:
        st = os.stat(directory)
    except OSError as e:
        raise DiskTierError(f"cannot use {directory} for the KV disk tier: {e}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise DiskTierError(f"{directory} is not a directory; pass a directory for the KV disk tier")
    if st.st_uid != os.getuid():
        raise DiskTierError(f"{directory} is owned by uid {st.st_uid}, not by the current user (uid "
                            f"{os.getuid()}); use a directory you own for the KV disk tier")
    if st.st_mode & 0o022:
        raise DiskTierError(f"{directory} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}), "
                            f"so another user could plant KV blocks in it; run `chmod 700 {directory}`")


def try_lock(directory: Path) -> int | None:
    """The locked lock file's descriptor, or None if another engine holds the lock. A link at the
    lock file's name is refused, never followed."""
    try:
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise DiskTierError(f"cannot open the lock file of the KV disk tier in {directory}: {e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError as e:
        os.close(fd)
        raise DiskTierError(f"cannot lock the KV disk tier in {directory} (a local filesystem is "
                            f"needed): {e}") from e
    return fd


def unlock(fd: int) -> None:
    with suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def write_durably(final: Path, tmp: Path, chunks: tuple[bytes, ...]) -> None:
    """Write ``chunks`` to ``final`` through ``tmp``: a crash leaves no file or a complete one."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        try:
            for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


def real_directory(path: Path) -> bool | None:
    """True for a directory, False for anything else (a link to a directory included), None when
    nothing is there. Never follows a link."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return None


def read_head(path: str | Path, size: int) -> bytes | None:
    """The first ``size`` bytes of a regular file, read without following a link; None for a
    link, a non-regular file or one that cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)


def is_block_file(path: str | Path, key: bytes) -> bool:
    """A regular file whose header pagedkv wrote for ``key`` (magic, layout version, key)."""
    head = read_head(path, HEADER_SIZE + len(key))
    if head is None or len(head) < HEADER_SIZE + len(key):
        return False
    magic, version, key_len, _, _ = HEADER.unpack_from(head)
    return magic == MAGIC and version == LAYOUT_VERSION and key_len == len(key) and head[HEADER_SIZE:] == key


def is_block_tmp(path: str | Path, name: str) -> bool:
    """A block write a crash interrupted: the temporary name ``write_durably`` gives, holding
    nothing yet or the start of a block header."""
    if not _BLOCK_TMP.fullmatch(name):
        return False
    head = read_head(path, len(MAGIC))
    return head is not None and MAGIC.startswith(head)


def is_fingerprint_tmp(path: str | Path, name: str) -> bool:
    """A fingerprint write a crash interrupted (its temporary name, empty or JSON text)."""
    if not _FINGERPRINT_TMP.fullmatch(name):
        return False
    head = read_head(path, 1)
    return head is not None and head in (b"", b"{")


def read_fingerprint(directory: Path) -> object:
    """``fingerprint.json`` parsed; None when there is none, {} when it is not JSON, a link or not
    a regular file (a link is never followed)."""
    path = directory / FINGERPRINT_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError:  # a link (ELOOP) or unreadable
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        with os.fdopen(os.dup(fd), "rb") as f:
            text = f.read(1 << 20)
        return json.loads(text)
    except (OSError, ValueError):  # not JSON, or not UTF-8
        return {}
    finally:
        os.close(fd)


def is_tier_fingerprint(found: object) -> bool:
    """Whether ``found`` (``read_fingerprint``'s) is one pagedkv writes."""
    return (isinstance(found, dict) and isinstance(found.get("layout_version"), int)
            and isinstance(found.get("fingerprint"), dict))


def remove_block_files(blocks_dir: Path, keys: set[bytes] | None = None) -> int:
    """Delete pagedkv's block files and interrupted writes under ``blocks_dir``, and the fan-out
    folders left empty; returns the number of block files removed (their keys added to ``keys``
    when given). Only files whose header pagedkv wrote (``is_block_file``, ``is_block_tmp``) go:
    anything else stays, and no link is followed (a ``blocks_dir`` that is a link is left alone)."""
    if not real_directory(blocks_dir):
        return 0
    removed = 0
    fans = [e for e in os.scandir(blocks_dir) if e.is_dir(follow_symlinks=False)]
    for fan in fans:
        for entry in os.scandir(fan.path):
            if not entry.is_file(follow_symlinks=False):
                continue
            key = key_from_name(fan.name, entry.name)
            if key is not None and is_block_file(entry.path, key):
                os.unlink(entry.path)
                removed += 1
                if keys is not None:
                    keys.add(key)
            elif is_block_tmp(entry.path, entry.name):
                os.unlink(entry.path)
        with suppress(OSError):
            os.rmdir(fan.path)
    with suppress(OSError):
        os.rmdir(blocks_dir)
    return removed
