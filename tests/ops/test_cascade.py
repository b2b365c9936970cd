"""Shared-block (cascade) attention (``ops/cascade.py``, ``csrc/cascade_attention.cpp``): the
sharing found from block tables, and the kernel against the plain reference.

Random sharing trees (forks of forks, runs shared by part of a branch, unrelated sequences), decode
and extend rows of ragged lengths, block sizes 1, 16, 64, GQA, sliding windows reaching into or
past shared runs, soft-cap, every block format (float32, float16, bfloat16, int8, fp8 e4m3 and
e5m2 with per-block scales, and a mixed pool of full-precision and 8-bit blocks). The kernel reads
the same stored values as the reference (8-bit blocks dequantized with their scales), so every
format is held to float32 rounding: max abs error <= 2e-5. By default a representative slice
runs; ``PAGEDKV_CASCADE_FULL_MATRIX=1`` runs every combination (docs/environment.md).
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch

from pagedkv.ops import cascade, native
from pagedkv.ops.cascade import find_shared_runs
from pagedkv.ops.paged_attention import NativeMetadata, QuantBlocks, native_paged_attention
from pagedkv.ops.reference import reference_paged_attention
from pagedkv_testing.sharing_cases import sharing_case

FULL = os.environ.get("PAGEDKV_CASCADE_FULL_MATRIX") == "1"  # docs/environment.md
ATOL = 2e-5

needs_kernel = pytest.mark.skipif(not cascade.available(), reason="the native cascade kernel is unavailable: "
                                  f"{native.why_unavailable() if not native.available() else 'an older build'}")


# -- finding the shared runs ------------------------------------------------------------------------

def _nodes(plan) -> list[tuple[int, int, list[int]]]:
    ptr = plan.node_row_ptr.tolist()
    rows = plan.node_rows.tolist()
    return [(s, e, rows[ptr[n]:ptr[n + 1]]) for n, (s, e) in
            enumerate(zip(plan.node_start.tolist(), plan.node_end.tolist()))]


def test_a_tree_of_forks_of_forks():
    # A and B fork from a parent that forked from C's prefix; D shares nothing; E holds the root
    # block only, with a row that does not reach past it.
    tables = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6], [7, 8], [1]]
    row_seq = [0, 1, 2, 3, 4, 4]
    row_len = [60, 50, 40, 20, 3, 4]
    plan = find_shared_runs(tables, row_seq, row_len, block_size=16, min_saved_tokens=0)
    assert plan is not None
    nodes = sorted(_nodes(plan))
    # blocks [0, 1): A B C E; blocks [1, 2): A B C; block [2, 3): A B; each row's own blocks after
    assert nodes == [(0, 16, [0, 1, 2, 4, 5]), (16, 32, [0, 1, 2]), (32, 48, [0, 1])]
    assert plan.row_own_start.tolist() == [48, 48, 32, 0, 16, 16]


def test_nothing_shared_gives_no_plan():
    assert find_shared_runs([[1, 2], [3, 4], [5]], [0, 1, 2], [20, 30, 5], block_size=16) is None
    # one sequence's extend rows share its blocks with each other, not with another sequence
    assert find_shared_runs([[1, 2], [3]], [0, 0, 0, 1], [30, 31, 32, 9], block_size=16) is None
    # a sequence whose rows are all attended elsewhere (length 0) shares with no one
    assert find_shared_runs([[1, 2], [1, 3]], [0, 1], [20, 0], block_size=16) is None


def test_released_blocks_and_blocks_past_the_rows():
    # A sliding group's released blocks (-1) are no one's and everyone's: no row's window reaches
    # them, so the run continues through them; blocks allocated past a row's length are not shared.
    tables = [[-1, -1, 5, 6, 9], [-1, -1, 5, 7]]
    plan = find_shared_runs(tables, [0, 1], [70, 60], block_size=16, min_saved_tokens=0)
    assert plan is not None and sorted(_nodes(plan)) == [(0, 48, [0, 1])]
    assert find_shared_runs([[1, 2, 3], [4, 2, 3]], [0, 1], [40, 40], block_size=16) is None


def test_min_seqs_is_checked():
    with pytest.raises(ValueError, match="min_seqs"):
        find_shared_runs([[1]], [0], [1], block_size=16, min_seqs=1)


def test_runs_too_short_to_pay_join_their_sub_branches():
    """A branch saving fewer token reads than min_saved_tokens is no node: its blocks join each
    sub-branch's node (whose sequences hold them too) or stay its rows' own."""
    # blocks 0-1 held by A B C (saves 2 x 32 = 64 reads); then A B go on together 10 blocks more
    tables = [[1, 2] + list(range(10, 20)) + [40], [1, 2] + list(range(10, 20)) + [41], [1, 2, 30, 31]]
    lens = [13 * 16, 13 * 16, 4 * 16]
    every = find_shared_runs(tables, [0, 1, 2], lens, block_size=16, min_saved_tokens=0)
    assert every is not None and sorted(_nodes(every)) == [(0, 32, [0, 1, 2]), (32, 192, [0, 1])]
    plan = find_shared_runs(tables, [0, 1, 2], lens, block_size=16, min_saved_tokens=100)
    assert plan is not None and sorted(_nodes(plan)) == [(0, 192, [0, 1])]
    assert plan.row_own_start.tolist() == [192, 192, 0]
    assert find_shared_runs(tables, [0, 1, 2], lens, block_size=16, min_saved_tokens=1000) is None


# -- the kernel against the reference -----------------------------------------------------------------

FORMATS = ["float32", "float16", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2", "mixed"]
_8BIT = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _stored(fmt: str, k: torch.Tensor, v: torch.Tensor, gen: torch.Generator):
    """The case's pool in format ``fmt``: (k_cache, v_cache, kernel kwargs, reference kwargs)."""
    if fmt in ("float32", "float16", "bfloat16"):
        dtype = getattr(torch, fmt)
        return k.to(dtype), v.to(dtype), {}, {}

    def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        scales = torch.rand(x.shape[0], x.shape[2], generator=gen) * 0.05 + 0.01  # [blocks, kv_heads]
        qmax = 127.0 if dtype == torch.int8 else 240.0
        stored = (x / scales[:, None, :, None]).clamp(-qmax, qmax)
        return (stored.round() if dtype == torch.int8 else stored).to(dtype), scales

    if fmt == "mixed":  # ids below base: float32 blocks; from base on: int8 blocks
        base = k.shape[0] // 3
        kq, ks = quantize(k[base:], torch.int8)
        vq, vs = quantize(v[base:], torch.int8)
        kf, vf = k[:base].contiguous(), v[:base].contiguous()
        return kf, vf, {"quant": QuantBlocks(kq, vq, ks, vs, base)}, dict(k_quant=kq, v_quant=vq, k_scales=ks,
                                                                          v_scales=vs, base=base)
    kq, ks = quantize(k, _8BIT[fmt])
    vq, vs = quantize(v, _8BIT[fmt])
    return kq, vq, {"k_scales": ks, "v_scales": vs}, {"k_scales": ks, "v_scales": vs}


def _check(seed: int, block_size: int, fmt: str, heads: int, kvh: int, d: int, window: int | None,
           softcap: float | None, num_seqs: int = 7) -> None:
    case = sharing_case(seed, block_size, heads, kvh, d, num_seqs=num_seqs)
    # every run a node, an extend chunk's context too (its rows' node of one sequence)
    plan = find_shared_runs(case.tables, case.row_seq, case.row_len, block_size, min_saved_tokens=0,
                            chunk_min_rows=2, chunk_min_tokens=1)
    assert plan is not None  # every tree shares its root
    meta = NativeMetadata.build(case.tables, case.row_seq, case.row_len)
    k, v, kernel_kw, ref_kw = _stored(fmt, case.k_cache, case.v_cache, torch.Generator().manual_seed(seed))
    q = case.q * 3 if softcap else case.q
    out = cascade.cascade_attention(torch.zeros_like(q), q, k, v, meta, plan, sliding_window=window,
                                    softcap=softcap, **kernel_kw)
    expected = reference_paged_attention(q, k, v, case.tables, case.row_seq, case.row_len, sliding_window=window,
                                         softcap=softcap, **ref_kw)
    err = (out - expected).abs().max().item()
    assert err <= ATOL, f"max abs error {err:.3g} > {ATOL} ({fmt}, block {block_size}, window {window})"


# (heads, kv_heads, head_dim): the vector paths (64, 128, 256 on AVX2 machines) and the portable one
SHAPES = [(9, 3, 64), (8, 2, 128), (4, 4, 40), (8, 1, 256)]
ALL = list(itertools.product(FORMATS, [1, 16, 64], SHAPES, [None, 5, 40], [None, 4.0]))
# the default slice: every format, block size, shape, window and the cap at least once
SLICE = [(f, b, SHAPES[i % len(SHAPES)], [None, 5, 40][i % 3], [None, 4.0][i % 2])
         for i, (f, b) in enumerate(itertools.product(FORMATS, [1, 16, 64]))]


@needs_kernel
@pytest.mark.parametrize("fmt,block_size,shape,window,softcap", ALL if FULL else SLICE)
def test_kernel_equals_reference_over_sharing_trees(fmt, block_size, shape, window, softcap):
    heads, kvh, d = shape
    for seed in range(3 if FULL else 1):
        _check(seed * 1000 + block_size + d, block_size, fmt, heads, kvh, d, window, softcap)


@needs_kernel
def test_many_rows_on_one_run_and_a_window_short_of_it():
    """The batched path's row parts (more rows than one part holds), and a window that ends
    inside, or before, the shared run for some rows."""
    for window in (None, 3, 70):
        _check(7, 16, "float32", 8, 2, 64, window, None, num_seqs=90)


@needs_kernel
def test_same_as_the_per_row_kernel():
    """The cascade result is the per-row kernel's up to float32 rounding of another sum order."""
    case = sharing_case(3, 16, 9, 3, 64, num_seqs=20)
    plan = find_shared_runs(case.tables, case.row_seq, case.row_len, 16, min_saved_tokens=0)
    meta = NativeMetadata.build(case.tables, case.row_seq, case.row_len)
    out = cascade.cascade_attention(torch.zeros_like(case.q), case.q, case.k_cache, case.v_cache, meta, plan)
    alone = native_paged_attention(torch.zeros_like(case.q), case.q, case.k_cache, case.v_cache, meta)
    assert (out - alone).abs().max().item() <= 1e-5


def test_without_a_plan_or_the_op_the_per_row_kernel_runs(monkeypatch):
    """No plan, or a build without the op: the result is the per-row kernel's (the plain
    reference here when no native kernel is built either)."""
    case = sharing_case(1, 4, 4, 2, 32)
    meta = NativeMetadata.build(case.tables, case.row_seq, case.row_len)
    expected = reference_paged_attention(case.q, case.k_cache, case.v_cache, case.tables, case.row_seq,
                                         case.row_len)
    if not native.available():
        pytest.skip("no native kernels: the runner takes the plain path, which never plans")
    plan = find_shared_runs(case.tables, case.row_seq, case.row_len, 4, min_saved_tokens=0)
    monkeypatch.setattr(cascade, "available", lambda: False)
    for p in (None, plan):
        out = cascade.cascade_attention(torch.zeros_like(case.q), case.q, case.k_cache, case.v_cache, meta, p)
        assert (out - expected).abs().max().item() <= ATOL


@needs_kernel
def test_bad_plans_are_refused_by_name():
    case = sharing_case(2, 16, 4, 2, 64)
    plan = find_shared_runs(case.tables, case.row_seq, case.row_len, 16, min_saved_tokens=0)
    assert plan is not None
    meta = NativeMetadata.build(case.tables, case.row_seq, case.row_len)
    plan.node_rows[0] = len(case.row_seq) + 5
    with pytest.raises(RuntimeError, match="node_rows"):
        cascade.cascade_attention(torch.zeros_like(case.q), case.q, case.k_cache, case.v_cache, meta, plan)


def test_random_trees_cover_forks_of_forks():
    """The generator makes what the kernel tests claim: nested nodes (a fork of a fork) and rows
    whose own blocks start after the shared ones, across the seeds the tests use."""
    depths = set()
    for seed in range(20):
        case = sharing_case(seed, 16, 4, 2, 32, num_seqs=random.Random(seed).randint(4, 9))
        plan = find_shared_runs(case.tables, case.row_seq, case.row_len, 16, min_saved_tokens=0)
        if plan is None:
            continue
        for r in range(len(case.row_seq)):
            depths.add(sum(1 for _, _, rows in _nodes(plan) if r in rows))
    assert max(depths) >= 2


# -- an extend chunk's rows: a node of one sequence ----------------------------------------------------

def test_an_extend_chunk_attends_the_blocks_before_it_as_a_node():
    """The rows of one sequence's chunk see its blocks before the chunk whole: a node of that
    sequence alone, after the nodes it shares with others; its rows' own blocks start there."""
    chunk = list(range(300, 340))  # 40 rows at positions 300..339 of a 40-block sequence
    table = list(range(100, 140))
    plan = find_shared_runs([table], [0] * 40, [p + 1 for p in chunk], block_size=16)
    assert plan is not None and sorted(_nodes(plan)) == [(0, 288, list(range(40)))]
    assert plan.row_own_start.tolist() == [288] * 40
    # after a prefix shared with another sequence's decode row (blocks 0-63), from there on
    tables = [list(range(64)) + list(range(200, 220)), list(range(64)) + [300]]
    lens = [1300 + i for i in range(20)] + [1030]
    plan = find_shared_runs(tables, [0] * 20 + [1], lens, block_size=16)
    assert plan is not None and sorted(_nodes(plan)) == [(0, 1024, list(range(21))), (1024, 1296, list(range(20)))]
    assert plan.row_own_start.tolist() == [1296] * 20 + [1024]


def test_small_chunks_stay_with_the_per_row_kernel():
    """Under CHUNK_MIN_ROWS rows or CHUNK_MIN_TOKENS tokens before them the per-row kernel is as fast."""
    assert cascade.CHUNK_MIN_ROWS == 16 and cascade.CHUNK_MIN_TOKENS == 256
    table = list(range(60))
    assert find_shared_runs([table], [0] * 15, list(range(901, 916)), block_size=16) is None
    assert find_shared_runs([table], [0] * 16, list(range(241, 257)), block_size=16) is None
    assert find_shared_runs([table], [0] * 16, list(range(257, 273)), block_size=16) is not None
    # released blocks (-1) of a sliding group are skipped: no row's window reaches them
    plan = find_shared_runs([[-1] * 30 + table], [0] * 16, list(range(1001, 1017)), block_size=16)
    assert plan is not None and [(s, e) for s, e, _ in _nodes(plan)] == [(480, 992)]


def test_random_trees_make_chunk_nodes():
    """The kernel tests' cases (every chunk a node) hold nodes of one sequence's extend rows."""
    found = 0
    for seed in range(20):
        case = sharing_case(seed, 16, 4, 2, 32, num_seqs=random.Random(seed).randint(4, 9))
        plan = find_shared_runs(case.tables, case.row_seq, case.row_len, 16, min_saved_tokens=0,
                                chunk_min_rows=2, chunk_min_tokens=1)
        if plan is None:
            continue
        found += sum(1 for _, _, rows in _nodes(plan) if len({case.row_seq[r] for r in rows}) == 1)
    assert found >= 5


@needs_kernel
@pytest.mark.parametrize("fmt", ["float32", "int8"])
def test_a_long_chunk_over_its_context_equals_the_per_row_kernel(fmt):
    """A prompt's later chunk (48 rows over 700 tokens, a window cutting into them for one case)
    through its own node: the per-row kernel's result and the reference's."""
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(64, 16, 3, 64, generator=gen), torch.randn(64, 16, 3, 64, generator=gen)
    k, v, kernel_kw, ref_kw = _stored(fmt, k, v, gen)
    table = list(range(63, 16, -1))  # 47 blocks, reversed ids
    row_len = list(range(701, 749))
    q = torch.randn(48, 9, 64, generator=gen)
    meta = NativeMetadata.build([table], [0] * 48, row_len)
    plan = find_shared_runs([table], [0] * 48, row_len, 16)
    assert plan is not None and plan.num_nodes == 1
    for window in (None, 600):
        out = cascade.cascade_attention(torch.zeros_like(q), q, k, v, meta, plan, sliding_window=window, **kernel_kw)
        alone = native_paged_attention(torch.zeros_like(q), q, k, v, meta, sliding_window=window, **kernel_kw)
        expected = reference_paged_attention(q, k, v, [table], [0] * 48, row_len, sliding_window=window, **ref_kw)
        assert (out - alone).abs().max().item() <= 1e-5
        assert (out - expected).abs().max().item() <= ATOL
