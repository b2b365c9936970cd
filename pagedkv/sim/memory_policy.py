"""What the simulator asks of a KV memory policy, and the sequence record they share.

A policy owns ``capacity`` token slots of KV memory and decides how sequences take them. The
simulator drives every policy through the same five calls, in the same order, on the same trace:

    admit(request, seqs)     all-or-nothing: room for every sequence's tokens so far (a new
                             request's prompt, or a preempted one's prompt + generated tokens)
    grow(seq)                room for the token just appended to ``seq.tokens`` (a decode step)
    replace(loser, winner, new)   beam search: drop ``loser``, ``new`` continues ``winner``
    release(seqs)            the request finished or was preempted: free everything it holds
    usage()                  slots allocated and slots holding a token, for the waste metrics

Tenants (paged memory only; the others ignore them): a sequence's ``tenant`` salts its prefix-cache
keys and is charged for its blocks. With KV quotas, ``admit`` and ``grow`` raise ``TenantQuotaError``
(changing nothing) when the tenant is at its quota, where a plain shortage returns False, and
``quota_status``, ``fits`` and ``within_quota`` let the simulator preempt over-quota work for a
waiting tenant, as the engine's scheduler does.

Slot accounting terms used by every policy (see docs/sizing.md):

    allocated  slots held by running sequences (reserved or in blocks)
    filled     allocated slots holding a token's KV (shared blocks count once)
    never      allocated slots no token of the owning sequence will ever fill (rounding,
               over-reservation): the part of the waste that is internal fragmentation
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from pagedkv.sim.workload import Request


@dataclass(slots=True)
class SimSeq:
    """One running sequence: its id, its tokens so far (prompt + generated), the stream its next
    generated tokens come from, the length it will reach when done, and its request's tenant."""

    seq_id: int
    tokens: list[int]
    stream: int
    final_len: int
    tenant: str | None = None


class MemoryUsage(NamedTuple):
    allocated_slots: int
    filled_slots: int
    never_filled_slots: int


class MemoryPolicy(Protocol):
    """A KV memory policy under simulation (see the module docstring for the call order).

    ``grow`` and ``admit`` return False, changing nothing they did not undo, when memory is short;
    ``replace`` returns False after freeing ``loser`` when ``new`` does not fit (the simulator then
    preempts the request). ``release`` ignores sequences the policy does not hold.
    """

    name: str
    block_size: int | None
    capacity: int
    last_hit_tokens: int  # prompt tokens the last successful ``admit`` found in the prefix cache

    def admit(self, request: Request, seqs: list[SimSeq]) -> bool: ...

    def grow(self, seq: SimSeq) -> bool: ...

    def replace(self, loser: SimSeq, winner: SimSeq, new: SimSeq) -> bool: ...

    def release(self, seqs: list[SimSeq]) -> None: ...

    def usage(self) -> MemoryUsage: ...

    def unusable_free_slots(self, request: Request) -> int:
        """Free slots that cannot hold any part of ``request`` (external fragmentation)."""
        ...

    def counters(self) -> dict[str, int]:
        """Policy-specific totals: prefix_query_tokens, prefix_hit_tokens, evictions, cow_copies."""
        ...

    def quota_status(self, tenant: str | None) -> int | None:
        """With KV quotas: -1 under its quota, 0 at it, 1 over it, None without a quota for it (or
        without quotas, or tenants, at all)."""
        ...

    def fits(self, request: Request, seqs: list[SimSeq]) -> bool:
        """Whether ``admit`` would find room now (a quota aside). Changes nothing."""
        ...

    def within_quota(self, request: Request, seqs: list[SimSeq]) -> bool:
        """With a KV quota for the request's tenant: whether the tenant's blocks in use plus those
        ``admit`` would take (or more) stay within it. False without a quota. Changes nothing."""
        ...

    def check_integrity(self) -> None:
        """Raise (``IntegrityError``/``AssertionError``) if the bookkeeping is inconsistent."""
        ...
