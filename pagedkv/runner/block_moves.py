"""A step's block moves on the runner, in the order the plan needs them, timed.

The memory core decides what moves between the KV tiers (``SchedulerOutput``: ``to_disk``,
``from_disk``, ``swap_out``, ``swap_in``, ``copies``); this makes the copies on the runner's
tensors and measures them. The engine hands the payloads to the disk tier and the timings to the
memory core's costs (``engine/kv_tiers.py``): this module imports nothing from either.

    to_disk    device block -> payload bytes  first: before anything in the step reuses the block
    from_disk  payload read from disk -> host block
    swap_out   device -> host (swap-outs and the host tier's offloads)    timed
    swap_in    host -> device (swap-ins and the host tier's reloads)      timed
    copies     copy-on-write, device -> device
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.runner.protocol import Runner


@dataclass(frozen=True, slots=True)
class BlockMoves:
    """What a step's block moves produced: the serialized blocks and the copies' seconds."""

    payloads: list[bytes]  # of the ``to_disk`` device blocks, in order
    swap_out_s: float  # seconds of the device -> host copies (0.0 without any)
    swap_in_s: float  # seconds of the host -> device copies


def move_blocks(runner: Runner, to_disk: Sequence[int], from_disk: Sequence[tuple[int, bytes]],
                swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]],
                copies: Sequence[tuple[int, int]]) -> BlockMoves:
    """Make one step's block copies, in the order of the module docstring."""
    payloads = runner.block_payloads(to_disk) if to_disk else []
    if from_disk:
        runner.load_host_blocks(from_disk)
    out_s = in_s = 0.0
    if swap_out:
        start = time.perf_counter()
        runner.swap_out(swap_out)
        out_s = time.perf_counter() - start
    if swap_in:
        start = time.perf_counter()
        runner.swap_in(swap_in)
        in_s = time.perf_counter() - start
    if copies:
        runner.copy_blocks(copies)
    return BlockMoves(payloads, out_s, in_s)
