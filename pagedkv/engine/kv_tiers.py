"""The engine's wiring of the KV tiers: opening the disk store and the remote tier's server,
handing each step's block moves to the runner (``runner/block_moves.py``) and their results to the
memory core, and writing the cache down at shutdown.

The memory core (pure Python) decides what moves between tiers; the runner moves the bytes;
this module only connects them:

    plan.to_disk    runner: device block -> payload   -> remote.offer_payload (the remote tier's
                                                         blocks) or kv.disk.offer_write (background workers)
    plan.from_disk  runner: payload read by the worker -> host block
    plan.swap_out   runner: device -> host (swap-outs and offloads)    seconds -> costs host_write
    plan.swap_in    runner: host -> device (swap-ins and reloads)      seconds -> costs host_read
    plan.copies     runner: copy-on-write, device -> device
    disk reads      the worker's read seconds                          -> costs disk_read
    remote reads    the remote worker's read seconds                   -> costs remote_read
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pagedkv.engine.config import EngineConfig
from pagedkv.memory.kv_cache_manager import KVCacheManager
from pagedkv.memory.tiers.base import LowerTier
from pagedkv.memory.tiers.costs import DISK_READ, HOST_READ, HOST_WRITE, REMOTE_READ, TierCosts
from pagedkv.memory.tiers.disk_store import DiskStore
from pagedkv.memory.tiers.host import HostTier
from pagedkv.memory.tiers.remote import RemoteTier
from pagedkv.memory.tiers.remote_store import RemoteStore
from pagedkv.runner.block_moves import move_blocks
from pagedkv.runner.protocol import Runner

logger = logging.getLogger(__name__)

PAYLOAD_LAYOUT = "kv[layers,2,block_size,kv_heads,head_dim] then scales[layers,2,kv_heads] float32; v1"
WRITE_QUEUE_BYTES = 256 << 20  # blocks waiting for the disk worker, at most (at least 8 blocks)
REMOTE_QUEUE_BYTES = 256 << 20  # blocks waiting for the remote writer, at most (at least 8 blocks)
REMOTE_READ_BATCH_BYTES = 16 << 20  # one MGET of the remote tier reads about this much at most


def tier_fingerprint(runner: Runner, model_name: str, identity: dict[str, str] | None,
                     tensor_parallel_size: int = 1) -> dict[str, str]:
    """What a block's payload is only good for: the model (and its tokenizer), dtype, weights,
    block size, KV format and shape, the payload's layout, and over N > 1 tensor-parallel ranks
    N (a payload is every rank's shard, concatenated in rank order; at 1 the key is left out, so
    the blocks of an engine on one device keep their fingerprint). The disk and remote tiers keep
    blocks under it."""
    cfg = runner.config
    groups = runner.kv_groups
    layout = "" if len(groups) <= 1 else (  # a hybrid model's KV groups (a block holds one group's layers)
        " kv_groups=" + ",".join(f"{g.window or 'full'}:{'+'.join(map(str, g.layers))}" for g in groups))
    quantization = runner.weights_quantization
    return {
        "model": model_name,
        **(identity or {}),
        "dtype": runner.model_dtype,
        **({"weights": quantization} if quantization else {}),  # other weights, other K/V
        "block_size": str(runner.block_size),
        "kv_cache_dtype": runner.kv_format.name,
        # K at the model dtype beside 8-bit V: other bytes (the key absent for "kv": its files stay valid)
        **({"kv_quant_parts": runner.kv_quant_parts} if runner.kv_quant_parts != "kv" else {}),
        "shape": f"layers={cfg.num_hidden_layers} kv_heads={cfg.num_key_value_heads} head_dim={cfg.head_dim}" + layout,
        "payload": PAYLOAD_LAYOUT,
        **({"tensor_parallel_size": str(tensor_parallel_size)} if tensor_parallel_size > 1 else {}),
    }


def open_disk_store(config: EngineConfig, runner: Runner, model_name: str,
                    identity: dict[str, str] | None) -> DiskStore | None:
    """The disk tier's block store in ``config.kv_offload_dir``, or None. Raises DiskTierError
    (in use, unsafe permissions) with a message saying what to do."""
    if config.kv_offload_dir is None:
        return None
    fingerprint = tier_fingerprint(runner, model_name, identity, config.tensor_parallel_size)
    # a block file of another size than this cache's payload is discarded when read, never handed
    # to the runner (it would fail the step)
    store = DiskStore(config.kv_offload_dir, config.disk_tier_bytes, fingerprint,
                      payload_bytes=runner.payload_bytes or None)
    s = store.stats()
    logger.info("KV disk tier %s: %d blocks (%.1f MiB) of %.1f MiB", config.kv_offload_dir, s.blocks,
                s.bytes_used / 2**20, s.capacity_bytes / 2**20)
    return store


def disk_write_queue(runner: Runner) -> int:
    """Evicted blocks the disk tier's worker may have waiting: ``WRITE_QUEUE_BYTES`` of them, at least 8."""
    return max(8, WRITE_QUEUE_BYTES // (runner.bytes_per_block or 1))


def remote_tiers(config: EngineConfig, runner: Runner, model_name: str, identity: dict[str, str] | None,
                 costs: TierCosts) -> list[Callable[[HostTier | None], LowerTier]]:
    """The remote tier on ``config.kv_remote_url``, as the manager's ``more_tiers`` (empty without
    one). The server is reached lazily: one that is down at start is a miss, not an error.
    Raises RemoteTierError without the Redis client library, ValueError without host blocks."""
    if config.kv_remote_url is None:
        return []
    if runner.num_host_blocks == 0:
        raise ValueError("the remote tier (kv_remote_url) loads blocks through the host tier, which has no "
                         "blocks: give a larger kv_offloading_size")
    # (the payload's size too: a layout that changes it, e.g. a mixed pool's format byte and padding,
    # gets keys of its own instead of values every other replica would discard)
    fingerprint = {**tier_fingerprint(runner, model_name, identity),
                   "tensor_parallel_size": str(config.tensor_parallel_size), "payload_bytes": str(runner.payload_bytes)}
    store = RemoteStore(config.kv_remote_url, fingerprint, key_prefix=config.kv_remote_key_prefix,
                        payload_bytes=runner.payload_bytes or None)
    logger.info("KV remote tier %s, keys %s*", store.url, store.namespace.decode())
    queue = max(8, REMOTE_QUEUE_BYTES // (runner.bytes_per_block or 1))

    def make(host: HostTier | None) -> LowerTier:
        if host is None:
            raise ValueError("the remote tier (kv_remote_url) needs the host tier: prefix caching and host blocks")
        return RemoteTier(store, host=host, costs=costs, block_size=runner.block_size, max_queued_writes=queue,
                          read_batch_bytes=REMOTE_READ_BATCH_BYTES, events=host.events)
    return [make]


class TierMover:
    """Hands each step's block moves to the runner, their payloads to the disk tier and their
    timings to ``kv.costs``."""

    def __init__(self, runner: Runner, kv: KVCacheManager) -> None:
        self.runner = runner
        self.kv = kv
        self.remote = next((t for t in kv.lower_tiers if isinstance(t, RemoteTier)), None)
        self._disk_read = (0, 0.0)  # (blocks, seconds) of disk reads already fed to the costs
        self._remote_read = (0, 0.0)

    def run(self, out) -> None:
        """The plan's copies, in the order ``SchedulerOutput`` documents."""
        costs, disk, remote = self.kv.costs, self.kv.disk, self.remote
        to_disk = out.to_disk  # blocks to serialize: the disk tier's evictions, the remote tier's new blocks
        moved = move_blocks(self.runner, [b for b, _ in to_disk], out.from_disk, out.swap_out, out.swap_in,
                            out.copies)
        for (_, key), payload in zip(to_disk, moved.payloads):
            if remote is not None and remote.offer_payload(key, payload):
                continue  # (a block both tiers asked for is listed twice: the second is the disk's)
            if disk is not None:
                disk.offer_write(key, payload)
        if remote is not None:
            rio = remote.io_stats()
            blocks, seconds = rio.read_blocks - self._remote_read[0], rio.read_seconds - self._remote_read[1]
            self._remote_read = (rio.read_blocks, rio.read_seconds)
            costs.observe(REMOTE_READ, blocks, seconds)
        if disk is not None:
            io = disk.io_stats()
            blocks, seconds = io.read_blocks - self._disk_read[0], io.read_seconds - self._disk_read[1]
            self._disk_read = (io.read_blocks, io.read_seconds)
            costs.observe(DISK_READ, blocks, seconds)
        if out.swap_out:
            costs.observe(HOST_WRITE, len(out.swap_out), moved.swap_out_s)
        if out.swap_in:
            costs.observe(HOST_READ, len(out.swap_in), moved.swap_in_s)

    def persist(self) -> int:
        """Write every cached block not yet on disk (host tier, then device) and close the disk
        tier, then the same for the remote tier; returns how many blocks were written to disk.
        For a clean shutdown."""
        self._persist_remote()
        disk = self.kv.disk
        if disk is None:
            return 0
        disk.flush(timeout=60.0)
        todo = self.kv.persistable_blocks()
        written = 0
        if todo:
            logger.info("KV disk tier: writing %d cached blocks before shutdown", len(todo))
            last_report = time.monotonic()
            for i in range(0, len(todo), 64):
                batch = todo[i:i + 64]
                for tier in ("host", "device"):
                    part = [(b, k) for t, b, k in batch if t == tier]
                    if not part:
                        continue
                    read = self.runner.host_block_payloads if tier == "host" else self.runner.block_payloads
                    for (_, key), payload in zip(part, read([b for b, _ in part])):
                        written += disk.write_now(key, payload)
                if time.monotonic() - last_report > 5.0:
                    last_report = time.monotonic()
                    logger.info("KV disk tier: %d of %d blocks written", i + len(batch), len(todo))
        disk.close(flush=True)
        return written

    def _persist_remote(self) -> None:
        """Write the cached blocks (host tier, then device) the remote tier's server lacks, then
        close the tier. Bounded: nothing when the server is unreachable."""
        remote = self.remote
        if remote is None:
            return
        remote.flush(timeout=30.0)
        todo = remote.persistable_blocks(self.kv.pool)
        written = 0
        if todo:
            logger.info("KV remote tier: writing %d cached blocks it lacks before shutdown", len(todo))
            for i in range(0, len(todo), 16):
                batch = todo[i:i + 16]
                for tier in ("host", "device"):
                    part = [(b, k) for t, b, k in batch if t == tier]
                    if part:
                        read = self.runner.host_block_payloads if tier == "host" else self.runner.block_payloads
                        payloads = read([b for b, _ in part])
                        written += remote.write_now([(k, p) for (_, k), p in zip(part, payloads)])
            logger.info("KV remote tier: %d blocks written at shutdown", written)
        remote.close(flush=False)
