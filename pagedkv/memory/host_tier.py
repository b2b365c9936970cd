"""The host tier of the prefix cache: cached blocks evicted from the device pool live on in the
host pool, and a prompt whose prefix continues there reloads them instead of recomputing.

The host pool is shared with swapped-out sequences, which outrank cached blocks (a swap-out may
take any cached host block, least recently used first). Offloads and reloads are copies the
runner makes before the step's forward pass: :meth:`HostPrefixTier.take_copies` hands them over
(offloads go with the swap-outs, reloads with the swap-ins) and :meth:`finish_step`, once they are
done, releases the host blocks they read or wrote. Until then those blocks are held (one extra
reference), so nothing later in the same step can reuse one that a copy still reads or writes.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.memory.block import Block
from pagedkv.memory.block_pool import BlockPool

CopyPair = tuple[int, int]  # (source block id, destination block id)


class HostPrefixTier:
    def __init__(self, host_pool: BlockPool) -> None:
        self.pool = host_pool
        self.offloaded_blocks = 0  # cached device blocks copied down on eviction
        self.offloads_dropped = 0  # evictions not copied: no host block could be taken
        self.reloaded_blocks = 0  # host blocks copied back up for a prompt's prefix
        self.hit_tokens = 0  # prompt tokens found here (part of the manager's prefix hits)
        self._out: list[CopyPair] = []  # (device, host) offloads of this step
        self._in: list[CopyPair] = []  # (host, device) reloads of this step
        self.held: list[Block] = []  # host blocks read or written by this step's copies
        self._offloaded_now: list[Block] = []  # host blocks this step's offloads or disk loads write
        self._loads: list[tuple[int, bytes]] = []  # (host block, payload) read from disk, this step
        self.disk_loaded_blocks = 0  # blocks read from the disk tier into this tier
        self.from_disk: set[bytes] = set()  # hashes loaded from disk and not yet reloaded (cache details)

    def offload(self, block: Block) -> None:
        """Copy a cached device block that is being evicted down here (most recently used)."""
        host = self.pool
        block_hash = block.block_hash
        assert block_hash is not None
        there = host.cached.get(block_hash)
        if there is not None:  # already here: it becomes the most recently used
            host.touch(there)
            host.free((there,))
            return
        if host.num_free == 0:
            self.offloads_dropped += 1
            return
        target = host.allocate(1)[0]  # may forget this tier's least recently used block
        host.cache((target,), (block_hash,), block.kv_group)
        if host.events is not None and block.kv_group == 0:
            host.events.stored([block_hash], None, [], host.medium)
        self.held.append(target)
        self._offloaded_now.append(target)
        self._out.append((block.block_id, target.block_id))
        self.offloaded_blocks += 1

    def load(self, block_hash: bytes, payload: bytes) -> bool:
        """Take a block read from the disk tier into this tier (most recently used); the runner
        writes ``payload`` into it before this step's reloads. False when no host block is free."""
        host = self.pool
        if block_hash in host.cached or host.num_free == 0:
            return False
        target = host.allocate(1)[0]
        host.cache((target,), (block_hash,))
        if host.events is not None:
            host.events.stored([block_hash], None, [], host.medium)
        self.held.append(target)
        self._offloaded_now.append(target)
        self._loads.append((target.block_id, payload))
        self.disk_loaded_blocks += 1
        if len(self.from_disk) > host.num_blocks:  # forget loads whose blocks left this tier unused
            self.from_disk &= host.cached.keys()
        self.from_disk.add(block_hash)
        return True

    def match(self, block_hashes: Iterable[bytes]) -> list[Block]:
        """The blocks holding the longest run of ``block_hashes`` from its start."""
        hits = []
        for block_hash in block_hashes:
            block = self.pool.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def hold(self, blocks: Iterable[Block]) -> None:
        """Keep host blocks from reuse until :meth:`finish_step` (a copy reads them this step)."""
        for block in blocks:
            self.pool.touch(block)
            self.held.append(block)

    def reload(self, hits: list[Block], device_blocks: Iterable[Block], block_size: int) -> None:
        """Copy the (held) host ``hits`` up into ``device_blocks`` this step."""
        self._in += [(h.block_id, d.block_id) for h, d in zip(hits, device_blocks)]
        self.reloaded_blocks += len(hits)
        self.hit_tokens += len(hits) * block_size

    def take_copies(self) -> tuple[list[CopyPair], list[CopyPair], list[tuple[int, bytes]]]:
        """This step's ``(device, host)`` offloads, ``(host, device)`` reloads and ``(host block,
        payload)`` disk loads, handed over once."""
        out, into, loads = self._out, self._in, self._loads
        self._out, self._in, self._loads = [], [], []
        return out, into, loads

    def finish_step(self, copied: bool = True) -> None:
        """The step's copies are over: release the blocks they held. With ``copied=False`` (the
        step's shared work failed) the blocks offloaded or loaded from disk in it are forgotten:
        their copy may not have happened."""
        if self._out or self._in or self._loads:
            raise RuntimeError("finish_step: this step's tier copies were never taken (take_tier_copies)")
        held, self.held = self.held, []
        offloaded, self._offloaded_now = self._offloaded_now, []
        if not copied:
            cached = self.pool.cached
            for block in offloaded:
                if block.block_hash is not None and cached.get(block.block_hash) is block:
                    del cached[block.block_hash]
                    block.block_hash = None
        self.pool.free(held)
