"""Random block-sharing trees for the shared-block (cascade) attention tests.

Imported explicitly (``from pagedkv_testing.sharing_cases import sharing_case``); pytest does not
collect it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass
class SharingCase:
    """Query rows over sequences whose block tables share runs of blocks, as a paged pool."""

    q: torch.Tensor  # [rows, heads, d] float32
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, d] float32
    v_cache: torch.Tensor
    tables: list[list[int]]
    row_seq: list[int]
    row_len: list[int]


def sharing_tables(rng: random.Random, num_seqs: int, free: list[int], max_own: int = 3) -> list[list[int]]:
    """Block tables of ``num_seqs`` sequences forming a tree: each sequence takes a prefix of one
    earlier sequence (a fork of a fork, cut anywhere: partly shared runs) or of a common root, or
    none (unrelated), then up to ``max_own`` fresh blocks from ``free`` (popped)."""
    root = [free.pop() for _ in range(rng.randint(1, 6))]
    tables: list[list[int]] = []
    for _ in range(num_seqs):
        pick = rng.random()
        if tables and pick < 0.55:
            parent = rng.choice(tables)
            base = parent[: rng.randint(1, len(parent))]
        elif pick < 0.9:
            base = root[: rng.randint(1, len(root))]
        else:
            base = []
        table = base + [free.pop() for _ in range(rng.randint(0 if base else 1, max_own))]
        tables.append(table)
    return tables


def sharing_case(seed: int, block_size: int, heads: int, kvh: int, d: int, num_seqs: int = 7,
                 extend: bool = True) -> SharingCase:
    """A random tree of ``num_seqs`` sequences (:func:`sharing_tables`) in a shuffled pool; each
    sequence's last token is a decode row, or (``extend``, some of them) its last few tokens are
    extend rows; lengths end anywhere in their last block (ragged)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 8 + num_seqs * 12
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = sharing_tables(rng, num_seqs, free)
    row_seq: list[int] = []
    row_len: list[int] = []
    for s, table in enumerate(tables):
        n = (len(table) - 1) * block_size + rng.randint(1, block_size)
        m = rng.choice([1, 1, min(n, 6)]) if extend else 1
        row_seq += [s] * m
        row_len += list(range(n - m + 1, n + 1))
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen)
    q = torch.randn(len(row_seq), heads, d, generator=gen)
    return SharingCase(q, k_cache, v_cache, tables, row_seq, row_len)
