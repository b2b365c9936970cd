"""The default KV pool and host tier, sized from the model and the memory available
(``engine/kv_sizing.py``): the rule's branches on made-up machines, and an engine that logs how it
chose while kv_cache_memory / num_kv_blocks / kv_offloading_size still override."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from pagedkv.engine import LLMEngine
from pagedkv.engine.kv_sizing import (
    GIVEN_POOL_HOST_BYTES,
    HOST_MEMORY_FRACTION,
    HOST_TIER_SHARE,
    HOST_TIER_SHARE_CPU,
    KV_MEMORY_FRACTION,
    MIN_KV_BLOCKS,
    available_host_memory,
    size_kv,
)
from pagedkv_testing.tiny_model import write_tiny_model

MiB, GiB = 1 << 20, 1 << 30
BLOCK = MiB  # one block of 16 tokens: 64 KiB a token


def _size(**kw: object) -> object:
    args: dict[str, object] = dict(block_bytes=BLOCK, block_size=16, max_model_len=4096, weight_bytes=100 * MiB,
                                   device_available=64 * GiB, host_available=64 * GiB)
    return size_kv(**{**args, **kw})  # type: ignore[arg-type]  # the keywords above, typed by size_kv


def test_the_pool_holds_one_longest_sequence_or_twice_the_weights_within_the_free_memory() -> None:
    s = _size()  # one 4096-token sequence: 256 blocks = 256 MiB > 2 x 100 MiB
    assert s.kv_bytes == 256 * MiB and "one 4096-token sequence" in s.reason
    assert s.host_bytes == int(HOST_TIER_SHARE_CPU * 256 * MiB) and "kv_offloading_size overrides" in s.reason
    s = _size(weight_bytes=300 * MiB)  # twice the weights wins
    assert s.kv_bytes == 600 * MiB and "2x the weights" in s.reason
    s = _size(device_available=400 * MiB, host_available=400 * MiB)  # capped by the fraction of what is free
    assert s.kv_bytes == int(KV_MEMORY_FRACTION * 400 * MiB) and "50% of the" in s.reason
    assert s.host_bytes is not None and s.host_bytes <= HOST_MEMORY_FRACTION * (400 * MiB - s.kv_bytes)
    s = _size(device_available=4 * MiB, host_available=None)  # never below MIN_KV_BLOCKS
    assert s.kv_bytes == MIN_KV_BLOCKS * BLOCK
    s = _size(same_memory=False)  # a GPU's pool: the host tier is a larger share
    assert s.host_bytes == int(HOST_TIER_SHARE * 256 * MiB)


def test_given_sizes_are_kept_and_said_so() -> None:
    s = _size(pool_bytes=64 * MiB)  # beside a configured pool the host tier keeps its former 0.5 GiB
    assert s.kv_bytes == 64 * MiB and "KV pool" not in s.reason and s.host_bytes == GIVEN_POOL_HOST_BYTES
    s = _size(pool_bytes=64 * MiB, host_given=True)
    assert s.host_bytes is None and s.reason == "KV pool and host tier as configured"


def test_available_memory_is_read_on_linux() -> None:
    if not Path("/proc/meminfo").exists():
        pytest.skip("no /proc/meminfo")
    free = available_host_memory()
    assert free is not None and free > 0


def test_the_engine_logs_its_sizing_and_options_override(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = write_tiny_model(tmp_path / "tiny")
    with caplog.at_level(logging.INFO, logger="pagedkv.engine.build"):
        engine = LLMEngine.from_options(str(folder), max_model_len=256)
    line = next(r.getMessage() for r in caplog.records if "KV pool" in r.getMessage())
    assert "blocks of" in line and "host tier" in line and "overrides" in line
    assert engine.runner.num_blocks >= MIN_KV_BLOCKS
    engine.close()
    engine = LLMEngine.from_options(str(folder), num_kv_blocks=24, kv_offloading_size=0)
    assert engine.runner.num_blocks == 24 and engine.runner.num_host_blocks == 0
    engine.close()
