"""Publishing KV cache events in vLLM's wire format over ZMQ, off the engine's step.

After each step the engine thread hands the memory core's events (``pagedkv/kv_events.py``) to
:meth:`KVEventPublisher.publish`: a queue put, nothing more. A publisher thread numbers each
batch and sends it on a PUB socket as vLLM's ``ZmqEventPublisher`` does, three frames::

    [topic (utf-8, default empty), sequence number (8 bytes, big-endian, from 0), msgpack payload]

The payload is vLLM's ``KVEventBatch`` in its positional (array) encoding, which KV-aware
routers (llm-d's KV indexer, Dynamo, the SGLang/SMG gRPC bridge) decode::

    [ts, [event, ...], data_parallel_rank]
    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

Block hashes are sent as vLLM sends them by default: the low 64 bits of the big-endian hash, as
unsigned ints. ``extra_keys`` has one entry per block: ``[salt_root]`` (the SHA-256 hex the
request's cache salt produced, never the salt) or None. Mediums: "GPU" (the device pool, a CPU
here), "CPU" (the host tier).

Replay (``replay_endpoint``, a ROUTER socket): a client sends a start sequence number (8 bytes,
big-endian) and gets ``[seq, payload]`` for every buffered batch from there, then ``[-1, b""]``.
What a peer is sent but has not read is kept for it, so that is bounded: one reply holds at most
``REPLAY_HWM - 1`` batches and ``REPLAY_MAX_BYTES`` (a client asks again from the next sequence
number, as it does after a gap), and at most ``REPLAY_HWM`` messages wait for one peer (ZMQ's
send high-water mark, with ROUTER_MANDATORY: a reply to a peer that has not read its last one
is cut, not queued). A reader that asks after reading the end mark always gets a whole reply.

Endpoints: an address on this machine (``tcp://127.0.0.1:PORT``, the default host, or ``*``,
``0.0.0.0``, ``::``, ``localhost``, ``ipc://``, ``inproc://``) is bound; any other address is
connected to (a collector elsewhere, as llm-d's endpoint picker), as vLLM does with a host that
is not a wildcard.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pagedkv.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_MAX_BYTES = 4 << 20  # batch bytes in one replay reply
REPLAY_HWM = 128  # replay messages waiting for one peer (a reply: up to REPLAY_HWM - 1 batches and the end)
_LOCAL_HOSTS = {"*", "0.0.0.0", "::", "[::]", "localhost", "127.0.0.1", "::1", "[::1]"}


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` fields (``enable_kv_cache_events`` and ``publisher`` are
    implied by giving an endpoint)."""

    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str | Mapping[str, Any]) -> KVEventsConfig:
        """From vLLM's JSON (``--kv-events-config``); ValueError naming what is wrong."""
        data = json.loads(text) if isinstance(text, str) else dict(text)
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        if data.pop("enable_kv_cache_events", True) is False or data.get("publisher", "zmq") == "null":
            raise ValueError("--kv-events-config turns KV cache events off; leave the flag out instead")
        if data.pop("publisher", "zmq") != "zmq":
            raise ValueError('--kv-events-config: the only publisher is "zmq"')
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


def hash64(block_hash: bytes) -> int:
    """vLLM's external block hash: the low 64 bits of the big-endian hash."""
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF


def lora_id(lora_name: str | None) -> int | None:
    """The ``lora_id`` of blocks a LoRA adapter computed: 63 bits of SHA-256 of its key (name and
    weights digest), so a reloaded adapter with other weights gets another id."""
    if lora_name is None:
        return None
    return int.from_bytes(hashlib.sha256(lora_name.encode()).digest()[:8], "big") >> 1


def encode_event(event: KVEvent) -> list:
    if isinstance(event, BlockStored):
        parent = hash64(event.parent_block_hash) if event.parent_block_hash is not None else None
        extra = [list(event.extra_keys) for _ in event.block_hashes] if event.extra_keys else None
        return ["BlockStored", [hash64(h) for h in event.block_hashes], parent, list(event.token_ids),
                event.block_size, lora_id(event.lora_name), event.medium, event.lora_name, extra]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", [hash64(h) for h in event.block_hashes], event.medium]
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV cache event: {event!r}")


def encode_batch(ts: float, events: list[KVEvent], rank: int = 0) -> bytes:
    import msgpack

    return msgpack.packb([ts, [encode_event(e) for e in events], rank], use_bin_type=True)


def _binds(endpoint: str) -> bool:
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = urlsplit(endpoint).hostname or endpoint.split("://", 1)[-1].rsplit(":", 1)[0]
    return host in _LOCAL_HOSTS or endpoint.split("://", 1)[-1].startswith("*")


class KVEventPublisher:
    """A PUB socket (and optionally a ROUTER replay socket) owned by one thread."""

    def __init__(self, config: KVEventsConfig) -> None:
        import zmq

        self.config = config
        self._queue: queue.Queue[tuple[float, list[KVEvent]] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = itertools.count()
        self.published = 0
        self.dropped = 0
        self.replays_cut = 0  # replies stopped for a peer that does not read
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            self._open(self._pub, config.endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, REPLAY_HWM)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full peer raises, not drops silently
                self._open(self._replay, config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise ValueError(f"KV events: cannot open {config.endpoint!r} / {config.replay_endpoint!r}: {exc}") from exc
        self._thread = threading.Thread(target=self._run, name="pagedkv-kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(socket, endpoint: str) -> None:
        if _binds(endpoint):
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one step's events (never blocks: a full queue drops the batch, counted)."""
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued, then close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        topic = self.config.topic.encode()
        while True:
            for _ in range(100 if self._replay is not None else 0):  # the waiting requests, not one per 50 ms
                if not poller.poll(0):
                    break
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            try:
                payload = encode_batch(ts, events)
                seq = next(self._seq)
                self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                self.published += 1
            except Exception:  # a publishing failure must not stop the thread
                logger.exception("publishing a KV event batch failed")

    def _serve_replay(self) -> None:
        replay = self._replay
        assert replay is not None, "polled only while the replay socket is open"
        frames = replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events replay: a request of %d frames ignored (want 3)", len(frames))
            return
        import zmq

        client, _, start = frames
        first = int.from_bytes(start, "big")
        size = count = 0
        try:
            for seq, payload in list(self._buffer):
                if seq < first:
                    continue
                if count == REPLAY_HWM - 1 or (size and size + len(payload) > REPLAY_MAX_BYTES):
                    break  # the rest in the next reply
                size, count = size + len(payload), count + 1
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            replay.send_multipart((client, b"", END_SEQ, b""), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # Again: REPLAY_HWM messages already wait for it; or it is gone
            self.replays_cut += 1
            if self.replays_cut == 1 or self.replays_cut % 1000 == 0:
                logger.warning("KV events replay: a reply cut short (%s; %d so far): the peer does not read",
                               exc, self.replays_cut)
