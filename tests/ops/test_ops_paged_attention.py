"""Paged ops vs naive contiguous attention: random shapes, block sizes 1..256, ragged lengths."""

from __future__ import annotations

import pytest
import torch

from pagedkv.ops import (
    DecodeMetadata,
    copy_blocks,
    paged_decode_attention,
    paged_prefill_attention,
    reference_attention,
    swap_blocks,
    write_kv,
)

BLOCK_SIZES = [1, 2, 3, 4, 7, 8, 16, 32, 64, 100, 128, 256]


def _scatter_contexts(lens: list[int], block_size: int, kvh: int, d: int, gen: torch.Generator
                      ) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], list[torch.Tensor], list[torch.Tensor]]:
    """Random contexts written into a shuffled paged cache; returns caches, tables and the contiguous K/V."""
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen)  # garbage in unused slots
    v_cache = torch.randn(num_blocks, block_size, kvh, d, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, ks, vs = [], [], []
    for n, nb in zip(lens, need):
        table, perm = perm[:nb], perm[nb:]
        k = torch.randn(n, kvh, d, generator=gen)
        v = torch.randn(n, kvh, d, generator=gen)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        write_kv(k_cache, v_cache, k, v, slots)
        tables.append(table)
        ks.append(k)
        vs.append(v)
    return k_cache, v_cache, tables, ks, vs


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads,kvh,d", [(4, 4, 16), (6, 2, 32), (9, 3, 64), (4, 1, 80)])
def test_decode_matches_reference(block_size: int, heads: int, kvh: int, d: int) -> None:
    gen = torch.Generator().manual_seed(block_size * 1000 + heads * 10 + d)
    lens = torch.randint(1, 300, (5,), generator=gen).tolist() + [1, block_size, block_size + 1]
    k_cache, v_cache, tables, ks, vs = _scatter_contexts(lens, block_size, kvh, d, gen)
    q = torch.randn(len(lens), heads, d, generator=gen)
    meta = DecodeMetadata.build(tables, lens, block_size=block_size, num_heads=heads, kv_heads=kvh,
                                head_dim=d, dtype=torch.float32)
    got = paged_decode_attention(q, k_cache, v_cache, meta)
    for i in range(len(lens)):
        want = reference_attention(q[i:i + 1], ks[i], vs[i])
        torch.testing.assert_close(got[i:i + 1], want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("prefix,new", [(0, 1), (0, 37), (5, 1), (13, 20), (64, 64), (250, 7)])
def test_prefill_with_cached_prefix_matches_reference(block_size: int, prefix: int, new: int) -> None:
    heads, kvh, d = 6, 2, 32
    gen = torch.Generator().manual_seed(block_size + 7 * prefix + new)
    ctx = prefix + new
    k_cache, v_cache, tables, ks, vs = _scatter_contexts([ctx], block_size, kvh, d, gen)
    q = torch.randn(new, heads, d, generator=gen)
    got = paged_prefill_attention(q, ks[0][prefix:], vs[0][prefix:], k_cache, v_cache,
                                  torch.tensor(tables[0]), prefix)
    torch.testing.assert_close(got, reference_attention(q, ks[0], vs[0]), atol=2e-5, rtol=1e-4)


def test_chunked_prefill_equals_one_shot() -> None:
    """The same context computed in chunks of 1, 5 and 64 tokens gives the same outputs."""
    heads, kvh, d, block_size, n = 4, 2, 16, 8, 70
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(n, kvh, d, generator=gen)
    v = torch.randn(n, kvh, d, generator=gen)
    q = torch.randn(n, heads, d, generator=gen)
    want = reference_attention(q, k, v)
    table = torch.tensor([9, 3, 0, 7, 1, 8, 2, 5, 6, 4])
    for chunk in (1, 5, 64):
        k_cache = torch.zeros(10, block_size, kvh, d)
        v_cache = torch.zeros(10, block_size, kvh, d)
        outs = []
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            pos = torch.arange(s, e)
            write_kv(k_cache, v_cache, k[s:e], v[s:e], table[pos // block_size] * block_size + pos % block_size)
            outs.append(paged_prefill_attention(q[s:e], k[s:e], v[s:e], k_cache, v_cache, table, s))
        torch.testing.assert_close(torch.cat(outs), want, atol=2e-5, rtol=1e-4)


def test_write_kv_lands_in_slots() -> None:
    k_cache = torch.zeros(4, 3, 2, 5)
    v_cache = torch.zeros(4, 3, 2, 5)
    k = torch.arange(2 * 2 * 5, dtype=torch.float32).view(2, 2, 5)
    write_kv(k_cache, v_cache, k, -k, torch.tensor([7, 2]))  # slot 7 = block 2, offset 1
    assert torch.equal(k_cache[2, 1], k[0]) and torch.equal(k_cache[0, 2], k[1])
    assert torch.equal(v_cache[2, 1], -k[0])
    assert k_cache.abs().sum() == k.abs().sum()


def test_copy_blocks_reads_all_sources_first() -> None:
    kv = torch.arange(3 * 2 * 5, dtype=torch.float32).view(3, 2, 5, 1, 1, 1).expand(3, 2, 5, 2, 1, 2).clone()
    before = kv.clone()
    copy_blocks(kv, [(0, 1), (1, 2)])  # block 1 is a destination and a source
    assert torch.equal(kv[:, :, 1], before[:, :, 0])
    assert torch.equal(kv[:, :, 2], before[:, :, 1])
    assert torch.equal(kv[:, :, [0, 3, 4]], before[:, :, [0, 3, 4]])
    with pytest.raises(ValueError):
        copy_blocks(kv, [(0, 3), (1, 3)])


def test_swap_round_trip() -> None:
    gen = torch.Generator().manual_seed(1)
    dev = torch.randn(2, 2, 6, 4, 1, 3, generator=gen)
    host = torch.zeros(2, 2, 3, 4, 1, 3)
    saved = dev[:, :, [4, 1]].clone()
    swap_blocks(dev, host, [(4, 0), (1, 2)])
    assert torch.equal(host[:, :, [0, 2]], saved)
    dev[:, :, [4, 1]] = 0
    swap_blocks(host, dev, [(0, 5), (2, 3)])
    assert torch.equal(dev[:, :, [5, 3]], saved)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 5, 16, 1000])
def test_sliding_window_decode_and_prefill(block_size: int, window: int) -> None:
    heads, kvh, d = 4, 2, 16
    gen = torch.Generator().manual_seed(block_size * 31 + window)
    lens = [1, 3, 17, 40, 64]
    k_cache, v_cache, tables, ks, vs = _scatter_contexts(lens, block_size, kvh, d, gen)
    q = torch.randn(len(lens), heads, d, generator=gen)
    meta = DecodeMetadata.build(tables, lens, block_size=block_size, num_heads=heads, kv_heads=kvh,
                                head_dim=d, dtype=torch.float32, sliding_window=window)
    got = paged_decode_attention(q, k_cache, v_cache, meta)
    for i in range(len(lens)):
        want = reference_attention(q[i:i + 1], ks[i], vs[i], sliding_window=window)
        torch.testing.assert_close(got[i:i + 1], want, atol=2e-5, rtol=1e-4)
    for prefix in (0, 10):
        new = 64 - prefix
        qp = torch.randn(new, heads, d, generator=gen)
        out = paged_prefill_attention(qp, ks[4][prefix:], vs[4][prefix:], k_cache, v_cache,
                                      torch.tensor(tables[4]), prefix, sliding_window=window)
        torch.testing.assert_close(out, reference_attention(qp, ks[4], vs[4], sliding_window=window),
                                   atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 6])
def test_soft_capped_decode_and_prefill(window: int | None) -> None:
    """Gemma 2's cap on the scores (c * tanh(s / c)) in the plain decode and prefill paths."""
    heads, kvh, d, block_size, cap = 6, 2, 16, 4, 1.5
    gen = torch.Generator().manual_seed(11)
    lens = [2, 9, 33]
    k_cache, v_cache, tables, ks, vs = _scatter_contexts(lens, block_size, kvh, d, gen)
    q = 4 * torch.randn(len(lens), heads, d, generator=gen)
    meta = DecodeMetadata.build(tables, lens, block_size=block_size, num_heads=heads, kv_heads=kvh,
                                head_dim=d, dtype=torch.float32, sliding_window=window)
    got = paged_decode_attention(q, k_cache, v_cache, meta, softcap=cap)
    for i in range(len(lens)):
        want = reference_attention(q[i:i + 1], ks[i], vs[i], sliding_window=window, softcap=cap)
        torch.testing.assert_close(got[i:i + 1], want, atol=2e-5, rtol=1e-4)
    for prefix in (0, 10):  # a fresh prompt too: torch's SDPA has no cap, so it must not be used
        qp = 4 * torch.randn(33 - prefix, heads, d, generator=gen)
        out = paged_prefill_attention(qp, ks[2][prefix:], vs[2][prefix:], k_cache, v_cache,
                                      torch.tensor(tables[2]), prefix, sliding_window=window, softcap=cap)
        want = reference_attention(qp, ks[2], vs[2], sliding_window=window, softcap=cap)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
        assert (reference_attention(qp, ks[2], vs[2], sliding_window=window) - want).abs().max() > 1e-2
