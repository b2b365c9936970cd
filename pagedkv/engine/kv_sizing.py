"""The default sizes of the KV pool and the host tier, from the model and the memory the machine has.

vLLM sizes its KV cache as a fraction of the device memory left after the weights; a fixed size
either wastes a small machine's memory on a small model (a 135M model held 2.1 GB: a 1 GiB pool
and a 0.5 GiB host tier whatever the model) or starves a large one. Here, unless
``kv_cache_memory`` / ``num_kv_blocks`` (the pool) or ``kv_offloading_size`` (the host tier) are
given:

- the pool wants room for one sequence of ``max_model_len`` tokens, and at least twice the
  weights' bytes (a served model's KV pool is of the order of its weights: vLLM on a GPU
  typically gets 2-4x), and at least :data:`MIN_KV_BYTES`, and never more than
  :data:`KV_MEMORY_FRACTION` of the memory available
  now (after the weights are loaded: ``MemAvailable``, bounded by a cgroup limit; on CUDA the
  device's free memory), nor less than :data:`MIN_KV_BLOCKS` blocks;
- the host tier is :data:`HOST_TIER_SHARE` of a GPU's pool (:data:`HOST_TIER_SHARE_CPU` of a CPU
  pool, which is host memory itself; 0.5 GiB, as before, beside a pool the config gives), within
  :data:`HOST_MEMORY_FRACTION` of the host memory still available after it (``engine/build.py``
  keeps it within 4x the pool).

:func:`size_kv` says how it chose (``KVSizing.reason``, logged once at start).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pagedkv.units import format_bytes

KV_MEMORY_FRACTION = 0.5  # of the memory available after the weights
WEIGHTS_MULTIPLE = 2  # the pool wants at least this many times the weights' bytes
HOST_TIER_SHARE = 0.5  # the host tier: this share of a GPU's pool
HOST_TIER_SHARE_CPU = 0.125  # ... of a CPU pool, host memory itself: room for swapped-out rows
HOST_MEMORY_FRACTION = 0.25  # ... within this fraction of the host memory left after the pool
MIN_KV_BLOCKS = 16
# A small model's pool is not sized down to one sequence: batches and fan-outs (n > 1) need many
# sequences' blocks, and 64 MiB is little beside any machine this runs on (the fixed default was 1 GiB).
MIN_KV_BYTES = 64 * 1024 * 1024
GIVEN_POOL_HOST_BYTES = 1 << 29  # beside a configured pool: the fixed 0.5 GiB of before (at most 4x the pool)


@dataclass(frozen=True, slots=True)
class KVSizing:
    """The device pool's bytes (chosen, or as given), the host tier's (None: as given) and a
    sentence saying how they were chosen."""

    kv_bytes: int
    host_bytes: int | None
    reason: str


def available_host_memory() -> int | None:
    """Bytes the host can still give this process: ``MemAvailable``, bounded by the cgroup's limit
    less its usage where one is set; None where neither can be read (not Linux)."""
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
                break
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            if limit != "max" and int(limit) < 1 << 60:
                found.append(max(0, int(limit) - int(Path(usage_file).read_text().strip())))
                break
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def available_device_memory(device_type: str) -> int | None:
    """Free bytes of the device the pool lives on: the host's for "cpu", CUDA's free memory else."""
    if device_type != "cuda":
        return available_host_memory()
    import torch

    try:
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    except (RuntimeError, AssertionError):
        return None


def size_kv(*, block_bytes: int, block_size: int, max_model_len: int, weight_bytes: int,
            device_available: int | None, host_available: int | None, pool_bytes: int | None = None,
            host_given: bool = False, same_memory: bool = True) -> KVSizing:
    """The default pool (unless ``pool_bytes``, the configured one, is given) and host tier (unless
    ``host_given``), the module docstring's rule. ``block_bytes``: one device block (``block_size``
    tokens, every layer, scales included); ``same_memory``: the pool lives in host memory too (a
    CPU device), so the host tier's budget is what the pool leaves."""
    parts: list[str] = []
    if pool_bytes is None:
        sequence = -(-max_model_len // block_size) * block_bytes
        want = max(sequence, WEIGHTS_MULTIPLE * weight_bytes, MIN_KV_BYTES)
        why = (f"one {max_model_len}-token sequence ({format_bytes(sequence)})" if sequence >= want else
               f"{WEIGHTS_MULTIPLE}x the weights' {format_bytes(weight_bytes)}"
               if WEIGHTS_MULTIPLE * weight_bytes >= want
               else f"the {format_bytes(MIN_KV_BYTES)} floor for a small model")
        kv = want
        if device_available is not None and KV_MEMORY_FRACTION * device_available < want:
            kv = int(KV_MEMORY_FRACTION * device_available)
            why = (f"{KV_MEMORY_FRACTION:.0%} of the {format_bytes(device_available)} available "
                   f"(it wanted {why})")
        elif device_available is not None:
            why += f", within {KV_MEMORY_FRACTION:.0%} of the {format_bytes(device_available)} available"
        kv = max(kv - kv % block_bytes, MIN_KV_BLOCKS * block_bytes)
        parts.append(f"KV pool {format_bytes(kv)} ({kv // block_bytes} blocks of {block_size} tokens): {why} "
                     "(kv_cache_memory or num_kv_blocks overrides)")
    else:
        kv = pool_bytes
    host: int | None = None
    if not host_given:
        share = HOST_TIER_SHARE_CPU if same_memory else HOST_TIER_SHARE
        host = int(share * kv) if pool_bytes is None else GIVEN_POOL_HOST_BYTES
        why = f"{share * 100:g}% of the pool" if pool_bytes is None else "0.5 GiB beside a configured pool"
        if host_available is not None:
            left = max(0, host_available - (kv if same_memory and pool_bytes is None else 0))
            if host > HOST_MEMORY_FRACTION * left:
                host = int(HOST_MEMORY_FRACTION * left)
                why = f"{HOST_MEMORY_FRACTION:.0%} of the {format_bytes(left)} of host memory left"
        parts.append(f"host tier {format_bytes(host)}: {why} (kv_offloading_size overrides)")
    return KVSizing(kv, host, "; ".join(parts) if parts else "KV pool and host tier as configured")
