"""Block resizing under simulation: the two alternatives to one fixed block size that
docs/block_size.md measures against ``paged@B``.

    merge@G-L   merge-on-fragmentation (a background defragmenter): sequences take blocks of L
                tokens; whenever the pool's waste (empty slots in allocated blocks / allocated)
                passes ``DEFRAG_THRESHOLD`` (10%) after a step, every sequence whose last L block
                is at most half full has that block split: its tokens are copied into blocks of G
                and the L block is freed. Such a sequence grows in blocks of G; when they hold L
                tokens they are merged (copied) into one L block again, so the kernels keep
                reading L blocks for all but a sequence's last L tokens.
    vtail@G-L   variable-size tail block: full blocks of L, then one tail block of G, 2G, 4G ...
                L slots, the smallest that holds the tail's tokens; a tail that outgrows its
                block is copied into the next size (G -> 2G -> ... -> L, then a new G tail).

Per sequence of n tokens, with ``r = n % L``::

    paged@L      ceil(n / L) * L                                    slots
    merge@G-L    L * (n // L) + (L if the tail is unsplit else G * ceil(r / G))
    vtail@G-L    L * (n // L) + (the smallest G * 2^k >= r, at most L; 0 when r == 0)

These are models, not the memory core (which has one block size): slots are accounted in
granules of G and any free granules can form a block, so external fragmentation, which mixed
block sizes would add, is not modelled; that favours both policies. They hold no prefix cache
and fork nothing (each sample holds its own copy), so compare them with ``paged@B`` without
``+prefix``/``+cow``.

Copies are what these policies pay that a fixed size does not: ``counters()["resize_copies"]``
counts token slots copied, and ``attended_tokens`` the tokens decode attention read (every
context token of every grown sequence, once per step). Copying a token reads and writes its KV,
attention reads it once, and both are memory-bound, so ``2 * copies / attended`` is the copies'
time as a share of decode attention's KV reads (``PolicyResult.copy_cost``): an upper bound on
their share of step time, since a step also reads the weights.
"""

from __future__ import annotations

from pagedkv.memory import IntegrityError
from pagedkv.sim.memory_policy import MemoryUsage, SimSeq
from pagedkv.sim.workload import Request

DEFRAG_THRESHOLD = 0.10  # the standing idea: defragment when fragmentation passes 10%
RESIZE_KINDS = ("merge", "vtail")


class ResizingPolicy:
    """KV memory of ``capacity`` slots in granules of ``small``, with kernel blocks of ``large``
    (``kind``: ``merge`` or ``vtail``; see the module docstring)."""

    def __init__(self, name: str, kind: str, capacity: int, small: int, large: int, *,
                 watermark: float = 0.01) -> None:
        if kind not in RESIZE_KINDS:
            raise ValueError(f"--policies: resizing kind must be one of {', '.join(RESIZE_KINDS)}, got {kind!r}")
        if not (small >= 1 and large % small == 0 and (large // small) & (large // small - 1) == 0):
            raise ValueError(f"--policies: {name}: L must be G times a power of two (e.g. 16-64), "
                             f"got G={small}, L={large}")
        if capacity < large:
            raise ValueError(f"--kv-tokens: capacity {capacity} is below block size {large}")
        self.name = name
        self.kind = kind
        self.block_size: int | None = large
        self.small, self.large = small, large
        self.capacity = capacity // small * small
        self.watermark_slots = int(watermark * self.capacity)
        self.live: dict[int, SimSeq] = {}
        self.held: dict[int, int] = {}      # seq id -> slots it holds
        self.split: set[int] = set()        # merge: sequences whose tail is in G blocks
        self.used = 0
        self.filled = 0                     # tokens the live sequences hold
        self.grows_since_defrag = 0
        self.last_hit_tokens = 0
        self.copies = 0
        self.attended = 0
        self.defrag_runs = 0

    # -- slots a sequence of n tokens holds ---------------------------------------------------

    def _slots(self, seq_id: int, n: int) -> int:
        L, G = self.large, self.small
        full, r = divmod(n, L)
        if self.kind == "vtail":
            return full * L + _tail_block(r, G, L)
        if seq_id in self.split:
            return full * L + -(-r // G) * G
        return -(-n // L) * L

    # -- the simulator's calls ----------------------------------------------------------------

    def admit(self, request: Request, seqs: list[SimSeq]) -> bool:
        need = sum(self._slots(s.seq_id, len(s.tokens)) for s in seqs)
        if self.used + need > self.capacity - self.watermark_slots:
            return False
        for seq in seqs:
            self.live[seq.seq_id] = seq
            self.held[seq.seq_id] = self._slots(seq.seq_id, len(seq.tokens))
            self.filled += len(seq.tokens)
        self.used += need
        self.last_hit_tokens = 0
        return True

    def grow(self, seq: SimSeq) -> bool:
        n = len(seq.tokens)  # the simulator appended the new token
        L = self.large
        old = self.held[seq.seq_id]
        new = self._slots(seq.seq_id, n)
        if self.used + new - old > self.capacity:
            return False
        r_before = (n - 1) % L
        if self.kind == "vtail":
            if new > old and r_before:  # the tail outgrew its block: copy it up
                self.copies += r_before
        elif seq.seq_id in self.split and n % L == 0:  # G blocks hold L tokens: merge them
            self.split.discard(seq.seq_id)
            self.copies += L
            new = self._slots(seq.seq_id, n)
        self.used += new - old
        self.held[seq.seq_id] = new
        self.filled += 1
        self.attended += n
        self.grows_since_defrag += 1
        if self.kind == "merge" and self.grows_since_defrag >= len(self.live):  # about once a step
            self._defragment_if_needed()
        return True

    def replace(self, loser: SimSeq, winner: SimSeq, new: SimSeq) -> bool:
        self.release([loser])
        slots = self._slots(new.seq_id, len(new.tokens))
        if self.used + slots > self.capacity:
            return False
        self.live[new.seq_id] = new
        self.held[new.seq_id] = slots
        self.used += slots
        self.filled += len(new.tokens)
        return True

    def release(self, seqs: list[SimSeq]) -> None:
        for seq in seqs:
            if self.live.pop(seq.seq_id, None) is not None:
                self.used -= self.held.pop(seq.seq_id)
                self.filled -= len(seq.tokens)
                self.split.discard(seq.seq_id)

    def usage(self) -> MemoryUsage:
        filled = self.filled
        never = sum(max(0, min(self.held[i] - len(s.tokens), self.held[i] - s.final_len))
                    for i, s in self.live.items())
        return MemoryUsage(self.used, filled, never)

    def unusable_free_slots(self, request: Request) -> int:
        return 0  # granules are fungible in this model (see the module docstring)

    def counters(self) -> dict[str, int]:
        return {"prefix_query_tokens": 0, "prefix_hit_tokens": 0, "evictions": 0, "cow_copies": 0,
                "resize_copies": self.copies, "attended_tokens": self.attended,
                "defrag_runs": self.defrag_runs}

    def quota_status(self, tenant: str | None) -> int | None:
        return None  # no tenant quotas here (paged policies only)

    def fits(self, request: Request, seqs: list[SimSeq]) -> bool:
        return self._slots(seqs[0].seq_id, len(seqs[0].tokens)) <= self.capacity - self.watermark_slots - self.used

    def within_quota(self, request: Request, seqs: list[SimSeq]) -> bool:
        return False

    def check_integrity(self) -> None:
        if self.filled != sum(len(s.tokens) for s in self.live.values()):
            raise IntegrityError(f"{self.name}: {self.filled} tokens counted, the sequences hold others")
        if set(self.live) != set(self.held) or self.used != sum(self.held.values()):
            raise IntegrityError(f"{self.name}: {self.used} slots used, the sequences hold {sum(self.held.values())}")
        for seq_id, seq in self.live.items():
            if self.held[seq_id] != self._slots(seq_id, len(seq.tokens)):
                raise IntegrityError(f"{self.name}: sequence {seq_id} holds {self.held[seq_id]} slots for "
                                     f"{len(seq.tokens)} tokens")
        if not 0 <= self.used <= self.capacity:
            raise IntegrityError(f"{self.name}: {self.used} of {self.capacity} slots used")

    # -- the defragmenter ---------------------------------------------------------------------

    def _defragment_if_needed(self) -> None:
        """merge: past the threshold, split every unsplit sequence's last L block that is at
        most half full into G blocks (copying its tokens)."""
        self.grows_since_defrag = 0
        if not self.used or (self.used - self.filled) / self.used <= DEFRAG_THRESHOLD:
            return
        self.defrag_runs += 1
        L = self.large
        for seq_id, seq in self.live.items():
            r = len(seq.tokens) % L
            if seq_id in self.split or r == 0 or r > L // 2:
                continue
            self.split.add(seq_id)
            self.copies += r
            new = self._slots(seq_id, len(seq.tokens))
            self.used += new - self.held[seq_id]
            self.held[seq_id] = new


def _tail_block(r: int, small: int, large: int) -> int:
    """The smallest ``small * 2^k`` (at most ``large``) holding ``r`` tokens; 0 for none."""
    if r == 0:
        return 0
    size = small
    while size < r:
        size *= 2
    return min(size, large)
