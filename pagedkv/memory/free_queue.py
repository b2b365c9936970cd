"""The free-block queue: blocks with ref count 0, in eviction order.

A doubly linked list threaded through the blocks themselves, with two sentinels::

    head <-> b7 <-> b2 <-> b9 <-> tail
             ^ next victim        ^ most recently freed

Why not a deque: a prefix-cache hit revives a *cached* free block from the middle of the order,
and that must be O(1). Every operation here is O(1) and allocates nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

from pagedkv.memory.block import Block


class FreeBlockQueue:
    def __init__(self, blocks: list[Block] | None = None) -> None:
        self._head = Block(block_id=-1)
        self._tail = Block(block_id=-2)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._size = 0
        for block in blocks or ():
            self.append(block)

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next

    def __contains__(self, block: Block) -> bool:
        return block.prev is not None

    def peek(self) -> Block | None:
        """The next victim, or None when empty."""
        return self._head.next if self._size else None

    def append(self, block: Block) -> None:
        """Add at the tail: evicted last."""
        last = self._tail.prev
        assert last is not None and block.prev is None
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self._size += 1

    def appendleft(self, block: Block) -> None:
        """Add at the head: evicted first (for blocks that hold nothing worth keeping)."""
        first = self._head.next
        assert first is not None and block.prev is None
        self._head.next = block
        block.prev = self._head
        block.next = first
        first.prev = block
        self._size += 1

    def popleft(self) -> Block:
        if not self._size:
            raise IndexError("pop from an empty FreeBlockQueue")
        block = self._head.next
        assert block is not None
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[Block]:
        """Pop the ``n`` first blocks (the caller checked ``n <= len(self)``) in one pass."""
        out = []
        head = self._head
        node = head.next
        for _ in range(n):
            assert node is not None and node is not self._tail
            nxt = node.next
            node.prev = node.next = None
            out.append(node)
            node = nxt
        head.next = node
        node.prev = head  # type: ignore[union-attr]  # a linked node: the sentinels bound the list
        self._size -= n
        return out

    def remove(self, block: Block) -> None:
        """Unlink ``block`` from anywhere in the queue in O(1)."""
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self._size -= 1
