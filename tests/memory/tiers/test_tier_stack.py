"""The lower tiers as one interface (``memory/tiers/``): the host and the disk tier implement the
``LowerTier`` protocol, and the ``TierStack`` hands every verb to each tier in turn, so a further
tier (a store shared by replicas) is one more class and no edit to the manager.

Exact calls, in order, against a recording tier; the stack's rules (a dropped eviction is offered
to no tier, the step's copies of every tier in one ``TierCopies``); each tier's own integrity
check reached through the manager's.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Hashable, Sequence
from typing import Any

import pytest

from pagedkv.memory import KVCacheManager
from pagedkv.memory.block import Block
from pagedkv.memory.block_pool import DROPPED, BlockPool
from pagedkv.memory.errors import IntegrityError
from pagedkv.memory.tiers.base import LowerTier, StepCopies, TierCopies
from pagedkv.memory.tiers.costs import TierCosts
from pagedkv.memory.tiers.disk import DiskTier
from pagedkv.memory.tiers.disk_store import DiskStore
from pagedkv.memory.tiers.host import HostTier
from pagedkv.memory.tiers.stack import TierStack

B = 4


class RecordingTier:
    """A third tier that keeps nothing and records every call the stack makes."""

    name = "remote"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def lookup(self, keys: Sequence[bytes]) -> int:
        self.calls.append(("lookup", len(keys)))
        return 0

    def holds(self, key: bytes) -> bool:
        return False

    def prepare_load(self, seq_id: Hashable, keys: list[bytes], query_tokens: int, count: bool,
                     tokens_of: dict[bytes, int] | None = None) -> bool:
        self.calls.append(("prepare_load", seq_id, len(keys)))
        return False

    def complete_loads(self, device: BlockPool) -> None:
        self.calls.append(("complete_loads",))

    def offer(self, block: Block) -> None:
        self.calls.append(("offer", block.block_id))

    def on_cached(self, blocks: Sequence[Block]) -> None:
        self.calls.append(("on_cached", [b.block_id for b in blocks]))

    def take_copies(self, copies: StepCopies) -> None:
        self.calls.append(("take_copies",))
        copies.to_disk.append((99, b"remote"))

    def finish_step(self, copied: bool) -> None:
        self.calls.append(("finish_step", copied))

    def take_events(self) -> None:
        self.calls.append(("take_events",))

    def forget(self, seq_id: Hashable) -> None:
        self.calls.append(("forget", seq_id))

    def wait_for_loads(self, timeout: float) -> bool:
        self.calls.append(("wait_for_loads", timeout))
        return False

    def held_blocks(self) -> list[int]:
        return []

    def stats(self) -> dict[str, Any]:
        return {"remote_calls": len(self.calls)}

    def check_integrity(self) -> None:
        self.calls.append(("check_integrity",))


class HoldsTwo(RecordingTier):
    """Holds the first two of whatever it is asked about."""

    def lookup(self, keys: Sequence[bytes]) -> int:
        self.calls.append(("lookup", list(keys)))
        return min(2, len(keys))


def _block(block_id: int, key: bytes) -> Block:
    block = Block(block_id)
    block.block_hash = key
    return block


def test_host_and_disk_tiers_implement_the_one_protocol(tmp_path):
    host = HostTier(BlockPool(4, name="host"))
    disk = DiskTier(DiskStore(tmp_path / "kv", 1 << 20, {"m": "x"}), host=host, costs=TierCosts(B), block_size=B)
    try:
        tiers: list[LowerTier] = [host, disk, RecordingTier()]  # (mypy checks the structure)
        verbs = [name for name in vars(LowerTier) if not name.startswith("_")]
        assert {"lookup", "holds", "prepare_load", "complete_loads", "offer", "on_cached", "take_copies", "finish_step",
                "take_events", "forget", "stats", "check_integrity"} <= set(verbs)
        for tier in tiers:
            for verb in verbs:
                assert callable(getattr(tier, verb)), f"{type(tier).__name__} lacks {verb}"
        assert (host.name, disk.name) == ("host", "disk")
    finally:
        disk.close()


def test_the_stack_hands_each_verb_to_every_tier_in_order():
    host = HostTier(BlockPool(4, name="host"))
    remote = RecordingTier()
    stack = TierStack(host, None, more=(remote,))
    assert list(stack) == [host, remote]
    stack.on_evict(_block(3, b"k3"), "lru")
    stack.on_evict(_block(4, b"k4"), DROPPED)  # its KV is not to be trusted: no tier copies it
    stack.on_cached([_block(5, b"k5")])  # just cached on the device: a shared tier writes it now
    copies = stack.take_copies()
    assert isinstance(copies, TierCopies)
    assert copies.offloads == ((3, 0),) and copies.to_disk == ((99, b"remote"),)
    stack.finish_step(copied=True)
    stack.forget("s")
    stack.take_events()
    stack.complete_loads(BlockPool(2))
    assert stack.stats()["offloaded_blocks"] == 1 and "remote_calls" in stack.stats()
    stack.check_integrity()
    assert remote.calls == [("offer", 3), ("on_cached", [5]), ("take_copies",), ("finish_step", True), ("forget", "s"),
                            ("take_events",), ("complete_loads",), ("check_integrity",)]
    assert host.pool.cached.keys() == {b"k3"} and host.held == []


def test_read_ahead_asks_each_tier_below_the_host_for_the_run_past_device_and_host():
    host = HostTier(BlockPool(3, name="host"))
    remote = HoldsTwo()
    stack = TierStack(host, None, more=(remote,))
    device = BlockPool(4)
    hashes = [bytes([i]) * 8 for i in range(6)]
    device.cache(device.allocate(1), hashes[:1])  # block 0 on the device
    host.pool.cache(host.pool.allocate(1), hashes[1:2])  # block 1 in the host tier
    host.pool.free(host.pool.blocks[i] for i in range(1))  # (cached-free there)
    assert stack.below_host == (remote,)
    assert stack.prefetch("s", hashes, True, device, B) is False
    # past blocks 0 (device) and 1 (host): at most the host's room (3 free - 1 hit = 2) blocks
    assert remote.calls == [("complete_loads",), ("lookup", hashes[2:4]), ("prepare_load", "s", 2)]
    assert TierStack(host).prefetch("s", hashes, True, device, B) is False  # nothing below the host


def test_an_empty_stack_copies_nothing_and_a_disk_needs_a_host():
    stack = TierStack()
    assert not stack and stack.take_copies() == TierCopies()
    with pytest.raises(ValueError, match="host tier"):
        TierStack(None, object())  # (a disk tier without the host tier)


def test_manager_integrity_check_reaches_each_tiers_own_check(tmp_path):
    kv = KVCacheManager(8, B, num_host_blocks=4, offload_to_host=True,
                        disk=DiskStore(tmp_path / "kv", 1 << 20, {"m": "x"}))
    disk = kv.disk
    assert disk is not None
    try:
        assert [t.name for t in kv.lower_tiers] == ["host", "disk"]
        kv.check_integrity()
        disk.store._bytes_used += 1  # the store's own books disagree with its index
        with pytest.raises(IntegrityError, match="disk tier: bytes_used"):
            kv.check_integrity()
        disk.store._bytes_used -= 1
        assert kv.host_tier is not None
        kv.host_tier._in.append((0, 1))  # a reload of a host block the tier does not hold
        with pytest.raises(IntegrityError, match="host tier"):
            kv.check_integrity()
    finally:
        disk.close()


def test_the_tier_package_imports_no_torch():
    code = ("import sys, pagedkv.memory.tiers.stack, pagedkv.memory.swap; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
