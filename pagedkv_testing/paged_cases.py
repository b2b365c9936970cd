"""Paged-attention test inputs shared by the kernel tests: ragged sequences in a shuffled block pool.

Imported explicitly (``from pagedkv_testing.paged_cases import paged_case``); pytest does not collect it.
"""

from __future__ import annotations

import torch


def paged_case(seed: int, block_size: int, heads: int, kvh: int, d: int, lens: list[int], new: list[int],
               dtype: torch.dtype = torch.float32):
    """Sequences of ``lens`` tokens in a shuffled paged cache; the last ``new[i]`` tokens of
    sequence i are query rows (1: a decode, more: an extend over a cached prefix)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 2
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, row_seq, row_len = [], [], []
    for i, (n, nb, m) in enumerate(zip(lens, need, new)):
        tables.append(perm[:nb])
        perm = perm[nb:]
        row_seq += [i] * m
        row_len += list(range(n - m + 1, n + 1))
    q = torch.randn(len(row_seq), heads, d, generator=gen)
    return q, k_cache, v_cache, tables, row_seq, row_len
