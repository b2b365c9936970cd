"""``TPGroup``: one rank's view of a tensor-parallel group, and the rules that split a model over it.

A tensor-parallel model (Megatron's split, as vLLM runs it) holds 1/N of every layer on each of N
ranks: q/k/v and gate/up are *column-parallel* (each rank computes its heads' / its slice of the
intermediate rows), o and down are *row-parallel* (each rank multiplies its slice of the inputs and
one ``all_reduce`` sums the partial results). The vocabulary is split by rows: the embedding is a
masked lookup of the rank's rows + ``all_reduce``, the LM head gives the rank's logits and one
``all_gather`` puts the whole vocabulary on every rank. KV heads are divided among the ranks; with
fewer KV heads than ranks each KV head is replicated on ``size / kv_heads`` ranks (rank ``r`` holds
the KV head its query heads use).

This module is the only place that knows those rules (:func:`shard_range`, :func:`kv_head_range`,
:func:`check_shardable`); the models and the loader ask it. It imports torch and the facts only, so
every unit above it (models, runner, the launcher) may use it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pagedkv.errors import PagedKVError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from pagedkv.distributed.shm import ShmAllReduce


class ShardingError(PagedKVError, ValueError):
    """A model shape that cannot be split over the asked number of ranks (the message names the
    dimension and the sizes that would work)."""


@dataclass(slots=True)
class CollectiveStats:
    """Calls and seconds spent in the model's collectives in this process (``COLLECTIVES``): the
    benchmark's split of a step's time into compute and communication. Cheap: two clock reads a call."""

    calls: int = 0
    seconds: float = 0.0

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0


COLLECTIVES = CollectiveStats()


@dataclass(frozen=True)
class TPGroup:
    """Rank ``rank`` of a tensor-parallel group of ``size`` ranks over ``group`` (None:
    torch.distributed's default group, which the launcher has initialized). ``size == 1`` needs no
    process group at all: every collective is then a no-op. ``shm``: CPU ranks on one host sum
    through shared memory (``distributed/shm.py``) what fits a slot, the rest through ``group``."""

    rank: int
    size: int
    group: ProcessGroup | None = None
    shm: ShmAllReduce | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TPGroup needs 0 <= rank < size, got rank {self.rank} of {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        if self.size > 1:
            start = time.perf_counter()
            if self.shm is not None and self.shm.takes(x):
                self.shm.all_reduce(x)
            else:
                torch.distributed.all_reduce(x, group=self.group)
            COLLECTIVES.calls += 1
            COLLECTIVES.seconds += time.perf_counter() - start
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` (same shape on each) concatenated along ``dim`` in rank order."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x, group=self.group)
        out = torch.cat(parts, dim=dim)
        COLLECTIVES.calls += 1
        COLLECTIVES.seconds += time.perf_counter() - start
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``src``'s ``x`` on every rank, in place; returns ``x``."""
        if self.size > 1:
            torch.distributed.broadcast(x, src=src, group=self.group)
        return x

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """``src``'s picklable ``obj`` on every rank (the others pass anything, e.g. None)."""
        if self.size == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.size > 1:
            torch.distributed.barrier(group=self.group)

    # -- the split of a dimension -----------------------------------------------------------

    def shard(self, n: int) -> tuple[int, int]:
        """This rank's ``[start, end)`` of ``n`` items split evenly (``n`` divisible by ``size``)."""
        return shard_range(n, self.rank, self.size)

    def kv_heads(self, kv_heads: int) -> tuple[int, int]:
        """This rank's ``[start, end)`` of ``kv_heads`` KV heads (one replicated head when fewer
        than ranks): :func:`kv_head_range`."""
        return kv_head_range(kv_heads, self.rank, self.size)

    def vocab(self, vocab: int) -> tuple[int, int]:
        """This rank's rows of a vocabulary of ``vocab`` split by rows: :func:`vocab_range`."""
        return vocab_range(vocab, self.rank, self.size)


SINGLE = TPGroup(0, 1)  # the one-process "group": every collective a no-op


def shard_range(n: int, rank: int, size: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank`` when ``n`` items split evenly over ``size`` ranks.
    Raises ShardingError when ``size`` does not divide ``n``."""
    if n % size:
        raise ShardingError(f"{n} items do not split evenly over {size} ranks")
    per = n // size
    return rank * per, (rank + 1) * per


def kv_head_range(kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """The KV heads rank ``rank`` of ``size`` holds: ``kv_heads / size`` of them when ``size``
    divides ``kv_heads``; with fewer heads than ranks (``size`` a multiple of ``kv_heads``) the one
    head its query heads use, ``rank * kv_heads // size`` (vLLM's replication)."""
    if kv_heads >= size:
        return shard_range(kv_heads, rank, size)
    if size % kv_heads:
        raise ShardingError(f"{kv_heads} KV heads cannot be replicated over {size} ranks")
    head = rank * kv_heads // size
    return head, head + 1


def padded_vocab(vocab: int, size: int) -> int:
    """The vocabulary rounded up to a multiple of ``size``: each rank holds ``padded / size`` rows
    (the last rank's tail rows are zero and their logits dropped after the gather)."""
    return -(-vocab // size) * size


def vocab_range(vocab: int, rank: int, size: int) -> tuple[int, int]:
    """Rank ``rank``'s real rows ``[start, end)`` of a vocabulary split by rows (``end - start`` may
    be short of ``padded_vocab(vocab, size) / size`` on the last ranks, even 0)."""
    per = padded_vocab(vocab, size) // size
    return min(vocab, rank * per), min(vocab, (rank + 1) * per)


def _divisors_up_to(values: list[int], limit: int) -> list[int]:
    return [n for n in range(1, limit + 1) if all(v % n == 0 for v in values)]


def check_shardable(size: int, *, heads: int, kv_heads: int, intermediate: int,
                    moe_intermediate: int = 0, shared_intermediate: int = 0, is_mla: bool = False,
                    what: str = "the model") -> None:
    """Raise ShardingError naming the first dimension of ``what`` that ``size`` ranks cannot split
    and the sizes that would work. Query heads and the (shared) expert intermediate sizes must be
    divisible by ``size``; KV heads divisible by ``size`` or dividing it (replicated); an MLA
    model's latent is replicated whatever the size."""
    if size < 1:
        raise ShardingError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    dims = [("num_attention_heads", heads), ("intermediate_size", intermediate),
            ("moe_intermediate_size", moe_intermediate), ("shared expert intermediate size", shared_intermediate)]
    dims = [(name, n) for name, n in dims if n]
    kv_ok = is_mla or kv_heads % size == 0 or size % kv_heads == 0
    bad = [(name, n) for name, n in dims if n % size]
    if not bad and kv_ok:
        return
    name, n = bad[0] if bad else ("num_key_value_heads", kv_heads)
    values = [v for _, v in dims]
    limit = max(values) if values else size
    fits = [k for k in _divisors_up_to(values, limit)
            if is_mla or kv_heads % k == 0 or k % kv_heads == 0]
    raise ShardingError(
        f"tensor_parallel_size {size} cannot split {what}: {name} = {n} is not divisible by {size}"
        + (" (and KV heads are replicated only when the ranks are a multiple of them)"
           if name == "num_key_value_heads" else "")
        + f"; sizes that would work: {', '.join(map(str, fits[:12]))}"
    )
