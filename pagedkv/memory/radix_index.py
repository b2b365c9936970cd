"""A radix tree over cached blocks: the second, independent prefix index.

The hash chain (``prefix_hash``) finds a prompt's cached blocks by hashing each full block with
its parent's hash. The radix tree finds the same blocks by walking token ids, one tree per tenant
(salt and adapter), with edges labelled by runs of whole blocks::

    root(tenant) ─[t0..t15 | t16..t31]─> node(blocks 7, 2) ─[t32..t47]─> node(block 9)
                                                          └─[u32..u47]─> node(block 4)

Both indexes must always agree (the tests check that); the radix tree also answers questions
the hash chain cannot, such as "which prefixes are cached" (``pretty_print``) in one walk.

Rules kept, like the hash index: the first block registered for a prefix keeps it (a duplicate
computed by a concurrent request is not indexed), and forgetting a block (eviction) makes every
longer prefix through it unreachable, without dropping the blocks after it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class RadixNode:
    key: tuple[int, ...]                 # tokens of this edge: len(blocks) whole blocks
    blocks: list[int | None]             # block id per block of the edge (None: forgotten)
    parent: RadixNode | None = None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)  # by first block


class RadixPrefixIndex:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.roots: dict[Hashable, RadixNode] = {}
        self.where: dict[int, tuple[RadixNode, int]] = {}  # block id -> (node, index in node)

    def __len__(self) -> int:
        return len(self.where)

    def _first(self, tokens: Sequence[int], at: int) -> tuple[int, ...]:
        return tuple(tokens[at:at + self.block_size])

    def match(self, tenant: Hashable, tokens: Sequence[int], max_blocks: int) -> list[int]:
        """Block ids of the longest cached prefix of ``tokens`` (at most ``max_blocks`` blocks)."""
        B = self.block_size
        out: list[int] = []
        node = self.roots.get(tenant)
        pos = 0
        while node is not None and len(out) < max_blocks:
            child = node.children.get(self._first(tokens, pos))
            if child is None:
                break
            for i, block_id in enumerate(child.blocks):
                if len(out) == max_blocks or block_id is None or \
                        tuple(tokens[pos:pos + B]) != child.key[i * B:(i + 1) * B]:
                    return out
                out.append(block_id)
                pos += B
            node = child
        return out

    def insert(self, tenant: Hashable, tokens: Sequence[int], block_ids: Sequence[int | None]) -> None:
        """Index ``block_ids`` as the blocks of ``tokens`` (whole blocks, from the start).

        Positions already holding a block keep it; positions whose block was forgotten take the
        new one, unless the new block is already indexed elsewhere. ``None`` indexes nothing.
        """
        B = self.block_size
        n = min(len(block_ids), len(tokens) // B)
        node = self.roots.setdefault(tenant, RadixNode((), []))
        i = 0
        while i < n:
            first = self._first(tokens, i * B)
            child = node.children.get(first)
            if child is None:
                new = [b if b is not None and b not in self.where else None for b in block_ids[i:n]]
                leaf = RadixNode(tuple(tokens[i * B:n * B]), new, node)
                node.children[first] = leaf
                self._note(leaf, 0)
                self._prune(leaf)
                return
            # Walk the edge while blocks match; split it where they stop matching.
            j = 0
            while j < len(child.blocks) and i < n and \
                    child.key[j * B:(j + 1) * B] == tuple(tokens[i * B:(i + 1) * B]):
                b = block_ids[i]
                if child.blocks[j] is None and b is not None and b not in self.where:
                    child.blocks[j] = b
                    self.where[b] = (child, j)
                i += 1
                j += 1
            if j < len(child.blocks) and i < n:
                self._split(child, j)
            node = child

    def remove(self, block_id: int) -> None:
        """Forget a block (it was evicted); unknown ids are ignored."""
        entry = self.where.pop(block_id, None)
        if entry is None:
            return
        node, j = entry
        node.blocks[j] = None
        self._prune(node)

    def _note(self, node: RadixNode, start: int) -> None:
        for j in range(start, len(node.blocks)):
            block_id = node.blocks[j]
            if block_id is not None:
                self.where[block_id] = (node, j)

    def _split(self, node: RadixNode, j: int) -> None:
        """Cut ``node``'s edge after ``j`` blocks; the rest becomes its only child."""
        B = self.block_size
        tail = RadixNode(node.key[j * B:], node.blocks[j:], node, node.children)
        for c in tail.children.values():
            c.parent = tail
        node.key, node.blocks = node.key[:j * B], node.blocks[:j]
        node.children = {tail.key[:B]: tail}
        self._note(tail, 0)

    def _prune(self, node: RadixNode) -> None:
        """Drop leaves that hold no block any more, walking up."""
        while node.parent is not None and not node.children and all(b is None for b in node.blocks):
            parent = node.parent
            del parent.children[node.key[:self.block_size]]
            node = parent

    def pretty_print(self) -> str:
        """One line per edge: tenant, depth in blocks, block ids and the first tokens."""
        lines = []

        def walk(node: RadixNode, depth: int, label: str) -> None:
            for child in node.children.values():
                ids = ",".join("-" if b is None else str(b) for b in child.blocks)
                lines.append(f"{'  ' * depth}{label}[{ids}] tokens {list(child.key[:6])}"
                             f"{'...' if len(child.key) > 6 else ''}")
                walk(child, depth + 1, "")
        for tenant, root in self.roots.items():
            lines.append(f"tenant {tenant.hex()[:8] if isinstance(tenant, bytes) else tenant}")
            walk(root, 1, "")
        return "\n".join(lines)

    def paths(self) -> list[tuple[Hashable, tuple[int, ...], int]]:
        """(tenant, tokens from the root through the block, block id) for every indexed block."""
        out = []

        def walk(tenant: Hashable, node: RadixNode, prefix: tuple[int, ...]) -> None:
            for child in node.children.values():
                for j, b in enumerate(child.blocks):
                    if b is not None:
                        out.append((tenant, prefix + child.key[:(j + 1) * self.block_size], b))
                walk(tenant, child, prefix + child.key)
        for tenant, root in self.roots.items():
            walk(tenant, root, ())
        return out

    def check_integrity(self) -> list[str]:
        """Problems found (empty when consistent): edges are whole blocks, ``where`` is exact."""
        problems = []
        seen: dict[int, tuple[RadixNode, int]] = {}

        def walk(node: RadixNode) -> None:
            for first, child in node.children.items():
                if child.parent is not node or child.key[:self.block_size] != first:
                    problems.append(f"radix edge {first} is mislinked")
                if len(child.key) != len(child.blocks) * self.block_size:
                    problems.append(f"radix edge {first} is not whole blocks")
                for j, b in enumerate(child.blocks):
                    if b is not None:
                        if b in seen:
                            problems.append(f"block {b} indexed twice in the radix tree")
                        seen[b] = (child, j)
                walk(child)
        for root in self.roots.values():
            walk(root)
        if seen != self.where:
            problems.append("radix block locations disagree with the tree")
        return problems
