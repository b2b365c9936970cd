"""The engine's adapters: which are known by name, which are read into memory, which slot holds which.

    registry   name -> LoRARequest      adapters a request may select by name (the server's
                                         --lora-modules, runtime loads); the Python API's
                                         LoRARequests join it on first use
    idle       name -> LoRAWeights      adapters read and checked, kept (LRU) up to max_cpu_loras;
                                         a request holds its own LoRAWeights, so one in use is
                                         never lost when it leaves this cache
    slots      slot -> LoRAWeights      the runner's max_loras slots; a step's adapters are
                                         copied in before its forward pass (least recently used
                                         slot first), so a step may use at most max_loras

The scheduler keeps each step within ``max_loras`` adapters (``Scheduler._lora_blocked``).
Every method runs on the engine thread.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from pagedkv.lora.adapter import LoRAWeights, load_adapter, weights_stamp
from pagedkv.lora.request import LoRAError, LoRARequest
from pagedkv.lora.stats import LoRAStats


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """One known adapter, as /v1/models lists it."""

    name: str
    int_id: int
    path: str
    rank: int | None  # None until read


class LoRAManager:
    def __init__(self, runner, model_config, *, max_loras: int, max_rank: int, max_cpu_loras: int) -> None:
        self.runner = runner
        self.model_config = model_config
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.registry: dict[str, LoRARequest] = {}
        self.idle: OrderedDict[str, LoRAWeights] = OrderedDict()
        self.slots: list[LoRAWeights | None] = [None] * max_loras
        self._slot_used = [0] * max_loras  # the step that last used each slot (LRU)
        self._steps = 0
        self.requests = Counter[str]()  # requests admitted per adapter name
        self.slot_loads = 0  # adapters copied into a slot

    # ------------------------------------------------------------------ names
    def add(self, request: LoRARequest) -> LoRAWeights:
        """Register (or re-register) an adapter and read it now, so a bad one fails here; raises
        LoRAError. A name already registered with another folder is replaced."""
        weights = self._read(request)
        self.registry[request.lora_name] = request
        return weights

    def remove(self, name: str) -> None:
        """Forget adapter ``name`` (LoRAError 404 if unknown). Requests already running under it
        finish with the weights they hold; its slot is emptied once no step uses it."""
        if name not in self.registry and name not in self.idle:
            raise LoRAError(f"adapter {name!r} is not loaded", status=404)
        self.registry.pop(name, None)
        self.idle.pop(name, None)

    def next_int_id(self) -> int:
        used = {r.lora_int_id for r in self.registry.values()}
        return next(i for i in range(1, len(used) + 2) if i not in used)

    def known(self) -> list[AdapterInfo]:
        """Every registered adapter, by name."""
        out = []
        for name, req in sorted(self.registry.items()):
            w = self.idle.get(name)
            out.append(AdapterInfo(name, req.lora_int_id, req.lora_path, w.rank if w is not None else None))
        return out

    # ------------------------------------------------------------------ requests
    def resolve(self, lora: LoRARequest | str) -> LoRAWeights:
        """The weights a new request runs with: by registered name (LoRAError 404 if unknown) or
        by LoRARequest (read on first use, and again when its folder's weights changed)."""
        if isinstance(lora, str):
            request = self.registry.get(lora)
            if request is None:
                raise LoRAError(f"the model {lora!r} does not exist: no base model or LoRA adapter of that "
                                f"name is loaded", status=404)
        else:
            request = lora
            self.registry.setdefault(request.lora_name, request)
        weights = self._read(request)
        self.requests[request.lora_name] += 1
        return weights

    def _read(self, request: LoRARequest) -> LoRAWeights:
        name = request.lora_name
        cached = self.idle.get(name)
        if cached is not None and cached.path == str(_expand(request.lora_path)) \
                and cached.stamp == weights_stamp(request.lora_path) and cached.int_id == request.lora_int_id:
            self.idle.move_to_end(name)
            return cached
        weights = load_adapter(name, request.lora_int_id, request.lora_path, self.model_config,
                               max_rank=self.max_rank)
        self.idle[name] = weights
        self.idle.move_to_end(name)
        while len(self.idle) > self.max_cpu_loras:
            self.idle.popitem(last=False)
        return weights

    def stats(self, running: Iterable[LoRAWeights | None], waiting: Iterable[LoRAWeights | None]) -> LoRAStats:
        """A snapshot: the adapters of the running and the waiting requests (``None``: base model)."""
        return LoRAStats(self.max_loras, tuple(sorted({w.name for w in running if w is not None})),
                         tuple(sorted({w.name for w in waiting if w is not None})), dict(self.requests),
                         self.slot_loads)

    # ------------------------------------------------------------------ steps
    def assign_slots(self, adapters: Iterable[LoRAWeights]) -> dict[str, int]:
        """Slots for a step's adapters (by ``key``), copying in those not resident; the least
        recently used slots not needed by this step are reused. Raises LoRAError when the step
        has more than ``max_loras`` adapters (the scheduler prevents it)."""
        self._steps += 1
        wanted = {w.key: w for w in adapters}
        if len(wanted) > self.max_loras:
            raise LoRAError(f"a step needs {len(wanted)} adapters, more than max_loras {self.max_loras}")
        where: dict[str, int] = {}
        for slot, held in enumerate(self.slots):
            if held is not None and held.key in wanted:
                where[held.key] = slot
        free = sorted((s for s in range(self.max_loras) if s not in where.values()),
                      key=lambda s: (self.slots[s] is not None, self._slot_used[s]))
        for key, weights in wanted.items():
            if key not in where:
                slot = free.pop(0)
                self.runner.set_lora_slot(slot, weights)
                self.slots[slot] = weights
                self.slot_loads += 1
                where[key] = slot
        for slot in where.values():
            self._slot_used[slot] = self._steps
        return where


def _expand(path: str):
    from pathlib import Path

    return Path(path).expanduser()
