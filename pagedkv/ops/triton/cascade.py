"""Shared-block (cascade) paged decode attention in Triton: the decode rows that hold the same run of
blocks attend to it together, each K and V tile loaded once for all of them.

Same contract as :func:`pagedkv.ops.triton.decode.paged_decode_attention`, plus the step's
:class:`~pagedkv.ops.cascade.CascadePlan` (found once per step from the block tables, on the
kernels' device). Two launches:

1. ``_shared_kernel``, grid ``(parts, kv_heads)``: a part is up to ``PART_ROWS`` rows of one
   node (a run of blocks they all hold). The program loads the queries of all its rows and all
   query heads of its KV head (``[PART_ROWS * group, head_dim]``: a matrix, so ``tl.dot`` has
   real work) and walks the node's tokens in tiles of ``BLOCK_N``; each query sees the tokens of
   the node within its row's length and window. Its online-softmax state ``(m, l, acc)`` per
   (entry, query head) goes to float32 scratch (``m`` in base 2).
2. ``_own_kernel``, grid ``(rows, kv_heads)``: a decode row merges the partial states of its
   nodes by the log-sum-exp rule into its starting state, continues over its own blocks
   (``row_own_start`` .. ``row_len``, within its window) with the decode kernel's tile
   (``decode._attend_tile``), divides and writes ``out``.

The arithmetic per token is the decode kernel's; only the order of the sums differs. Proved in
Triton's interpreter against the plain reference (``tests/ops/triton/test_triton_cascade.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.ops.cascade import PART_ROWS, CascadePlan
from pagedkv.ops.triton import interpreting
from pagedkv.ops.triton.decode import (
    _SCALED_CACHES,
    _attend_tile,
    _check,
    _fold_tile,
    _next_pow2,
    _tile_slots,
    paged_decode_attention,
)


@triton.jit
def _attend_rows_tile(
    tile, lo, hi, q_start, q_end, q, q_dot, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kvh, max_blocks,
    softcap, k_s0, k_s1, k_s2, k_s3, v_s0, v_s1, v_s2, v_s3, bt_s1, sc_s0, sc_s1, offs_n, offs_d, d_mask,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SCALED: tl.constexpr, SOFTCAP: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """``decode._attend_tile`` with a visible range per query (``[q_start, q_end)``, within the
    node's ``[lo, hi)``): tile ``tile`` folded into the queries' online softmax state."""
    t, t_mask, blk, off, kv_mask = _tile_slots(tile, lo, hi, bt_row, bt_s1, max_blocks, offs_n, d_mask,
                                               BLOCK_SIZE, BLOCK_N)
    k = tl.load(k_ptr + blk[:, None] * k_s0 + off[:, None] * k_s1 + kvh * k_s2 + offs_d[None, :] * k_s3,
                mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + blk[:, None] * v_s0 + off[:, None] * v_s1 + kvh * v_s2 + offs_d[None, :] * v_s3,
                mask=kv_mask, other=0.0)
    k_sc = t_mask  # unused unless SCALED
    v_sc = t_mask
    if SCALED:
        k_sc = tl.load(ks_ptr + blk * sc_s0 + kvh * sc_s1, mask=t_mask, other=0.0)
        v_sc = tl.load(vs_ptr + blk * sc_s0 + kvh * sc_s1, mask=t_mask, other=0.0)
    visible = (t[None, :] >= q_start[:, None]) & (t[None, :] < q_end[:, None])
    return _fold_tile(visible, k, v, k_sc, v_sc, q, q_dot, m_i, l_i, acc, softcap, SCALED, SOFTCAP, USE_DOT,
                      DOT_DTYPE, DOT_PREC)


@triton.jit
def _shared_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, row_len_ptr, ks_ptr, vs_ptr,
    part_node_ptr, part_first_ptr, part_count_ptr, node_seq_ptr, node_start_ptr, node_end_ptr, node_rows_ptr,
    mid_m_ptr, mid_l_ptr, mid_acc_ptr,
    q_s0, q_s1, q_s2,
    k_s0, k_s1, k_s2, k_s3,
    v_s0, v_s1, v_s2, v_s3,
    bt_s0, bt_s1,
    sc_s0, sc_s1,
    max_blocks, scale, softcap, window, total_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, PART: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SCALED: tl.constexpr, SOFTCAP: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr,
):
    part = tl.program_id(0)
    kvh = tl.program_id(1)
    kvh64 = kvh.to(tl.int64)
    node = tl.load(part_node_ptr + part)
    first = tl.load(part_first_ptr + part)
    count = tl.load(part_count_ptr + part)
    seq = tl.load(node_seq_ptr + node).to(tl.int64)
    lo = tl.load(node_start_ptr + node)
    hi = tl.load(node_end_ptr + node)

    offs_m = tl.arange(0, PART * GROUP_P)  # query m: row m // GROUP_P of the part, head m % GROUP_P
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    r = offs_m // GROUP_P
    g = offs_m % GROUP_P
    valid = (r < count) & (g < GROUP)
    d_mask = offs_d < HEAD_DIM
    entry = (first + r).to(tl.int64)
    row = tl.load(node_rows_ptr + entry, mask=r < count, other=0).to(tl.int64)
    n = tl.load(row_len_ptr + row, mask=r < count, other=0)
    q_start = tl.maximum(n * 0 + lo, tl.where(window > 0, n - window, 0))
    q_end = tl.where(valid, tl.minimum(n, hi), 0)
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + row[:, None] * q_s0 + heads[:, None] * q_s1 + offs_d[None, :] * q_s2,
                mask=valid[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    q = q * scale
    q_dot = q.to(DOT_DTYPE)

    m_i = tl.full([PART * GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([PART * GROUP_P], tl.float32)
    acc = tl.zeros([PART * GROUP_P, BLOCK_D], tl.float32)
    bt_row = bt_ptr + seq * bt_s0
    t_lo = lo // BLOCK_N
    t_hi = (hi + BLOCK_N - 1) // BLOCK_N
    if INTERPRET:  # numpy 2 breaks the interpreter's range() over tensor bounds
        tile = t_lo
        while tile < t_hi:
            m_i, l_i, acc = _attend_rows_tile(
                tile, lo, hi, q_start, q_end, q, q_dot, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kvh64,
                max_blocks, softcap, k_s0, k_s1, k_s2, k_s3, v_s0, v_s1, v_s2, v_s3, bt_s1, sc_s0, sc_s1, offs_n,
                offs_d, d_mask, BLOCK_SIZE, BLOCK_N, SCALED, SOFTCAP, USE_DOT, DOT_DTYPE, DOT_PREC)
            tile += 1
    else:
        for tile in range(t_lo, t_hi):
            m_i, l_i, acc = _attend_rows_tile(
                tile, lo, hi, q_start, q_end, q, q_dot, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kvh64,
                max_blocks, softcap, k_s0, k_s1, k_s2, k_s3, v_s0, v_s1, v_s2, v_s3, bt_s1, sc_s0, sc_s1, offs_n,
                offs_d, d_mask, BLOCK_SIZE, BLOCK_N, SCALED, SOFTCAP, USE_DOT, DOT_DTYPE, DOT_PREC)
    # scratch [entries, heads] (m, l) and [entries, heads, BLOCK_D] (acc)
    base = entry * total_heads + heads
    tl.store(mid_m_ptr + base, m_i, mask=valid)
    tl.store(mid_l_ptr + base, l_i, mask=valid)
    tl.store(mid_acc_ptr + base[:, None] * BLOCK_D + offs_d[None, :], acc, mask=valid[:, None])


@triton.jit
def _own_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, row_seq_ptr, row_len_ptr, ks_ptr, vs_ptr,
    own_start_ptr, entry_ptr_ptr, entries_ptr, mid_m_ptr, mid_l_ptr, mid_acc_ptr, out_ptr,
    q_s0, q_s1, q_s2,
    k_s0, k_s1, k_s2, k_s3,
    v_s0, v_s1, v_s2, v_s3,
    bt_s0, bt_s1,
    sc_s0, sc_s1,
    o_s0, o_s1, o_s2,
    max_blocks, scale, softcap, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SCALED: tl.constexpr, SOFTCAP: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr,
):
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    kvh = tl.program_id(1)
    kvh64 = kvh.to(tl.int64)
    n = tl.load(row_len_ptr + row)
    seq = tl.load(row_seq_ptr + row).to(tl.int64)
    start = tl.load(own_start_ptr + row)
    if window > 0:
        start = tl.maximum(start, n - window)

    offs_g = tl.arange(0, GROUP_P)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    total_heads = tl.num_programs(1) * GROUP
    q = tl.load(q_ptr + row64 * q_s0 + heads[:, None] * q_s1 + offs_d[None, :] * q_s2,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    q = q * scale
    q_dot = q.to(DOT_DTYPE)

    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, BLOCK_D], tl.float32)
    # the row's shared runs: partial states merged by the log-sum-exp rule (base 2)
    e_lo = tl.load(entry_ptr_ptr + row)
    e_hi = tl.load(entry_ptr_ptr + row + 1)
    k_e = e_lo
    while k_e < e_hi:
        e = tl.load(entries_ptr + k_e).to(tl.int64)
        base = e * total_heads + heads
        m_e = tl.load(mid_m_ptr + base, mask=g_mask, other=float("-inf"))
        l_e = tl.load(mid_l_ptr + base, mask=g_mask, other=0.0)
        acc_e = tl.load(mid_acc_ptr + base[:, None] * BLOCK_D + offs_d[None, :], mask=g_mask[:, None], other=0.0)
        m_new = tl.maximum(m_i, m_e)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp2(m_i - m_use)
        b = tl.exp2(m_e - m_use)
        acc = acc * a[:, None] + acc_e * b[:, None]
        l_i = l_i * a + l_e * b
        m_i = m_new
        k_e += 1

    bt_row = bt_ptr + seq * bt_s0
    t_lo = start // BLOCK_N
    t_hi = (n + BLOCK_N - 1) // BLOCK_N
    if INTERPRET:
        tile = t_lo
        while tile < t_hi:
            m_i, l_i, acc = _attend_tile(
                tile, start, n, q, q_dot, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kvh64, max_blocks,
                softcap, k_s0, k_s1, k_s2, k_s3, v_s0, v_s1, v_s2, v_s3, bt_s1, sc_s0, sc_s1, offs_n, offs_d,
                d_mask, BLOCK_SIZE, BLOCK_N, SCALED, SOFTCAP, USE_DOT, DOT_DTYPE, DOT_PREC)
            tile += 1
    else:
        for tile in range(t_lo, t_hi):
            m_i, l_i, acc = _attend_tile(
                tile, start, n, q, q_dot, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kvh64, max_blocks,
                softcap, k_s0, k_s1, k_s2, k_s3, v_s0, v_s1, v_s2, v_s3, bt_s1, sc_s0, sc_s1, offs_n, offs_d,
                d_mask, BLOCK_SIZE, BLOCK_N, SCALED, SOFTCAP, USE_DOT, DOT_DTYPE, DOT_PREC)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(out_ptr + row64 * o_s0 + heads[:, None] * o_s1 + offs_d[None, :] * o_s2,
             o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :] & (n > 0))


def cascade_decode_attention(
    out: torch.Tensor,  # [rows, heads, head_dim]: rows with row_len > 0 are written
    q: torch.Tensor,  # [rows, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [seqs, max_blocks] int32
    row_seq: torch.Tensor,  # [rows] int32
    row_len: torch.Tensor,  # [rows] int32
    plan: CascadePlan | None,  # on the tensors' device; None: the decode kernel alone
    scale: float | None,
    sliding_window: int | None = None,
    k_scales: torch.Tensor | None = None,  # [num_blocks, kv_heads] float32: 8-bit caches only
    v_scales: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """:func:`~pagedkv.ops.triton.decode.paged_decode_attention` with ``plan``'s shared runs
    attended once for all their rows (same result up to float32 rounding). Returns ``out``."""
    if plan is None or plan.num_nodes == 0:
        return paged_decode_attention(out, q, k_cache, v_cache, block_tables, row_seq, row_len, scale,
                                      sliding_window, k_scales, v_scales, softcap)
    _check(out, q, k_cache, v_cache, block_tables, row_seq, row_len, k_scales, v_scales)
    rows, heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if plan.row_own_start.shape[0] != rows:
        raise ValueError(f"the cascade plan was found for {plan.row_own_start.shape[0]} rows, q has {rows}")
    if sliding_window is not None and sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 or None, got {sliding_window}")
    if softcap is not None and softcap < 0:
        raise ValueError(f"softcap must be >= 0 or None (0: off), got {softcap}")
    group = heads // kv_heads
    interp = interpreting()
    block_d = max(16, _next_pow2(d))
    scaled = k_cache.dtype in _SCALED_CACHES
    block_n = max(16, min(32 if scaled else 64, 4096 // block_d))
    own_dot = group > 1 or not interp  # as the decode kernel chooses
    own_group_p = max(16, _next_pow2(group)) if own_dot else _next_pow2(group)
    shared_group_p = _next_pow2(group)  # PART_ROWS x this >= 16 queries: tl.dot always
    if interp or k_cache.dtype == torch.float32:
        dot_dtype, dot_prec = tl.float32, "ieee"
    elif scaled:
        dot_dtype, dot_prec = tl.float32, ("tf32" if torch.version.hip is None else "ieee")
    else:
        dot_dtype, dot_prec = (tl.float16 if k_cache.dtype == torch.float16 else tl.bfloat16), "ieee"
    if k_scales is None:
        k_scales = v_scales = row_len
        sc_strides = (0, 0)
    else:
        assert v_scales is not None  # _check: 8-bit caches come with both
        k_scales, v_scales = k_scales.contiguous(), v_scales.contiguous()
        sc_strides = (k_scales.stride(0), k_scales.stride(1))
    alpha = float(scale if scale is not None else d ** -0.5)
    entries = plan.node_rows.shape[0]
    mid_m = torch.empty(max(entries, 1), heads, dtype=torch.float32, device=q.device)
    mid_l = torch.empty_like(mid_m)
    mid_acc = torch.empty(max(entries, 1), heads, block_d, dtype=torch.float32, device=q.device)
    common = dict(HEAD_DIM=d, BLOCK_D=block_d, GROUP=group, BLOCK_SIZE=block_size, BLOCK_N=block_n,
                  SCALED=scaled, SOFTCAP=bool(softcap), DOT_DTYPE=dot_dtype, DOT_PREC=dot_prec, INTERPRET=interp,
                  num_warps=8 if dot_prec == "ieee" and dot_dtype == tl.float32 else 4)
    strides = (*q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *sc_strides)
    parts = plan.part_node.shape[0]
    if parts:
        _shared_kernel[(parts, kv_heads)](
            q, k_cache, v_cache, block_tables, row_len, k_scales, v_scales,
            plan.part_node, plan.part_first, plan.part_count, plan.node_seq, plan.node_start, plan.node_end,
            plan.node_rows, mid_m, mid_l, mid_acc, *strides,
            block_tables.shape[1], alpha, float(softcap or 0.0), int(sliding_window or 0), heads,
            GROUP_P=shared_group_p, PART=PART_ROWS, USE_DOT=True, **common)
    _own_kernel[(rows, kv_heads)](
        q, k_cache, v_cache, block_tables, row_seq, row_len, k_scales, v_scales,
        plan.row_own_start, plan.row_entry_ptr, plan.row_entries, mid_m, mid_l, mid_acc, out,
        *strides, *out.stride(), block_tables.shape[1], alpha, float(softcap or 0.0), int(sliding_window or 0),
        GROUP_P=own_group_p, USE_DOT=bool(own_dot), **common)
    return out


__all__ = ["cascade_decode_attention"]
