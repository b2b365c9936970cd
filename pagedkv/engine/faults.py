"""Seeded fault injection for chaos testing the scheduler and the memory core.

Spec (engine option ``fault_injection`` or env ``PAGEDKV_FAULT_INJECTION``)::

    seed=7,rate=0.05[,kinds=recompute+swap+evict+alloc]

At each step, with probability ``rate``, one fault of a kind drawn uniformly fires:

- ``recompute``: preempt a random running request by recompute;
- ``swap``: preempt a random running request by swap (recompute when no host blocks are left);
- ``evict``: evict every cached-free block from the prefix cache;
- ``alloc``: the step's first block allocation fails as if the pool were full.

Tier faults (only when named in ``kinds``; they need a disk tier) fire in the disk tier's worker,
each block read or write drawing with probability ``rate`` from its own seeded stream:

- ``disk_read``: the read fails with an I/O error (a miss: the tokens are recomputed);
- ``disk_corrupt``: a byte of the block file is flipped before it is read (its checksum fails:
  the file is discarded and the tokens recomputed);
- ``disk_slow``: the read or write takes 50 ms longer;
- ``disk_full``: the write fails with ENOSPC (the tier stops writing and goes on serving reads).

Every request must still finish with the output it would have had undisturbed. The faults
depend only on the seed and the step count, so a failing run can be replayed exactly.

Injection wraps the seams instead of branching inside them: :class:`FaultInjectingScheduler` is a
Scheduler whose step begins with the draw, and whose view of the memory core
(:class:`FailingAllocations`) refuses the step's first allocation when ``alloc`` fired. The
scheduler and the memory core themselves hold no fault-injection code.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import time
from dataclasses import dataclass
from typing import Any

from pagedkv.engine.scheduler import Scheduler, SchedulerConfig
from pagedkv.engine.step_cost import StepCostModel
from pagedkv.memory import CopyPair, KVCacheManager, OutOfBlocksError

ENGINE_FAULT_KINDS = ("recompute", "swap", "evict", "alloc")
TIER_FAULT_KINDS = ("disk_read", "disk_corrupt", "disk_slow", "disk_full")
FAULT_KINDS = ENGINE_FAULT_KINDS + TIER_FAULT_KINDS
SLOW_DISK_S = 0.05


@dataclass(frozen=True, slots=True)
class FaultSpec:
    seed: int = 0
    rate: float = 0.05
    kinds: tuple[str, ...] = ENGINE_FAULT_KINDS

    @classmethod
    def parse(cls, spec: str) -> FaultSpec:
        """Parse ``seed=7,rate=0.05[,kinds=a+b]``; raise ValueError naming the bad part."""
        fields: dict = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"fault_injection: expected key=value, got {part!r}")
            key = key.strip()
            try:
                if key == "seed":
                    fields["seed"] = int(value)
                elif key == "rate":
                    fields["rate"] = float(value)
                elif key == "kinds":
                    fields["kinds"] = tuple(k for k in value.split("+") if k)
                else:
                    raise ValueError(f"fault_injection: unknown key {key!r} (seed, rate, kinds)")
            except ValueError as e:
                if "fault_injection" in str(e):
                    raise
                raise ValueError(f"fault_injection: bad value for {key}: {value!r}") from None
        out = cls(**fields)
        if not 0.0 <= out.rate <= 1.0:
            raise ValueError(f"fault_injection: rate must be in [0, 1], got {out.rate}")
        bad = [k for k in out.kinds if k not in FAULT_KINDS]
        if bad or not out.kinds:
            raise ValueError(f"fault_injection: kinds must be among {FAULT_KINDS}, got {out.kinds}")
        return out


class FaultInjector:
    def __init__(self, spec: FaultSpec) -> None:
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.fired: dict[str, int] = {k: 0 for k in FAULT_KINDS}

    def draw(self) -> str | None:
        """The fault for this step, or None (tier faults are drawn by :func:`install_disk_faults`)."""
        kinds = [k for k in self.spec.kinds if k in ENGINE_FAULT_KINDS]
        if not kinds or self.rng.random() >= self.spec.rate:
            return None
        kind = self.rng.choice(kinds)
        self.fired[kind] += 1
        return kind

    def pick(self, n: int) -> int:
        return self.rng.randrange(n)


class FailingAllocations:
    """The memory core as the scheduler sees it, except that once armed, the next allocation
    (``allocate_prompt``, ``allocate_slots`` or ``swap_in``) raises OutOfBlocksError, changing
    nothing, as a full pool would. Everything else goes straight to the real manager."""

    def __init__(self, kv: KVCacheManager) -> None:
        self._kv = kv
        self.armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._kv

    def _fail_if_armed(self) -> None:
        if self.armed:
            self.armed = False
            raise OutOfBlocksError(1, 0)

    def allocate_prompt(self, *args: Any, **kwargs: Any) -> int:
        self._fail_if_armed()
        return self._kv.allocate_prompt(*args, **kwargs)

    def allocate_slots(self, *args: Any, **kwargs: Any) -> list[CopyPair]:
        self._fail_if_armed()
        return self._kv.allocate_slots(*args, **kwargs)

    def swap_in(self, *args: Any, **kwargs: Any) -> list[CopyPair]:
        self._fail_if_armed()
        return self._kv.swap_in(*args, **kwargs)


class FaultInjectingScheduler(Scheduler):
    """A Scheduler that draws one fault per step (see the module docstring) before planning it."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, faults: FaultInjector,
                 costs: StepCostModel | None = None) -> None:
        self.allocations = FailingAllocations(kv)
        # FailingAllocations stands in for the manager (it forwards every other attribute to it)
        super().__init__(config, self.allocations, costs)  # type: ignore[arg-type]
        self.faults = faults

    def _begin_step(self, swap_out: list[CopyPair], preempted: list[str]) -> None:
        self.allocations.armed = False
        kind = self.faults.draw()
        if kind == "evict":
            self.kv.evict_cached()
        elif kind == "alloc":
            self.allocations.armed = True
        elif kind in ("recompute", "swap") and self.running:
            victim = self.running[self.faults.pick(len(self.running))]
            self._preempt(victim, kind, swap_out, preempted)


def install_disk_faults(disk: Any, injector: FaultInjector) -> None:
    """Make a :class:`~pagedkv.memory.tiers.disk_store.DiskStore`'s reads and writes fail as the spec's
    tier kinds say (see the module docstring), by wrapping the instance's ``get`` and its file
    write; the tier's own error handling then runs as it would for a real fault."""
    spec = injector.spec
    kinds = [k for k in spec.kinds if k in TIER_FAULT_KINDS]
    if not kinds:
        return
    rng = random.Random(spec.seed * 7919 + 1)  # the worker thread's own stream
    fired = injector.fired

    def draw(allowed: tuple[str, ...]) -> str | None:
        options = [k for k in kinds if k in allowed]
        if not options or rng.random() >= spec.rate:
            return None
        kind = rng.choice(options)
        fired[kind] += 1
        return kind

    real_get, real_write = disk.get, disk._write_block

    def get(key: bytes) -> bytes | None:
        kind = draw(("disk_read", "disk_corrupt", "disk_slow"))
        if kind == "disk_read":
            raise OSError(errno.EIO, "injected read error")
        if kind == "disk_corrupt":
            path = disk._block_path(key)
            with contextlib.suppress(OSError), open(path, "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 0x5A]))
        elif kind == "disk_slow":
            time.sleep(SLOW_DISK_S)
        return real_get(key)

    def write_block(key: bytes, payload: bytes) -> None:
        kind = draw(("disk_full", "disk_slow"))
        if kind == "disk_full":
            raise OSError(errno.ENOSPC, "injected: no space left on device")
        if kind == "disk_slow":
            time.sleep(SLOW_DISK_S)
        real_write(key, payload)

    disk.get = get
    disk._write_block = write_block
