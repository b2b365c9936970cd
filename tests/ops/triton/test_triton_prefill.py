"""The Triton paged prefill kernel (``pagedkv.ops.triton.prefill``) against a plain PyTorch reference.

Run in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set before triton is imported), or
on the GPU ``PAGEDKV_TEST_DEVICE`` names (``pagedkv_testing/triton_device.py``; ``scripts/gpu_check.sh``).
Each case lays several chunks of different sequences into one ``q``, with rows between them that no
chunk covers (they must stay untouched), block tables shuffled over the cache, and NaN in every cache
slot the kernel must not read (past each sequence's context, unused table entries, tiles outside every
row's sliding window), so a read outside the rule shows up as NaN.
"""

from __future__ import annotations

import os

if os.environ.get("PAGEDKV_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (tests/conftest.py sets it too, first)

import math

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed")

from pagedkv.ops.triton import prefill
from pagedkv_testing.triton_device import call  # the interpreter here, PAGEDKV_TEST_DEVICE on a GPU

CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
EIGHT_BIT = ("int8", "fp8_e4m3", "fp8_e5m2")
# (atol, rtol) of the kernel's output (in q's dtype) against the float64 reference on the same values
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
SENTINEL = 7.25
FRESH = [(0, 40)]  # (start_pos, rows) per chunk
PREFIX = [(37, 7)]
MIXED = [(0, 7), (21, 40), (90, 1)]


def make_case(*, chunks, block_size, kv_heads=2, group=2, head_dim=64, dtype=torch.float32, cache="float32",
              shuffle=True, seed=0):
    """Tensors for one call: chunk c is sequence ``seq_of[c]``; one spare row between chunks."""
    gen = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    num_seqs = len(chunks) + 1  # one sequence no chunk uses
    seq_of = torch.randperm(num_seqs, generator=gen)[: len(chunks)].tolist()
    ctx = [0] * num_seqs
    for s, (pos, n) in zip(seq_of, chunks):
        ctx[s] = pos + n
    need = [math.ceil(c / block_size) for c in ctx]
    width = max(need) + 1
    num_blocks = sum(need) + 2
    poison = num_blocks - 1  # unused table entries point here
    ids = torch.randperm(num_blocks - 1, generator=gen) if shuffle else torch.arange(num_blocks - 1)
    tables = torch.full((num_seqs, width), poison, dtype=torch.int32)
    used = 0
    for s in range(num_seqs):
        tables[s, : need[s]] = ids[used: used + need[s]].to(torch.int32)
        used += need[s]

    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_ref, v_ref = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    k_scales = v_scales = None
    if cache in EIGHT_BIT:
        k_scales = torch.rand(num_blocks, kv_heads, generator=gen) * 0.05 + 0.01
        v_scales = torch.rand(num_blocks, kv_heads, generator=gen) * 0.05 + 0.01
        if cache == "int8":
            k_cache = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
            v_cache = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
        else:
            k_cache = (k_ref * 8).to(CACHE_DTYPES[cache])
            v_cache = (v_ref * 8).to(CACHE_DTYPES[cache])
        k_scales[poison] = v_scales[poison] = float("nan")
    else:
        k_cache, v_cache = k_ref.to(CACHE_DTYPES[cache]), v_ref.to(CACHE_DTYPES[cache])
        for c in (k_cache, v_cache):
            c[poison] = float("nan")
            for s in range(num_seqs):  # the slots past the context in each sequence's last block
                if ctx[s] % block_size:
                    c[tables[s, need[s] - 1], ctx[s] % block_size:] = float("nan")

    rows, row_start = 1, []
    for _, n in chunks:
        row_start.append(rows)
        rows += n + 1
    q = torch.randn(rows, heads, head_dim, generator=gen).to(dtype)
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables, "k_scales": k_scales,
            "v_scales": v_scales, "chunk_seq": i32(seq_of), "chunk_row_start": i32(row_start),
            "chunk_num_rows": i32([n for _, n in chunks]), "chunk_start_pos": i32([p for p, _ in chunks])}


def i32(xs):
    return torch.tensor(xs, dtype=torch.int32)


def dequantized(cache, scales, blocks, slots):
    x = cache.float()[blocks, slots].double()  # [ctx, kv_heads, head_dim]
    return x if scales is None else x * scales[blocks].double()[:, :, None]


def reference(case, scale, sliding_window=None, softcap=None):
    """Plain PyTorch, float64: per chunk, gather its sequence's K/V through the block table."""
    q, tables = case["q"], case["block_tables"]
    block_size = case["k_cache"].shape[1]
    group = q.shape[1] // case["k_cache"].shape[2]
    out = torch.full(q.shape, SENTINEL, dtype=torch.float64)
    for seq, row0, n, pos in zip(*(case[k].tolist() for k in
                                   ("chunk_seq", "chunk_row_start", "chunk_num_rows", "chunk_start_pos"))):
        t = torch.arange(pos + n)
        blocks, slots = tables[seq, t // block_size].long(), t % block_size
        k = dequantized(case["k_cache"], case["k_scales"], blocks, slots).repeat_interleave(group, 1)
        v = dequantized(case["v_cache"], case["v_scales"], blocks, slots).repeat_interleave(group, 1)
        k, v = k.nan_to_num(), v.nan_to_num()  # NaN only where the mask below hides it (the kernel's trap)
        s = torch.einsum("nhd,thd->hnt", q[row0: row0 + n].double(), k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        qpos = (pos + torch.arange(n)).view(n, 1)
        visible = t.view(1, -1) <= qpos
        if sliding_window:
            visible &= t.view(1, -1) > qpos - sliding_window
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
        out[row0: row0 + n] = torch.einsum("hnt,thd->nhd", p, v)
    return out


def run_kernel(case, scale, out=None, **kwargs):
    if out is None:
        out = torch.full(case["q"].shape, SENTINEL, dtype=case["q"].dtype)
    ret = call(prefill.paged_prefill_attention,
        out, case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["chunk_seq"],
        case["chunk_row_start"], case["chunk_num_rows"], case["chunk_start_pos"], scale,
        k_scales=case["k_scales"], v_scales=case["v_scales"], **kwargs)
    assert ret is out
    return out


def check(case, sliding_window=None, softcap=None, tol=None, **kwargs):
    scale = case["q"].shape[-1] ** -0.5
    out = run_kernel(case, scale, sliding_window=sliding_window, softcap=softcap, **kwargs)
    expected = reference(case, scale, sliding_window=sliding_window, softcap=softcap)
    atol, rtol = tol or TOL[case["q"].dtype]
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol)  # spare rows: still SENTINEL


@pytest.fixture
def small_tiles(monkeypatch):
    """BLOCK_M 4 query rows, BLOCK_N 16 keys: several query tiles and key tiles per chunk, and tiles
    taking part of a block (block_size > 16)."""
    monkeypatch.setattr(prefill, "_tiles", lambda head_dim, group_p: (4, 16, 4))


@pytest.mark.parametrize("chunks", [FRESH, PREFIX, MIXED], ids=["fresh", "prefix", "mixed"])
@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
def test_block_sizes_and_chunks(block_size, chunks):
    check(make_case(chunks=chunks, block_size=block_size))


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_gqa(group, head_dim):
    check(make_case(chunks=MIXED, block_size=16, group=group, head_dim=head_dim, seed=group))


@pytest.mark.parametrize("shuffle", [False, True])
def test_block_table_order(shuffle):
    check(make_case(chunks=MIXED, block_size=4, shuffle=shuffle, seed=3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    name = str(dtype).removeprefix("torch.")
    check(make_case(chunks=MIXED, block_size=16, dtype=dtype, cache=name, seed=4))


def test_float16_queries_over_float32_cache():
    check(make_case(chunks=MIXED, block_size=16, dtype=torch.float16, cache="float32", seed=5))


@pytest.mark.parametrize("window", [1, 5, 32, 1000])
@pytest.mark.parametrize("block_size", [4, 64])
def test_sliding_window(block_size, window):
    check(make_case(chunks=MIXED, block_size=block_size, seed=6), sliding_window=window)


@pytest.mark.parametrize("window", [None, 9])
def test_softcap(window):
    case = make_case(chunks=MIXED, block_size=4, seed=7)
    case["q"] *= 4  # scores well into tanh's bend
    check(case, softcap=5.0, sliding_window=window)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("cache", EIGHT_BIT)
def test_eight_bit_caches(cache, block_size):
    check(make_case(chunks=MIXED, block_size=block_size, cache=cache, seed=8))


@pytest.mark.parametrize("cache", EIGHT_BIT)
def test_eight_bit_half_queries_window_softcap(cache):
    case = make_case(chunks=MIXED, block_size=16, cache=cache, dtype=torch.float16, group=4, head_dim=16, seed=9)
    check(case, sliding_window=11, softcap=20.0)


@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
def test_small_tiles(small_tiles, block_size):
    check(make_case(chunks=MIXED, block_size=block_size, group=2, head_dim=16, seed=10))


@pytest.mark.parametrize("block_size", [4, 16, 64])
def test_small_tiles_window_skips_unreachable_tiles(small_tiles, block_size):
    """Key tiles no row of a query tile reaches are never read: NaN there changes nothing."""
    window, chunks = 6, [(50, 30), (0, 40)]
    case = make_case(chunks=chunks, block_size=block_size, head_dim=16, seed=11)
    for seq, (pos, _) in zip(case["chunk_seq"].tolist(), chunks):
        first_tile = (max(pos - window + 1, 0) // 16) * 16  # the chunk's first query tile starts there
        for t in range(first_tile):
            blk = case["block_tables"][seq, t // block_size]
            case["k_cache"][blk, t % block_size] = case["v_cache"][blk, t % block_size] = float("nan")
    check(case, sliding_window=window)


def test_large_blocks():
    """block_size 256 > BLOCK_N: each key tile takes part of one block."""
    check(make_case(chunks=[(250, 20), (3, 5)], block_size=256, kv_heads=1, group=2, head_dim=16, seed=12),
          sliding_window=100)


def test_head_dim_256():
    check(make_case(chunks=[(5, 9)], block_size=16, kv_heads=1, group=2, head_dim=256, seed=13))


def test_strided_queries_and_max_chunk_rows():
    """q a view into a fused projection, out a float32 buffer for float16 q; the grid sized by the caller."""
    case = make_case(chunks=MIXED, block_size=16, dtype=torch.float16, cache="float16", seed=14)
    q = case["q"]
    fused = torch.randn(q.shape[0], q.shape[1] * 2, q.shape[2]).to(q.dtype)
    fused[:, 1::2] = q
    case["q"] = fused[:, 1::2]
    assert not case["q"].is_contiguous()
    scale = q.shape[-1] ** -0.5
    out = run_kernel(case, scale, out=torch.full(q.shape, SENTINEL), max_chunk_rows=40)
    torch.testing.assert_close(out.double(), reference(case, scale), atol=1e-4, rtol=1e-4)


def test_empty_chunks_and_rows_left_alone():
    case = make_case(chunks=[(3, 0), (10, 5)], block_size=4, seed=15)
    check(case)
    case["chunk_num_rows"] = torch.zeros(2, dtype=torch.int32)
    out = run_kernel(case, 0.125)
    assert (out == SENTINEL).all()


@pytest.mark.parametrize("change, message", [
    ({"block_size": 3}, "block_size"),
    ({"block_size": 512}, "block_size"),
    ({"head_dim": 8}, "head_dim"),
    ({"head_dim": 48}, "head_dim"),
    ({"head_dim": 512}, "head_dim"),
    ({"cache": "int8"}, "k_scales"),
    ({"heads": 3}, "multiple of kv_heads"),
])
def test_rejects(change, message):
    bs, d = change.get("block_size", 4), change.get("head_dim", 16)
    cache = torch.zeros(4, bs, 2, d, dtype=CACHE_DTYPES[change.get("cache", "float32")])
    q = torch.zeros(3, change.get("heads", 4), d)
    one = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        prefill.paged_prefill_attention(torch.empty_like(q), q, cache, cache.clone(),
                                        torch.zeros(1, 4, dtype=torch.int32), one, one, one + 1, one, 0.25)
