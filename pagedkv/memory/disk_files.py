"""The disk tier's files: the block file format, its checks, crash-safe writes, the directory's
permissions and lock (see ``pagedkv.memory.disk_tier`` for the layout and why).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import stat
import struct
from contextlib import suppress
from pathlib import Path

from pagedkv.errors import PagedKVError

logger = logging.getLogger("pagedkv.memory.disk_tier")

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


def block_file_size(key: bytes, payload: bytes) -> int:
    """Bytes a block takes on disk: what counts against ``capacity_bytes``."""
    return HEADER_SIZE + len(key) + len(payload)



def check_block(key: bytes, head: bytes, payload: bytes) -> None:
    if len(head) < HEADER_SIZE + len(key):
        raise CorruptBlock(f"truncated: {len(head) + len(payload)} bytes")
    magic, version, key_len, payload_len, checksum = HEADER.unpack_from(head)
    if magic != MAGIC:
        raise CorruptBlock(f"bad magic {magic!r}")
    if version != LAYOUT_VERSION:
        raise CorruptBlock(f"layout version {version}, expected {LAYOUT_VERSION}")
    if key_len != len(key) or head[HEADER_SIZE:] != key:
        raise CorruptBlock("written for another key")
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
    """The locked lock file's descriptor, or None if another engine holds the lock."""
    try:
        fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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


def remove_block_files(blocks_dir: Path, keys: set[bytes] | None = None) -> int:
    """Delete the block and temporary files under ``blocks_dir`` and the folders left empty;
    returns the number of block files removed (their keys added to ``keys`` when given)."""
    removed = 0
    try:
        fans = [e.path for e in os.scandir(blocks_dir) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return 0
    for fan in fans:
        for entry in os.scandir(fan):
            if entry.name.endswith(BLOCK_SUFFIX):
                os.unlink(entry.path)
                removed += 1
                key = key_from_name(os.path.basename(fan), entry.name) if keys is not None else None
                if key is not None:
                    keys.add(key)
            elif entry.name.endswith(TMP_SUFFIX):
                os.unlink(entry.path)
        with suppress(OSError):
            os.rmdir(fan)
    with suppress(OSError):
        os.rmdir(blocks_dir)
    return removed
