"""The engine's side of the KV tiers: opening the disk tier, making each step's block copies on
the runner (timed, for the reload-or-recompute costs), and writing the cache down at shutdown.

The memory core (pure Python) decides what moves between tiers; this module moves the bytes:

    plan.to_disk    device block -> payload (before anything in the step reuses the block)
                    -> DiskPrefixTier.offer_write (background worker, bounded queue)
    plan.from_disk  payload read by the worker -> host block
    plan.swap_out   device -> host (swap-outs and offloads)      timed: host_write s/block
    plan.swap_in    host -> device (swap-ins and reloads)        timed: host_read s/block
    plan.copies     copy-on-write, device -> device
"""

from __future__ import annotations

import logging
import time

from pagedkv.engine.config import EngineConfig
from pagedkv.memory.disk_prefix import DiskPrefixTier
from pagedkv.memory.disk_tier import DiskTier
from pagedkv.memory.kv_cache_manager import KVCacheManager
from pagedkv.memory.tier_costs import DISK_READ, HOST_READ, HOST_WRITE, TierCosts

logger = logging.getLogger(__name__)

PAYLOAD_LAYOUT = "kv[layers,2,block_size,kv_heads,head_dim] then scales[layers,2,kv_heads] float32; v1"
WRITE_QUEUE_BYTES = 256 << 20  # blocks waiting for the disk worker, at most (at least 8 blocks)


def open_disk_tier(config: EngineConfig, runner, model_name: str,
                   identity: dict[str, str] | None) -> DiskPrefixTier | None:
    """The disk tier of ``config.kv_offload_dir``, or None. Raises DiskTierError (in use, unsafe
    permissions) with a message saying what to do."""
    if config.kv_offload_dir is None:
        return None
    cfg = getattr(runner, "config", None)
    fmt = getattr(runner, "kv_format", None)
    fingerprint = {
        "model": model_name,
        **(identity or {}),
        "dtype": _model_dtype(runner, config),
        **({"weights": "q8_0"} if _has_q8_0_weights(runner) else {}),  # other weights, other K/V
        "block_size": str(runner.block_size),
        "kv_cache_dtype": fmt.name if fmt is not None else config.kv_cache_dtype,
        "shape": "" if cfg is None else (f"layers={cfg.num_hidden_layers} kv_heads={cfg.num_key_value_heads} "
                                         f"head_dim={cfg.head_dim}" + _group_layout(runner)),
        "payload": PAYLOAD_LAYOUT,
    }
    disk = DiskTier(config.kv_offload_dir, config.disk_tier_bytes, fingerprint, payload_bytes=_payload_bytes(runner))
    per_block = int(getattr(getattr(runner, "cache", None), "bytes_per_block", 0)) or 1
    tier = DiskPrefixTier(disk, max_queued_writes=max(8, WRITE_QUEUE_BYTES // per_block))
    s = disk.stats()
    logger.info("KV disk tier %s: %d blocks (%.1f MiB) of %.1f MiB", config.kv_offload_dir, s.blocks,
                s.bytes_used / 2**20, s.capacity_bytes / 2**20)
    return tier


def _payload_bytes(runner) -> int | None:
    """The exact size of a block's payload (``runner.block_payloads``): a block file of another
    size is discarded when read, never handed to the runner (it would fail the step)."""
    payloads = getattr(runner, "block_payloads", None)
    if payloads is None or not getattr(runner, "num_blocks", 0):
        return None
    return len(payloads([0])[0])


def _group_layout(runner) -> str:
    """A hybrid model's KV groups (a block holds one group's layers): part of what a block means."""
    groups = getattr(getattr(runner, "cache", None), "groups", ())
    if len(groups) <= 1:
        return ""
    return " kv_groups=" + ",".join(f"{g.window or 'full'}:{'+'.join(map(str, g.layers))}" for g in groups)


def _model_dtype(runner, config: EngineConfig) -> str:
    """The dtype the model computes in (``config.dtype`` may be "auto")."""
    model = getattr(runner, "model", None)
    params = getattr(model, "parameters", None)
    if params is None:
        return config.dtype
    return str(next(params()).dtype).removeprefix("torch.")


def _has_q8_0_weights(runner) -> bool:
    """Whether the model keeps linear weights in Q8_0 (``quantization``, resolved)."""
    modules = getattr(getattr(runner, "model", None), "modules", None)
    if modules is None:
        return False
    from pagedkv.models.quant_linear import QuantLinear
    return any(isinstance(m, QuantLinear) for m in modules())


class TierMover:
    """Makes each step's block copies on the runner and feeds their timings to ``kv.costs``."""

    def __init__(self, runner, kv: KVCacheManager) -> None:
        self.runner = runner
        self.kv = kv
        self.costs: TierCosts = kv.costs
        self._disk_read = (0, 0.0)  # (blocks, seconds) of disk reads already fed to the costs

    def run(self, out) -> None:
        """The plan's copies, in the order ``SchedulerOutput`` documents."""
        runner, kv, costs = self.runner, self.kv, self.costs
        disk = kv.disk
        if out.to_disk and disk is not None:
            ids = [b for b, _ in out.to_disk]
            for (_, key), payload in zip(out.to_disk, runner.block_payloads(ids)):
                disk.offer_write(key, payload)
        if out.from_disk:
            runner.load_host_blocks(out.from_disk)
        if disk is not None:
            io = disk.io_stats()
            blocks, seconds = io.read_blocks - self._disk_read[0], io.read_seconds - self._disk_read[1]
            self._disk_read = (io.read_blocks, io.read_seconds)
            costs.observe(DISK_READ, blocks, seconds)
        if out.swap_out:
            start = time.perf_counter()
            runner.swap_out(out.swap_out)
            costs.observe(HOST_WRITE, len(out.swap_out), time.perf_counter() - start)
        if out.swap_in:
            start = time.perf_counter()
            runner.swap_in(out.swap_in)
            costs.observe(HOST_READ, len(out.swap_in), time.perf_counter() - start)
        if out.copies:
            runner.copy_blocks(out.copies)

    def persist(self) -> int:
        """Write every cached block not yet on disk (host tier, then device) and close the disk
        tier; returns how many blocks were written. For a clean shutdown."""
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
