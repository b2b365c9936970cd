"""Seeded fault injection for chaos testing the scheduler and the memory core.

Spec (engine option ``fault_injection`` or env ``PAGEDKV_FAULT_INJECTION``)::

    seed=7,rate=0.05[,kinds=recompute+swap+evict+alloc]

At each step, with probability ``rate``, one fault of a kind drawn uniformly fires:

- ``recompute``: preempt a random running request by recompute;
- ``swap``: preempt a random running request by swap (recompute when no host blocks are left);
- ``evict``: evict every cached-free block from the prefix cache;
- ``alloc``: the step's first block allocation fails as if the pool were full.

Every request must still finish with the output it would have had undisturbed. The faults
depend only on the seed and the step count, so a failing run can be replayed exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FAULT_KINDS = ("recompute", "swap", "evict", "alloc")


@dataclass(frozen=True, slots=True)
class FaultSpec:
    seed: int = 0
    rate: float = 0.05
    kinds: tuple[str, ...] = FAULT_KINDS

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
        """The fault for this step, or None."""
        if self.rng.random() >= self.spec.rate:
            return None
        kind = self.rng.choice(self.spec.kinds)
        self.fired[kind] += 1
        return kind

    def pick(self, n: int) -> int:
        return self.rng.randrange(n)
