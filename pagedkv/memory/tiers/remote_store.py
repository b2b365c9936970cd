"""The remote store: KV blocks in a Redis server (Redis 7, or Valkey) that every replica of a
deployment shares. What the remote tier (``tiers/remote.py``: the worker, the queues, read-ahead)
keeps its blocks in. Pure Python; the client library (``redis``, the ``pagedkv[redis]`` extra) is
imported when a store is opened, so pagedkv imports without it.

A block lives under one key and one value::

    key    {key_prefix}{fingerprint digest, 32 hex}:{block hash, hex}     e.g. pagedkv:3f2a...:9c01...
    value  block_head(key, payload) + payload        (``disk_files``: magic, format version, key
                                                      length, payload length, blake2b(key + payload),
                                                      key; the same bytes as a disk tier's block file)

Why these rules:
- The fingerprint (model, tokenizer, dtype, KV layout and payload layout, block size, tensor-parallel
  size, the value format's version) is in every key, so replicas that could not use each other's
  blocks never meet; the block hash already chains its parent's and mixes in the tenant's salt.
- The server is not trusted. A value is parsed by ``disk_files.unpack_block`` (struct fields and
  bytes; never pickle or any format that runs code): a wrong magic or version, a value written for
  another key (a copy under another fingerprint, another prefix), a wrong length or checksum, a
  payload of another size than this engine's blocks: the value is deleted, counted, and read as a
  miss.
- Writes are ``SET key value NX``, after an ``EXISTS`` of the batch: a key another replica wrote is
  neither sent again nor rewritten. Eviction is the server's (``maxmemory`` with an LRU policy);
  pagedkv never scans the keyspace and sets no TTL.
- A failed round trip (server down, slow past the socket timeout, restarting, refusing writes) is a
  miss or a dropped write, never an error to a request: the store is then "down" for a back-off
  (50 ms, doubling up to 5 s) during which nothing is sent, and reconnects after it. A reconnect
  bumps ``epoch``: what the tier remembered about the server's keys may be stale (a restart, a
  FLUSHALL).
- The URL may hold a password (``redis://user:pass@host``) or ask for TLS (``rediss://``, and the
  client's ``ssl_*`` query options); only ``redact_url(url)`` is ever logged, and no figure the
  store reports carries the URL.

Threads: the tier's worker makes the round trips; ``stats`` and ``available`` are read on the
engine thread. One lock guards the counters and the back-off state; I/O happens outside it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pagedkv.errors import PagedKVError
from pagedkv.memory.tiers.disk_files import LAYOUT_VERSION, CorruptBlock, block_head, unpack_block

logger = logging.getLogger(__name__)

DEFAULT_KEY_PREFIX = "pagedkv:"
SCHEMES = ("redis", "rediss", "unix")
SOCKET_TIMEOUT_S = 2.0  # a round trip slower than this is a failure: the blocks are recomputed
CONNECT_TIMEOUT_S = 1.0
FIRST_BACKOFF_S = 0.05
MAX_BACKOFF_S = 5.0


class RemoteTierError(PagedKVError):
    """The remote KV tier cannot be used as configured (no client library, a bad URL)."""


def redact_url(url: str) -> str:
    """``url`` with its password (and any query string, which may carry one) replaced: what logs
    and errors may show."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            user, _, host = netloc.rpartition("@")
            name = user.split(":", 1)[0]
            netloc = f"{name}:***@{host}" if ":" in user or name else f"***@{host}"
        return urlunsplit((parts.scheme, netloc, parts.path, "***" if parts.query else "", ""))
    except ValueError:
        return "<unparsable URL>"


def check_url(url: object) -> str:
    """``url`` if it names a Redis server pagedkv can use; ValueError saying what to give otherwise
    (the message never holds the password)."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"kv_remote_url must be a URL like redis://HOST:PORT/DB, got {type(url).__name__}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ValueError(f"kv_remote_url {redact_url(url)} is not a valid URL ({e}); give "
                         "redis://[USER:PASSWORD@]HOST:PORT[/DB] or rediss://... for TLS") from None
    if parts.scheme not in SCHEMES:
        raise ValueError(f"kv_remote_url must start with redis://, rediss:// (TLS) or unix://, got "
                         f"{redact_url(url)}")
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"kv_remote_url {redact_url(url)} names no host: give redis://HOST:PORT[/DB]")
    if port == 0:
        raise ValueError(f"kv_remote_url {redact_url(url)}: the port must be 1..65535")
    db = parts.path.strip("/")
    if parts.scheme != "unix" and db and not db.isdigit():
        raise ValueError(f"kv_remote_url {redact_url(url)}: the database after the port must be a number, "
                         f"got {db!r}")
    return url


def require_client() -> None:
    """Raise RemoteTierError, saying what to install, unless the Redis client library imports."""
    try:
        import redis  # noqa: F401 - only whether it imports
    except ImportError:
        raise RemoteTierError("the remote KV tier (--kv-remote-url) needs the Redis client: "
                              "pip install 'pagedkv[redis]' (or redis==8.1.0)") from None


def fingerprint_digest(fingerprint: dict[str, str]) -> str:
    """32 hex digits naming a deployment's blocks: the fingerprint and the value format's version."""
    text = json.dumps({"layout_version": LAYOUT_VERSION, "fingerprint": fingerprint}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class RemoteStoreStats:
    """The store's counters at one instant (round trips, not requests)."""

    connected: bool  # the last round trip worked (False while backing off)
    blocks_read: int
    blocks_written: int
    bytes_read: int  # whole values, header included
    bytes_written: int
    already_present: int  # writes skipped: the key was there (written by this or another replica)
    misses: int  # keys asked for that the server did not have (evicted, flushed, never written)
    corrupt_discarded: int  # values that failed a check: deleted, read as misses
    errors: int  # failed round trips (down, slow, restarting, refusing writes)
    reconnects: int


class RemoteStore:
    """Blocks in a Redis server under this deployment's keys (see the module docstring).

    Args:
        url: ``redis://[USER:PASSWORD@]HOST:PORT[/DB]``, ``rediss://`` for TLS, or ``unix://PATH``;
            the client's query options (``socket_timeout``, ``ssl_ca_certs``, ...) apply.
        fingerprint: what the blocks are only good for (model, tokenizer, dtype, layout, ...).
        key_prefix: the start of every key, to share one server among deployments.
        payload_bytes: the exact payload size of this engine's blocks (None: any).
        client: a ready client with the ``redis.Redis`` interface (tests); by default one is made
            from ``url``. Connecting is lazy: an unreachable server is found on the first round trip.

    Raises RemoteTierError without the ``redis`` package, ValueError for a bad URL.
    """

    def __init__(self, url: str, fingerprint: dict[str, str], *, key_prefix: str = DEFAULT_KEY_PREFIX,
                 payload_bytes: int | None = None, client: Any = None) -> None:
        check_url(url)
        if not isinstance(key_prefix, str):
            raise ValueError(f"key_prefix must be a string, got {key_prefix!r}")
        require_client()
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._response_error: type[BaseException] = redis.ResponseError
        self.url = redact_url(url)  # the only form kept: the password stays in the client
        self.digest = fingerprint_digest(fingerprint)
        self.namespace = f"{key_prefix}{self.digest}:".encode()
        self.payload_bytes = payload_bytes
        if client is None:
            # no retries inside the client: a failed round trip is a miss here, and the store backs off
            options: dict[str, Any] = {"socket_timeout": SOCKET_TIMEOUT_S,
                                       "socket_connect_timeout": CONNECT_TIMEOUT_S,
                                       "retry": Retry(NoBackoff(), 0), "health_check_interval": 0}
            query = urlsplit(url).query
            for name in ("socket_timeout", "socket_connect_timeout"):
                if name in query:
                    options.pop(name)  # the URL's own setting wins
            try:
                client = redis.Redis.from_url(url, **options)
            except (ValueError, TypeError) as e:
                raise ValueError(f"kv_remote_url {self.url}: {e}") from None
        self._client = client
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = 0.0
        self._connected = False
        self._ever_connected = False
        self.epoch = 0  # bumped at every (re)connection: what the tier knew of the keys may be stale
        self._c = dict(blocks_read=0, blocks_written=0, bytes_read=0, bytes_written=0, already_present=0,
                       misses=0, corrupt_discarded=0, errors=0, reconnects=0)

    # ------------------------------------------------------------------ keys
    def key(self, block_hash: bytes) -> bytes:
        """The server's key of a block."""
        return self.namespace + block_hash.hex().encode()

    # ------------------------------------------------------------------ round trips
    def available(self) -> bool:
        """False while backing off after a failed round trip (nothing is sent then)."""
        with self._lock:
            return time.monotonic() >= self._down_until

    def exists(self, hashes: Sequence[bytes]) -> list[bool] | None:
        """Which of ``hashes`` the server holds, in one pipelined round trip; None when the
        server cannot be reached (or is backing off)."""
        if not hashes:
            return []
        out = self._round_trip(lambda pipe: [pipe.exists(self.key(h)) for h in hashes])
        return None if out is None else [bool(n) for n in out]

    def get(self, hashes: Sequence[bytes]) -> list[bytes | None] | None:
        """The payloads of ``hashes`` (None for a miss or a value that failed a check, which is
        deleted), in one round trip (MGET); None when the server cannot be reached."""
        if not hashes:
            return []
        keys = [self.key(h) for h in hashes]
        values = self._round_trip(lambda pipe: pipe.mget(keys))
        if values is None:
            return None
        got = values[0]
        out: list[bytes | None] = []
        bad: list[bytes] = []
        read = nbytes = misses = 0
        for key, value in zip(keys, got):
            if value is None:
                misses += 1
                out.append(None)
                continue
            nbytes += len(value)
            try:
                out.append(unpack_block(key, value, self.payload_bytes))
                read += 1
            except CorruptBlock as e:
                logger.warning("KV remote tier: discarding the value of %s: %s", key.decode(errors="replace"), e)
                bad.append(key)
                out.append(None)
        self._count(blocks_read=read, bytes_read=nbytes, misses=misses, corrupt_discarded=len(bad))
        if bad:  # (a bad value would block its key for good: writes never overwrite)
            self._round_trip(lambda pipe: [pipe.delete(k) for k in bad])
        return out

    def put_missing(self, blocks: Sequence[tuple[bytes, bytes]]) -> list[bool] | None:
        """Write the ``(hash, payload)`` blocks the server lacks: one EXISTS round trip, then one
        ``SET NX`` round trip for those missing. Per block: True when it is there now (written or
        found); None when the server cannot be reached. Values the server refuses (maxmemory
        with ``noeviction``) are counted as errors and reported False."""
        if not blocks:
            return []
        present = self.exists([h for h, _ in blocks])
        if present is None:
            return None
        todo = [(i, key, block_head(key, p) + p) for i, ((h, p), there) in enumerate(zip(blocks, present))
                if not there for key in (self.key(h),)]
        out = [True] * len(blocks)
        self._count(already_present=len(blocks) - len(todo))
        if not todo:
            return out
        written = self._round_trip(lambda pipe: [pipe.set(k, value, nx=True) for _, k, value in todo],
                                   raise_on_error=False)
        if written is None:
            return None
        blocks_written = nbytes = refused = 0
        for (i, _, value), result in zip(todo, written):
            if isinstance(result, self._response_error):
                out[i] = False
                refused += 1
            elif result:
                blocks_written += 1
                nbytes += len(value)
            else:  # written meanwhile by another replica
                self._count(already_present=1)
        if refused:
            logger.warning("KV remote tier %s refused %d writes (maxmemory with noeviction?)", self.url, refused)
        self._count(blocks_written=blocks_written, bytes_written=nbytes, errors=refused)
        return out

    def set_raw(self, block_hash: bytes, value: bytes) -> None:
        """Store ``value`` as it is under a block's key (tests: a value another writer left)."""
        self._client.set(self.key(block_hash), value)

    def _round_trip(self, build: Any, raise_on_error: bool = True) -> list[Any] | None:
        """Run the commands ``build(pipeline)`` adds, in one round trip; None (counted, backing
        off) when the server cannot be reached or fails."""
        if not self.available():
            return None
        try:
            pipe = self._client.pipeline(transaction=False)
            build(pipe)
            if raise_on_error:
                out = pipe.execute()
            else:
                out = pipe.execute(raise_on_error=False)
        except self._errors as e:
            self._failed(e)
            return None
        self._succeeded()
        return list(out)

    def _failed(self, error: BaseException) -> None:
        with self._lock:
            self._c["errors"] += 1
            first = self._backoff == 0.0  # (reset by a round trip that worked)
            self._connected = False
            self._backoff = min(max(2 * self._backoff, FIRST_BACKOFF_S), MAX_BACKOFF_S)
            self._down_until = time.monotonic() + self._backoff
            backoff = self._backoff
        if first:
            logger.warning("KV remote tier %s unreachable (%s: %s); its blocks are misses, retrying in "
                           "%.2f s and backing off", self.url, type(error).__name__, error, backoff)
        try:
            self._client.connection_pool.disconnect()
        except Exception:  # noqa: BLE001 - a half-open socket closed badly changes nothing here
            pass

    def _succeeded(self) -> None:
        with self._lock:
            if self._connected:
                return
            self._connected = True
            self._backoff = 0.0
            again = self._ever_connected
            self._ever_connected = True
            self.epoch += 1
            if again:
                self._c["reconnects"] += 1
        if again:
            logger.info("KV remote tier %s reachable again", self.url)

    def _count(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._c[name] += n

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the client's connections. Idempotent."""
        try:
            self._client.close()
        except Exception:  # noqa: BLE001 - closing a connection that failed is not an error
            pass

    def stats(self) -> RemoteStoreStats:
        with self._lock:
            return RemoteStoreStats(connected=self._connected, **self._c)

    def __repr__(self) -> str:
        return f"RemoteStore({self.url!r}, {self.namespace.decode()!r})"
