"""Paged-attention test inputs shared by the kernel tests: ragged sequences in a shuffled block pool.

Imported explicitly (``from pagedkv_testing.paged_cases import paged_case``); pytest does not collect it.
"""

from __future__ import annotations

import torch

from pagedkv.ops.kv_format import kv_format, quantize
from pagedkv.ops.paged_attention import QuantBlocks


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


def mixed_case(kind: str, full_dtype: torch.dtype, seed: int, block_size: int, heads: int, kvh: int, d: int,
               lens: list[int], new: list[int], parts: str = "kv"):
    """``paged_case``'s sequences in a mixed pool (``runner/kv_cache.py``): the shuffled blocks split
    at ``base`` (about a third full precision, ``full_dtype``), so every table mixes both formats;
    8-bit (``kind``) blocks quantized per block and KV head with absmax scales. ``parts``: "kv" K
    and V split alike; "v" (``kv_quant_parts``) K of every block at ``full_dtype``; "three" K at
    ``full_dtype`` up to halfway through the 8-bit V blocks, so one table holds full, K-full/V-8-bit
    and 8-bit blocks. Returns ``(q, k full, v full, QuantBlocks, tables, row_seq, row_len)``."""
    fmt = kv_format(kind)
    q, k_all, v_all, tables, row_seq, row_len = paged_case(seed, block_size, heads, kvh, d, lens, new)
    num_blocks = k_all.shape[0]
    base = max(1, num_blocks // 3)
    k_base = {"kv": base, "v": num_blocks, "three": (base + num_blocks) // 2}[parts]
    k_scales = k_all[k_base:].abs().amax(dim=(1, 3)) / fmt.qmax
    v_scales = v_all[base:].abs().amax(dim=(1, 3)) / fmt.qmax
    k_quant = quantize(k_all[k_base:], fmt, k_scales[:, None, :, None])
    v_quant = quantize(v_all[base:], fmt, v_scales[:, None, :, None])
    quant = QuantBlocks(k_quant, v_quant, k_scales, v_scales, base, None if parts == "kv" else k_base)
    return q, k_all[:k_base].to(full_dtype).contiguous(), v_all[:base].to(full_dtype).contiguous(), quant, tables, \
        row_seq, row_len
