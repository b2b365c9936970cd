"""Errors the memory core raises. Each names what ran out or what rule was broken."""

from pagedkv.errors import PagedKVError


class OutOfBlocksError(PagedKVError, RuntimeError):
    """Not enough free blocks for an allocation. Nothing was changed.

    The scheduler catches this to queue, preempt or evict; ``needed`` and ``available`` tell how far
    short the pool is (``available`` already excludes the admission watermark).
    """

    def __init__(self, needed: int, available: int, pool: str = "device") -> None:
        super().__init__(f"out of {pool} KV blocks: need {needed}, {available} available")
        self.needed = needed
        self.available = available
        self.pool = pool


class IntegrityError(PagedKVError, AssertionError):
    """``check_integrity()`` found the bookkeeping inconsistent (a bug, never a user error)."""
