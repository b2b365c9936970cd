"""TPRunner: one engine's ``Runner`` over N tensor-parallel ranks, each with its own ModelRunner.

Rank 0 runs the scheduler and the memory core; the engine calls this runner as it calls a
ModelRunner. Every call becomes one *step plan* sent from rank 0 to every rank (one broadcast of
pickled bytes per call, the plan's block tables, slot mappings, copies, swaps and tier loads
inside), which each rank applies to its own ModelRunner: block ids mean the same on every rank,
each rank holding its KV heads' part of every block.

    engine ── runner.execute(chunks) ──> TPRunner (rank 0)
                                           │ broadcast plan ("execute", chunks)
                                           ├──> rank 1..N-1: serve_plans -> ModelRunner.execute
                                           └──> rank 0's ModelRunner.execute ──> logits (the model
                                                gathers the vocabulary; all-reduces inside)

    block_payloads      each rank's shard gathered to rank 0, concatenated in rank order: one
                        payload, written and checksummed as one by the disk tier
    load_host_blocks    each rank's slice of every payload scattered back to it

Sizes: ``bytes_per_block`` is a rank's (what its device pool spends per block), ``payload_bytes``
the whole block (every rank's shard), ``config`` the FULL model's (vocabulary, shape), given by the
builder (``engine/tp_build.py``).

Failure: a rank that dies (``RankWatch``'s sentinel), a collective that fails or times out, or
an error on rank 0 after a plan was sent (the ranks would no longer agree) ends this runner for
good: this call and every later one raise RankFailedError naming the rank. Idle for a while, rank
0 sends a heartbeat plan (a broadcast and a barrier), so a hung rank is found between steps too
and a waiting worker never mistakes a quiet engine for a dead one.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pagedkv.distributed.group import TPGroup
from pagedkv.distributed.launch import RankFailedError, RankWatch, collective_timeout
from pagedkv.runner.step_inputs import BatchError

if TYPE_CHECKING:
    from pagedkv.lora.adapter import LoRAWeights
    from pagedkv.lora.layers import LoRAStack
    from pagedkv.model_shape import KVGroup
    from pagedkv.models.config import ModelConfig
    from pagedkv.ops.kv_format import KVFormat
    from pagedkv.runner.batch import SeqChunk
    from pagedkv.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

PLAN_BYTES = 1 << 16  # the plan buffer: a larger plan takes a second broadcast of its tail
_HEADER = 8  # the plan's length, little-endian, at the buffer's start

# what a rank may raise from a plan and go on: bad input refused before any collective (every rank
# refuses the same plan alike)
_REFUSALS = (BatchError,)


class PlanStats:
    """Where rank 0's time goes (cheap counters, read by bench/throughput.py): seconds and calls of
    plan broadcasts, of the rank's own work after the plan (compute, and the all-reduces inside
    it), and of gathers/scatters of block payloads."""

    __slots__ = ("plan_s", "plans", "apply_s", "gather_s")

    def __init__(self) -> None:
        self.plan_s = 0.0
        self.plans = 0
        self.apply_s = 0.0
        self.gather_s = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"plan_broadcast_s": self.plan_s, "plans": float(self.plans), "rank0_apply_s": self.apply_s,
                "payload_gather_s": self.gather_s}


def _send_plan(plan: tuple[Any, ...], group: Any) -> None:
    """Rank 0: broadcast ``plan`` (pickled) to every rank: one broadcast, two past PLAN_BYTES."""
    data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
    buf = torch.zeros(PLAN_BYTES, dtype=torch.uint8)
    buf[:_HEADER] = torch.tensor(list(len(data).to_bytes(_HEADER, "little")), dtype=torch.uint8)
    head = data[:PLAN_BYTES - _HEADER]
    buf[_HEADER:_HEADER + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    torch.distributed.broadcast(buf, src=0, group=group)
    if len(data) > len(head):
        tail = torch.frombuffer(bytearray(data[len(head):]), dtype=torch.uint8)
        torch.distributed.broadcast(tail, src=0, group=group)


def _receive_plan(group: Any) -> tuple[Any, ...]:
    """Ranks > 0: the next plan rank 0 sends (see :func:`_send_plan`)."""
    buf = torch.empty(PLAN_BYTES, dtype=torch.uint8)
    torch.distributed.broadcast(buf, src=0, group=group)
    raw = buf.numpy().tobytes()
    size = int.from_bytes(raw[:_HEADER], "little")
    data = raw[_HEADER:_HEADER + min(size, PLAN_BYTES - _HEADER)]
    if size > len(data):
        tail = torch.empty(size - len(data), dtype=torch.uint8)
        torch.distributed.broadcast(tail, src=0, group=group)
        data += tail.numpy().tobytes()
    plan: tuple[Any, ...] = pickle.loads(data)
    return plan


def _slices(payload: bytes, sizes: Sequence[int]) -> list[bytes]:
    """A whole block's payload cut into the ranks' shards (``sizes``: each rank's payload bytes)."""
    out, at = [], 0
    for n in sizes:
        out.append(payload[at:at + n])
        at += n
    return out


def apply_plan(runner: ModelRunner, plan: tuple[Any, ...], group: Any, rank: int, size: int,
               payload_sizes: Sequence[int]) -> Any:
    """Apply one plan to this rank (``rank`` of ``size``, its ``runner``); the result rank 0
    returns (the others' part travels by the plan's collective). ``payload_sizes``: every rank's
    payload bytes of one block."""
    op, args = plan[0], plan[1:]
    if op == "execute":
        return runner.execute(*args)
    if op in ("copy_blocks", "swap_out", "swap_in", "set_context_length"):
        return getattr(runner, op)(*args)
    if op == "set_lora_slot":
        return runner.set_lora_slot(*args)
    if op in ("block_payloads", "host_block_payloads"):
        mine = getattr(runner, op)(*args)
        parts: list[Any] | None = [None] * size if rank == 0 else None
        torch.distributed.gather_object(mine, parts, dst=0, group=group)
        if rank != 0:
            return None
        assert parts is not None
        return [b"".join(shards) for shards in zip(*parts)]
    if op == "load_host_blocks":
        (pairs,) = args  # rank 0: [(host block, whole payload)]; the others: None, scattered below
        box: list[Any] = [None]
        shards = None
        if rank == 0:
            cut = [_slices(payload, payload_sizes) for _, payload in pairs]
            shards = [[(b, parts[r]) for (b, _), parts in zip(pairs, cut)] for r in range(size)]
        torch.distributed.scatter_object_list(box, shards, src=0, group=group)
        return runner.load_host_blocks(box[0])
    if op == "facts":  # every rank's own payload size and weight bytes, gathered to rank 0
        mine = (runner.payload_bytes, runner.weight_bytes)
        facts: list[Any] | None = [None] * size if rank == 0 else None
        torch.distributed.gather_object(mine, facts, dst=0, group=group)
        return facts
    if op == "kv_quant_error":  # every rank's error sums added: the whole model's error
        sums = runner.write_error.clone() if runner.write_error is not None else torch.zeros(0, dtype=torch.float64)
        torch.distributed.all_reduce(sums, group=group)
        return sums
    if op == "ping":
        torch.distributed.barrier(group=group)
        return None
    raise ValueError(f"unknown step plan {op!r}")


def serve_plans(runner: ModelRunner, group: Any, rank: int, size: int) -> None:
    """A worker rank's loop: apply every plan rank 0 sends to ``runner`` until the "stop" plan.
    A plan it refuses (bad input, refused alike by rank 0) is skipped; any other error ends the
    process (rank 0 sees the rank die and names it)."""
    payload_sizes = [0] * size  # learnt from rank 0's "sizes" plan, before any load
    while True:
        plan = _receive_plan(group)
        if plan[0] == "stop":
            return
        if plan[0] == "sizes":
            payload_sizes = list(plan[1])
            continue
        try:
            apply_plan(runner, plan, group, rank, size, payload_sizes)
        except _REFUSALS:
            continue


class TPRunner:
    """The engine's ``Runner`` (runner/protocol.py) over N tensor-parallel ranks: rank 0's own
    ModelRunner (``local``, its shard) and ranks 1..N-1 reached by step plans on ``plan_group``.
    ``full_config``: the whole model's config (the engine's view); ``watch``: the spawned workers'
    RankWatch (None under torchrun); ``shutdown``: called once by :meth:`close` after the "stop" plan
    (joins or kills the workers)."""

    def __init__(self, local: ModelRunner, group: TPGroup, full_config: ModelConfig, *, plan_group: Any = None,
                 watch: RankWatch | None = None, shutdown: Callable[[], None] | None = None,
                 heartbeat_s: float | None = None) -> None:
        self.local = local
        self.group = group
        self.size = group.size
        self.config: ModelConfig = full_config
        self.lora: LoRAStack | None = local.lora
        self.write_error = local.write_error  # rank 0's heads (the guard's sample); kv_quant_error sums all ranks
        self.plan_group = plan_group
        self.watch = watch or RankWatch([])
        self.stats = PlanStats()
        self._shutdown = shutdown
        self._lock = threading.Lock()
        self._closed = False
        self._failure: str | None = None
        self._last_call = time.monotonic()
        self._payload_sizes: list[int] = [0] * self.size  # (the "facts" plan gathers them)
        facts = self._call(("facts",))
        self.rank_payload_bytes: list[int] = [int(p) for p, _ in facts]
        self.rank_weight_bytes: list[int] = [int(w) for _, w in facts]
        self._call(("sizes", self.rank_payload_bytes))
        self._payload_sizes = self.rank_payload_bytes
        self.watch.on_failure(self._on_rank_failure)
        self._heartbeat_s = heartbeat_s if heartbeat_s is not None else max(0.5, collective_timeout() / 4)
        self._beat = threading.Thread(target=self._heartbeat, name="pagedkv-tp-heartbeat", daemon=True)
        self._beat.start()

    # -- the plan ------------------------------------------------------------------------------

    def _on_rank_failure(self, message: str) -> None:
        self._failure = self._failure or message

    def _call(self, plan: tuple[Any, ...]) -> Any:
        """Send ``plan`` to every rank and apply it here; RankFailedError when a rank is gone."""
        with self._lock:
            if self._failure is not None:
                raise RankFailedError(self._failure)
            if self._closed:
                raise RankFailedError("the tensor-parallel runner is closed (its worker ranks have stopped)")
            start = time.perf_counter()
            try:
                _send_plan(plan, self.plan_group)
                sent = time.perf_counter()
                self.stats.plan_s += sent - start
                self.stats.plans += 1
                if plan[0] == "sizes":
                    return None
                result = apply_plan(self.local, plan, self.plan_group, 0, self.size, self._payload_sizes)
                self.stats.apply_s += time.perf_counter() - sent
                return result
            except _REFUSALS:
                raise  # every rank refused the same plan before any collective: still in step
            except Exception as exc:  # a collective failed, or rank 0 failed mid-plan: the ranks disagree
                dead = self.watch.dead_rank(wait_s=1.0)
                why = dead or (f"tensor-parallel step plan {plan[0]!r} failed on rank 0 or a rank stopped "
                               f"answering (collective timeout {collective_timeout():.0f} s, "
                               f"PAGEDKV_TP_TIMEOUT_S): {exc}")
                self._failure = self._failure or why
                self.watch.fail(why)
                raise RankFailedError(why) from exc
            finally:
                self._last_call = time.monotonic()

    def _heartbeat(self) -> None:
        """Idle: a "ping" plan every ``heartbeat_s`` (a hung rank is found; the workers' wait for a
        plan never reaches the collective timeout)."""
        while True:
            time.sleep(self._heartbeat_s / 2)
            if self._closed or self._failure is not None:
                return
            if time.monotonic() - self._last_call >= self._heartbeat_s and not self._lock.locked():
                try:
                    self._call(("ping",))
                except RankFailedError:
                    return

    def close(self) -> None:
        """Stop the worker ranks (the "stop" plan) and let ``shutdown`` join them. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._failure is None:
                try:
                    _send_plan(("stop",), self.plan_group)
                except Exception:  # noqa: BLE001 - a rank already gone: shutdown kills the rest
                    logger.warning("tensor parallelism: the stop plan did not reach every rank")
        if self._shutdown is not None:
            self._shutdown()

    # -- the Runner protocol ---------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.local.block_size

    @property
    def num_blocks(self) -> int:
        return self.local.num_blocks

    @property
    def num_host_blocks(self) -> int:
        return self.local.num_host_blocks

    @property
    def kv_format(self) -> KVFormat:
        return self.local.kv_format

    @property
    def bytes_per_block(self) -> int:
        """One rank's bytes per block (its device pool's cost of a block)."""
        return self.local.bytes_per_block

    @property
    def kv_full_blocks(self) -> int:
        return self.local.kv_full_blocks

    @property
    def kv_quant_parts(self) -> str:
        return self.local.kv_quant_parts

    @property
    def kv_groups(self) -> tuple[KVGroup, ...]:
        return self.local.kv_groups

    @property
    def payload_bytes(self) -> int:
        """A whole block's payload: every rank's shard."""
        return sum(self.rank_payload_bytes)

    @property
    def model_dtype(self) -> str:
        return self.local.model_dtype

    @property
    def weight_bytes(self) -> int:
        """The weights of every rank together."""
        return sum(self.rank_weight_bytes)

    @property
    def weights_quantization(self) -> str | None:
        return self.local.weights_quantization

    def set_context_length(self, context: int) -> None:
        self._call(("set_context_length", context))

    def execute(self, chunks: Sequence[SeqChunk], return_all_logits: bool = False) -> torch.Tensor:
        logits: torch.Tensor = self._call(("execute", list(chunks), return_all_logits))
        return logits

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        self._call(("copy_blocks", list(pairs)))

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        self._call(("swap_out", list(pairs)))

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        self._call(("swap_in", list(pairs)))

    def block_payloads(self, block_ids: Sequence[int]) -> list[bytes]:
        return self._gathered("block_payloads", block_ids)

    def host_block_payloads(self, block_ids: Sequence[int]) -> list[bytes]:
        return self._gathered("host_block_payloads", block_ids)

    def _gathered(self, op: str, block_ids: Sequence[int]) -> list[bytes]:
        start = time.perf_counter()
        out: list[bytes] = self._call((op, list(block_ids)))
        self.stats.gather_s += time.perf_counter() - start
        return out

    def load_host_blocks(self, pairs: Sequence[tuple[int, bytes]]) -> None:
        whole = self.payload_bytes
        for block, payload in pairs:
            if len(payload) != whole:
                raise BatchError(f"load_host_blocks: host block {block}'s payload has {len(payload)} bytes, a "
                                 f"block of this cache {whole} (every rank's shard)")
        start = time.perf_counter()
        self._call(("load_host_blocks", list(pairs)))
        self.stats.gather_s += time.perf_counter() - start

    def kv_quant_error(self) -> list[tuple[float, float]] | None:
        """Relative RMS error (K, V) per layer over every rank's heads, or None."""
        if self.write_error is None:
            return None
        sums: torch.Tensor = self._call(("kv_quant_error",))

        def rel(err: float, ref: float) -> float:
            return (err / ref) ** 0.5 if ref > 0 else 0.0

        return [(rel(*k), rel(*v)) for k, v in sums.tolist()]

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """``callback(message)`` once when a rank dies or stops answering (at once if one has)."""
        self.watch.on_failure(callback)

    def set_lora_slot(self, slot: int, weights: LoRAWeights | None) -> None:
        if self.lora is None:
            raise ValueError("this runner has no LoRA slots (build it with max_loras > 0)")
        self._call(("set_lora_slot", slot, weights))
