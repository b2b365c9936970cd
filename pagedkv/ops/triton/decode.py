"""Paged decode attention in Triton: split-K over a row's context, GQA-aware, 8-bit caches.

Same contract as :func:`pagedkv.ops.paged_attention.native_paged_attention` (the CPU kernel),
with the metadata tensors passed directly: row ``r`` is query ``q[r]`` of sequence
``row_seq[r]`` (a row of ``block_tables``) and attends to that sequence's tokens
``0 .. row_len[r] - 1`` (the last ``sliding_window`` of them when given); rows with
``row_len == 0`` are skipped and their ``out`` rows left as they are. Token ``t`` lives at block
``block_tables[seq, t // block_size]``, offset ``t % block_size``.

Two launches:

1. ``_decode_split_kernel``, grid ``(rows, kv_heads, num_splits)``. A program loads the whole
   group of query heads of its KV head (``[group, head_dim]``, the group padded to a power of two,
   to >= 16 on the ``tl.dot`` path; broadcast-multiply + ``tl.sum`` is the other, which the
   interpreter takes for group 1) and walks its share of the row's context in tiles of ``BLOCK_N`` tokens,
   reading each K and V row once for all heads of the group and keeping an online softmax
   (running max ``m``, sum ``l``, accumulator ``acc [group, head_dim]``, all float32, in base 2).
   Tiles sit at absolute positions (multiples of ``BLOCK_N``); a row's tiles are divided evenly
   among the splits. With one split the program normalizes and writes ``out`` itself; otherwise
   it writes ``(m, l, acc)`` to float32 scratch.
2. ``_decode_merge_kernel``, grid ``(rows, heads)``: rescales the splits to their common max,
   sums and divides, and writes ``out`` (cast to its dtype).

Each token's block is looked up on its own (a gather through the block table), so a tile may
span several blocks or part of one: any ``block_size >= 1`` works, powers of two (1 .. 256 in
this project) are the fast case. ``head_dim`` may be anything (padded to a power of two >= 16
with masks). Caches: float32, float16, bfloat16, and int8 / float8_e4m3fn / float8_e5m2 with
``k_scales`` / ``v_scales`` ``[num_blocks, kv_heads]`` float32 (value = stored * scale): the K
scale is applied to the scores and the V scale to the probabilities, per token.

Tiles: ``BLOCK_N = 4096 // padded head_dim`` tokens (16 .. 64; .. 32 for 8-bit caches), 4 warps (8 for float32 caches,
whose IEEE dots take more registers): no register spills on sm_90 by ptxas for head_dim 64 .. 256,
every cache dtype and group; not yet timed on a GPU.

A mixed pool (``quant``: full-precision blocks below ``quant.base`` in ``k_cache`` / ``v_cache``,
8-bit blocks from it in ``quant.k_quant`` / ``v_quant`` with their scales; ``runner/kv_cache.py``):
each token of a tile loads from the storage its block id names (``_load_mixed``: two masked
loads), the 8-bit values scaled, and the tile goes through the same online softmax
(``_fold_tile``) as float32; its dots run on float32.

Precision of the dot products (``tl.dot`` path, on a GPU): float32 caches use IEEE float32,
8-bit caches TF32 (the stored values are exact in it; only q and p are rounded, to 10 mantissa
bits), float16 / bfloat16 caches the cache dtype with float32 accumulation. In Triton's
interpreter everything is float32. Softmax state and accumulation are float32 throughout.

``num_splits`` defaults to :func:`default_num_splits` of the longest context: on CPU tensors
(the interpreter) ``row_len.max()``; on a GPU the block table's capacity
(``block_tables.shape[1] * block_size``), so the call never waits on the device. Callers that
know the lengths on the host should pass ``num_splits`` (same result, any value >= 1).

Proved in Triton's interpreter (``tests/ops/triton/test_triton_decode.py``); the same tests run on a GPU with
``TRITON_INTERPRET=0``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.ops.paged_attention import QuantBlocks
from pagedkv.ops.triton import interpreting

_FLOAT_CACHES = (torch.float32, torch.float16, torch.bfloat16)
_SCALED_CACHES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
_Q_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

TOKENS_PER_SPLIT = 256  # the default splits give each at least this many tokens
MAX_SPLITS = 16


def default_num_splits(max_len: int) -> int:
    """Splits for a longest context of ``max_len`` tokens: one per ``TOKENS_PER_SPLIT`` tokens,
    1 .. ``MAX_SPLITS``."""
    return max(1, min(MAX_SPLITS, -(-int(max_len) // TOKENS_PER_SPLIT)))


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): saturates to +-1 without overflow trouble (inf -> 1, 0 -> -1)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _tile_slots(tile, lo, hi, bt_row, bt_s1, max_blocks, offs_n, d_mask,
                BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where tile ``tile``'s ``BLOCK_N`` tokens live: their absolute positions ``t``, which are in
    ``[lo, hi)``, their blocks (from the row's block table) and offsets in them, and the mask of the
    K/V elements to load."""
    t = tile * BLOCK_N + offs_n
    t_mask = (t >= lo) & (t < hi)
    idx = t // BLOCK_SIZE
    blk = tl.load(bt_row + idx * bt_s1, mask=t_mask & (idx < max_blocks), other=0).to(tl.int64)
    off = (t % BLOCK_SIZE).to(tl.int64)
    return t, t_mask, blk, off, t_mask[:, None] & d_mask[None, :]


@triton.jit
def _attend_tile(
    tile, start, n, q, q_dot, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kvh, max_blocks, softcap,
    k_s0, k_s1, k_s2, k_s3, v_s0, v_s1, v_s2, v_s3, bt_s1, sc_s0, sc_s1, offs_n, offs_d, d_mask,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SCALED: tl.constexpr, SOFTCAP: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One tile of ``BLOCK_N`` tokens (positions ``tile * BLOCK_N + i``, those in ``[start, n)``
    visible) folded into the online softmax state ``(m_i, l_i, acc)`` of the query group ``q``."""
    _, t_mask, blk, off, kv_mask = _tile_slots(tile, start, n, bt_row, bt_s1, max_blocks, offs_n, d_mask,
                                               BLOCK_SIZE, BLOCK_N)
    k = tl.load(k_ptr + blk[:, None] * k_s0 + off[:, None] * k_s1 + kvh * k_s2 + offs_d[None, :] * k_s3,
                mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D], stored dtype
    v = tl.load(v_ptr + blk[:, None] * v_s0 + off[:, None] * v_s1 + kvh * v_s2 + offs_d[None, :] * v_s3,
                mask=kv_mask, other=0.0)
    k_sc = t_mask  # unused unless SCALED
    v_sc = t_mask
    if SCALED:
        k_sc = tl.load(ks_ptr + blk * sc_s0 + kvh * sc_s1, mask=t_mask, other=0.0)
        v_sc = tl.load(vs_ptr + blk * sc_s0 + kvh * sc_s1, mask=t_mask, other=0.0)
    return _fold_tile(t_mask[None, :], k, v, k_sc, v_sc, q, q_dot, m_i, l_i, acc, softcap, SCALED, SOFTCAP,
                      USE_DOT, DOT_DTYPE, DOT_PREC)


@triton.jit
def _load_mixed(f_ptr, qt_ptr, sc_ptr, blk, off, kvh, offs_d, mask, base, f_s0, f_s1, f_s2, f_s3,
                q_s0, q_s1, q_s2, q_s3, sc_s0, sc_s1, D_FIRST: tl.constexpr):
    """Float32 values of tokens (block ``blk``, offset ``off``) of KV head ``kvh`` in a mixed pool,
    each read in its block's format: ids below ``base`` from the float cache ``f_ptr`` as stored,
    the others from the 8-bit cache ``qt_ptr`` at ``blk - base`` times their scale. ``[tokens, d]``
    (``D_FIRST``: ``[d, tokens]``); ``mask`` has that shape."""
    is_q = blk >= base
    qb = tl.where(is_q, blk - base, 0)
    sc = tl.load(sc_ptr + qb * sc_s0 + kvh * sc_s1, mask=is_q, other=0.0)
    if D_FIRST:
        f = tl.load(f_ptr + (blk * f_s0 + off * f_s1 + kvh * f_s2)[None, :] + offs_d[:, None] * f_s3,
                    mask=mask & (blk < base)[None, :], other=0.0).to(tl.float32)
        x = tl.load(qt_ptr + (qb * q_s0 + off * q_s1 + kvh * q_s2)[None, :] + offs_d[:, None] * q_s3,
                    mask=mask & is_q[None, :], other=0.0).to(tl.float32)
        out = f + x * sc[None, :]
    else:
        f = tl.load(f_ptr + (blk * f_s0 + off * f_s1 + kvh * f_s2)[:, None] + offs_d[None, :] * f_s3,
                    mask=mask & (blk < base)[:, None], other=0.0).to(tl.float32)
        x = tl.load(qt_ptr + (qb * q_s0 + off * q_s1 + kvh * q_s2)[:, None] + offs_d[None, :] * q_s3,
                    mask=mask & is_q[:, None], other=0.0).to(tl.float32)
        out = f + x * sc[:, None]
    return out


@triton.jit
def _attend_tile_mixed(
    tile, start, n, q, q_dot, m_i, l_i, acc, k_ptr, v_ptr, kq_ptr, vq_ptr, ks_ptr, vs_ptr, bt_row, kvh, max_blocks,
    softcap, base, k_base, k_s0, k_s1, k_s2, k_s3, v_s0, v_s1, v_s2, v_s3, kq_s0, kq_s1, kq_s2, kq_s3,
    vq_s0, vq_s1, vq_s2, vq_s3, bt_s1, sc_s0, sc_s1, offs_n, offs_d, d_mask,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """``_attend_tile`` over a mixed pool: each token's K and V read in its block's format
    (``_load_mixed``; K by its own base ``k_base``), scales applied before the dots."""
    _, t_mask, blk, off, kv_mask = _tile_slots(tile, start, n, bt_row, bt_s1, max_blocks, offs_n, d_mask,
                                               BLOCK_SIZE, BLOCK_N)
    k = _load_mixed(k_ptr, kq_ptr, ks_ptr, blk, off, kvh, offs_d, kv_mask, k_base, k_s0, k_s1, k_s2, k_s3,
                    kq_s0, kq_s1, kq_s2, kq_s3, sc_s0, sc_s1, False)
    v = _load_mixed(v_ptr, vq_ptr, vs_ptr, blk, off, kvh, offs_d, kv_mask, base, v_s0, v_s1, v_s2, v_s3,
                    vq_s0, vq_s1, vq_s2, vq_s3, sc_s0, sc_s1, False)
    return _fold_tile(t_mask[None, :], k, v, t_mask, t_mask, q, q_dot, m_i, l_i, acc, softcap, False, SOFTCAP, USE_DOT,
                      DOT_DTYPE, DOT_PREC)


@triton.jit
def _attend_any_tile(
    tile, start, n, q, q_dot, m_i, l_i, acc, k_ptr, v_ptr, kq_ptr, vq_ptr, ks_ptr, vs_ptr, bt_row, kvh, max_blocks,
    softcap, base, k_base, k_s0, k_s1, k_s2, k_s3, v_s0, v_s1, v_s2, v_s3, kq_s0, kq_s1, kq_s2, kq_s3,
    vq_s0, vq_s1, vq_s2, vq_s3, bt_s1, sc_s0, sc_s1, offs_n, offs_d, d_mask,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MIXED: tl.constexpr, SCALED: tl.constexpr,
    SOFTCAP: tl.constexpr, USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """``_attend_tile_mixed`` for a mixed pool, else ``_attend_tile``: the one call both of the
    decode kernel's tile loops (interpreted and compiled) make."""
    if MIXED:
        m_i, l_i, acc = _attend_tile_mixed(
            tile, start, n, q, q_dot, m_i, l_i, acc, k_ptr, v_ptr, kq_ptr, vq_ptr, ks_ptr, vs_ptr, bt_row,
            kvh, max_blocks, softcap, base, k_base, k_s0, k_s1, k_s2, k_s3, v_s0, v_s1, v_s2, v_s3,
            kq_s0, kq_s1, kq_s2, kq_s3, vq_s0, vq_s1, vq_s2, vq_s3, bt_s1, sc_s0, sc_s1, offs_n, offs_d,
            d_mask, BLOCK_SIZE, BLOCK_N, SOFTCAP, USE_DOT, DOT_DTYPE, DOT_PREC)
    else:
        m_i, l_i, acc = _attend_tile(
            tile, start, n, q, q_dot, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, kvh, max_blocks,
            softcap, k_s0, k_s1, k_s2, k_s3, v_s0, v_s1, v_s2, v_s3, bt_s1, sc_s0, sc_s1, offs_n, offs_d,
            d_mask, BLOCK_SIZE, BLOCK_N, SCALED, SOFTCAP, USE_DOT, DOT_DTYPE, DOT_PREC)
    return m_i, l_i, acc


@triton.jit
def _fold_tile(visible, k, v, k_sc, v_sc, q, q_dot, m_i, l_i, acc, softcap, SCALED: tl.constexpr,
               SOFTCAP: tl.constexpr, USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr):
    """A loaded K/V tile (``[BLOCK_N, BLOCK_D]``; 8-bit with per-token scales ``k_sc`` / ``v_sc``
    when ``SCALED``) folded into the online softmax state ``(m_i, l_i, acc)``; ``visible``: which
    (query, token) scores count, ``[1 or queries, BLOCK_N]`` (``ops/triton/cascade.py`` gives each
    query its own range)."""
    if USE_DOT:
        s = tl.dot(q_dot, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PREC)  # [GROUP_P, BLOCK_N]
    else:
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    if SCALED:
        s = s * k_sc[None, :]
    if SOFTCAP:
        s = softcap * _tanh(s / softcap)
    s = tl.where(visible, s * 1.4426950408889634, float("-inf"))  # base 2 from here on
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked tile: no NaN
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if SCALED:
        p = p * v_sc[None, :]
    if USE_DOT:
        pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PREC)
    else:
        pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, kq_ptr, vq_ptr, bt_ptr, row_seq_ptr, row_len_ptr, ks_ptr, vs_ptr,
    out_ptr, mid_m_ptr, mid_l_ptr, mid_acc_ptr,
    q_s0, q_s1, q_s2,
    k_s0, k_s1, k_s2, k_s3,
    v_s0, v_s1, v_s2, v_s3,
    kq_s0, kq_s1, kq_s2, kq_s3,
    vq_s0, vq_s1, vq_s2, vq_s3,
    bt_s0, bt_s1,
    sc_s0, sc_s1,
    o_s0, o_s1, o_s2,
    max_blocks, scale, softcap, window, base, k_base,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DIRECT: tl.constexpr,
    SCALED: tl.constexpr, SOFTCAP: tl.constexpr, MIXED: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr,
):
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    kvh = tl.program_id(1)
    kvh64 = kvh.to(tl.int64)
    split = tl.program_id(2)
    n = tl.load(row_len_ptr + row)
    seq = tl.load(row_seq_ptr + row).to(tl.int64)
    start = n * 0
    if window > 0:
        start = tl.maximum(n - window, 0)
    # this split's tiles of the row's tiles [start // BLOCK_N, cdiv(n, BLOCK_N))
    tile_lo = start // BLOCK_N
    tile_hi = (n + BLOCK_N - 1) // BLOCK_N
    per = (tile_hi - tile_lo + NUM_SPLITS - 1) // NUM_SPLITS
    s_lo = tile_lo + split * per
    s_hi = tl.minimum(s_lo + per, tile_hi)

    offs_g = tl.arange(0, GROUP_P)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g  # query heads of this KV head

    q = tl.load(q_ptr + row64 * q_s0 + heads[:, None] * q_s1 + offs_d[None, :] * q_s2,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    q = q * scale  # [GROUP_P, BLOCK_D]
    q_dot = q.to(DOT_DTYPE)  # the tl.dot path's operand

    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, BLOCK_D], tl.float32)

    bt_row = bt_ptr + seq * bt_s0
    if INTERPRET:  # numpy 2 breaks the interpreter's range() over tensor bounds (1-element arrays)
        tile = s_lo
        while tile < s_hi:
            m_i, l_i, acc = _attend_any_tile(
                tile, start, n, q, q_dot, m_i, l_i, acc, k_ptr, v_ptr, kq_ptr, vq_ptr, ks_ptr, vs_ptr, bt_row,
                kvh64, max_blocks, softcap, base, k_base, k_s0, k_s1, k_s2, k_s3, v_s0, v_s1, v_s2, v_s3,
                kq_s0, kq_s1, kq_s2, kq_s3, vq_s0, vq_s1, vq_s2, vq_s3, bt_s1, sc_s0, sc_s1, offs_n, offs_d,
                d_mask, BLOCK_SIZE, BLOCK_N, MIXED, SCALED, SOFTCAP, USE_DOT, DOT_DTYPE, DOT_PREC)
            tile += 1
    else:
        for tile in range(s_lo, s_hi):
            m_i, l_i, acc = _attend_any_tile(
                tile, start, n, q, q_dot, m_i, l_i, acc, k_ptr, v_ptr, kq_ptr, vq_ptr, ks_ptr, vs_ptr, bt_row,
                kvh64, max_blocks, softcap, base, k_base, k_s0, k_s1, k_s2, k_s3, v_s0, v_s1, v_s2, v_s3,
                kq_s0, kq_s1, kq_s2, kq_s3, vq_s0, vq_s1, vq_s2, vq_s3, bt_s1, sc_s0, sc_s1, offs_n, offs_d,
                d_mask, BLOCK_SIZE, BLOCK_N, MIXED, SCALED, SOFTCAP, USE_DOT, DOT_DTYPE, DOT_PREC)

    if DIRECT:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(out_ptr + row64 * o_s0 + heads[:, None] * o_s1 + offs_d[None, :] * o_s2,
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :] & (n > 0))
    else:
        # scratch [rows, heads, NUM_SPLITS] (m, l) and [rows, heads, NUM_SPLITS, BLOCK_D] (acc)
        total_heads = tl.num_programs(1) * GROUP
        base = (row64 * total_heads + heads) * NUM_SPLITS + split  # [GROUP_P]
        tl.store(mid_m_ptr + base, m_i, mask=g_mask)
        tl.store(mid_l_ptr + base, l_i, mask=g_mask)
        tl.store(mid_acc_ptr + base[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _decode_merge_kernel(
    out_ptr, mid_m_ptr, mid_l_ptr, mid_acc_ptr, row_len_ptr,
    o_s0, o_s1, o_s2,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_P: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    n = tl.load(row_len_ptr + row)
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    base = (row.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS + offs_s
    m = tl.load(mid_m_ptr + base, mask=s_mask, other=float("-inf"))
    l_split = tl.load(mid_l_ptr + base, mask=s_mask, other=0.0)  # each split's softmax denominator
    acc = tl.load(mid_acc_ptr + base[:, None] * BLOCK_D + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
    l_sum = tl.sum(w * l_split, axis=0)
    o = tl.sum(w[:, None] * acc, axis=0) / tl.where(l_sum > 0.0, l_sum, 1.0)
    d_mask = offs_d < HEAD_DIM
    tl.store(out_ptr + row.to(tl.int64) * o_s0 + head * o_s1 + offs_d * o_s2, o.to(out_ptr.dtype.element_ty),
             mask=d_mask & (n > 0))


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _check_mixed(k_cache, v_cache, quant) -> None:
    """A mixed pool's parts (``quant``: :class:`~pagedkv.ops.paged_attention.QuantBlocks`) against
    its float ``k_cache`` / ``v_cache`` (K's ids below ``quant.key_base``, V's below ``quant.base``)."""
    if k_cache.dtype not in _FLOAT_CACHES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"a mixed pool's full-precision caches must be float32, float16 or bfloat16, got "
                         f"{k_cache.dtype} and {v_cache.dtype}")
    kq, vq = quant.k_quant, quant.v_quant
    if kq.dtype not in _SCALED_CACHES or vq.dtype != kq.dtype or kq.dim() != 4 or vq.dim() != 4 \
            or kq.shape[1:] != k_cache.shape[1:] or vq.shape[1:] != k_cache.shape[1:]:
        raise ValueError(f"a mixed pool's 8-bit caches must be [num_quant, block_size, kv_heads, head_dim] = "
                         f"[n, {', '.join(map(str, k_cache.shape[1:]))}] of one 8-bit dtype, got "
                         f"{tuple(kq.shape)} {kq.dtype} and {tuple(vq.shape)} {vq.dtype}")
    for name, s, part in (("k_scales", quant.k_scales, kq), ("v_scales", quant.v_scales, vq)):
        want = (part.shape[0], part.shape[2])
        if s.dtype != torch.float32 or tuple(s.shape) != want:
            raise ValueError(f"a mixed pool's {name} must be [num_quant, kv_heads] = [{want[0]}, {want[1]}] float32, "
                             f"got {tuple(s.shape)} {s.dtype}")
    if quant.key_base != k_cache.shape[0] or quant.base != v_cache.shape[0]:
        raise ValueError(f"a mixed pool's 8-bit ids start at its full-precision block counts (K {k_cache.shape[0]}, "
                         f"V {v_cache.shape[0]}), got key_base {quant.key_base} and base {quant.base}")


def _check(out, q, k_cache, v_cache, block_tables, row_seq, row_len, k_scales, v_scales) -> None:
    if q.dim() != 3 or out.shape != q.shape:
        raise ValueError(f"q and out must both be [rows, heads, head_dim], got {tuple(q.shape)} and "
                         f"{tuple(out.shape)}")
    if q.dtype not in _Q_DTYPES or out.dtype not in _Q_DTYPES:
        raise ValueError(f"q and out must be float32, float16 or bfloat16, got {q.dtype} and {out.dtype}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must be [num_blocks, block_size, kv_heads, head_dim] of one dtype, "
                         f"got {tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}")
    rows, heads, d = q.shape
    num_blocks, block_size, kv_heads, kd = k_cache.shape
    if kd != d:
        raise ValueError(f"head_dim of q ({d}) and of the cache ({kd}) differ")
    if block_size < 1 or d < 1:
        raise ValueError(f"block_size and head_dim must be >= 1, got {block_size} and {d}")
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    dt = k_cache.dtype
    if dt in _SCALED_CACHES:
        for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
            if s is None or s.dtype != torch.float32 or tuple(s.shape) != (num_blocks, kv_heads):
                raise ValueError(f"{dt} caches need {name}: [num_blocks, kv_heads] = [{num_blocks}, {kv_heads}] "
                                 f"float32, got {None if s is None else (tuple(s.shape), s.dtype)}")
    elif dt not in _FLOAT_CACHES:
        raise ValueError(f"unsupported cache dtype {dt}: float32, float16, bfloat16, int8, float8_e4m3fn or "
                         "float8_e5m2")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be [seqs, max_blocks] int32, got {tuple(block_tables.shape)} "
                         f"{block_tables.dtype}")
    for name, t in (("row_seq", row_seq), ("row_len", row_len)):
        if t.dtype != torch.int32 or tuple(t.shape) != (rows,):
            raise ValueError(f"{name} must be [rows] = [{rows}] int32, got {tuple(t.shape)} {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    devices = {t.device for t in (out, q, k_cache, v_cache, block_tables, row_seq, row_len, k_scales, v_scales)
               if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def paged_decode_attention(
    out: torch.Tensor,  # [rows, heads, head_dim]: rows with row_len > 0 are written
    q: torch.Tensor,  # [rows, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [seqs, max_blocks] int32
    row_seq: torch.Tensor,  # [rows] int32
    row_len: torch.Tensor,  # [rows] int32
    scale: float | None,
    sliding_window: int | None = None,
    k_scales: torch.Tensor | None = None,  # [num_blocks, kv_heads] float32: 8-bit caches only
    v_scales: torch.Tensor | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    quant: QuantBlocks | None = None,
) -> torch.Tensor:
    """Attention of each row over its sequence's first ``row_len`` cached tokens (the last
    ``sliding_window`` of them; ``None`` / 0: all), reading K and V blocks in place; rows with
    ``row_len == 0`` are skipped. ``scale`` multiplies q.k (``None``: ``head_dim ** -0.5``);
    ``softcap`` c bounds the scaled score s to ``c * tanh(s / c)`` (``None`` / 0: off).
    ``num_splits`` (>= 1) splits each row's context for parallelism (see the module doc); the
    result does not depend on it beyond float32 rounding. Supports any ``block_size >= 1`` and
    ``head_dim >= 1``; raises ValueError on shapes / dtypes it does not take. ``quant``: a mixed
    pool (``runner/kv_cache.py``): block ids below ``quant.base`` in the float ``k_cache`` /
    ``v_cache``, the others 8-bit in ``quant`` (``k_scales`` / ``v_scales`` unused), each block
    read in its own format. Returns ``out``."""
    return _paged_decode(out, q, k_cache, v_cache, block_tables, row_seq, row_len, scale, sliding_window,
                         k_scales, v_scales, softcap, num_splits, quant=quant)


def _paged_decode(out, q, k_cache, v_cache, block_tables, row_seq, row_len, scale, sliding_window=None,
                  k_scales=None, v_scales=None, softcap=None, num_splits=None, *, use_dot: bool | None = None,
                  block_n: int | None = None, quant: QuantBlocks | None = None) -> torch.Tensor:
    """:func:`paged_decode_attention` with the kernel's choices exposed (tests pin them):
    ``use_dot`` (``tl.dot`` vs broadcast-multiply + sum; default: dot on a GPU, and in the
    interpreter when group > 1) and ``block_n`` (tokens per tile, a power of two >= 16; default
    ``4096 // padded head_dim`` within 16 .. 64)."""
    mixed = quant is not None
    if quant is not None:
        _check_mixed(k_cache, v_cache, quant)
        _check(out, q, k_cache, k_cache, block_tables, row_seq, row_len, None, None)
        k_scales, v_scales = quant.k_scales, quant.v_scales
    else:
        _check(out, q, k_cache, v_cache, block_tables, row_seq, row_len, k_scales, v_scales)
    rows, heads, d = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    if rows == 0:
        return out
    if sliding_window is not None and sliding_window < 0:
        raise ValueError(f"sliding_window must be >= 0 or None, got {sliding_window}")
    if softcap is not None and softcap < 0:
        raise ValueError(f"softcap must be >= 0 or None (0: off), got {softcap}")
    if num_splits is None:
        if row_len.device.type == "cpu":
            longest = int(row_len.max())
        else:  # no device sync: the block table's capacity bounds every row
            longest = block_tables.shape[1] * block_size
        num_splits = default_num_splits(longest)
    if int(num_splits) < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_splits = int(num_splits)
    interp = interpreting()
    if use_dot is None:  # on a GPU tl.dot needs fewer registers than the broadcast products, even
        use_dot = group > 1 or not interp  # padded from one head to 16; the interpreter keeps both in use
    block_d = max(16, _next_pow2(d))
    scaled = k_cache.dtype in _SCALED_CACHES or mixed  # (mixed: the 8-bit blocks' tile sizes)
    if block_n is None:  # K and V tiles of <= 4096 elements: no spills at 4 warps (ptxas, sm_90)
        block_n = max(16, min(32 if scaled else 64, 4096 // block_d))
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    group_p = max(16, _next_pow2(group)) if use_dot else _next_pow2(group)
    if interp or k_cache.dtype == torch.float32 or mixed:  # mixed: dequantized float32 tiles
        dot_dtype, dot_prec = tl.float32, "ieee"
    elif scaled:  # the stored values are exact in TF32 (AMD has no TF32: IEEE there)
        dot_dtype, dot_prec = tl.float32, ("tf32" if torch.version.hip is None else "ieee")
    else:
        dot_dtype, dot_prec = (tl.float16 if k_cache.dtype == torch.float16 else tl.bfloat16), "ieee"
    if k_scales is None:  # any pointer: never read unless SCALED
        k_scales = v_scales = row_len
        sc_strides = (0, 0)
    else:
        sc_strides = (k_scales.stride(0), k_scales.stride(1))
        if v_scales.stride() != k_scales.stride():
            v_scales = v_scales.contiguous()
            k_scales = k_scales.contiguous()
            sc_strides = (k_scales.stride(0), k_scales.stride(1))
    if scale is None:
        scale = d ** -0.5
    direct = num_splits == 1
    if direct:
        mid_m = mid_l = mid_acc = out  # unused
    else:
        mid_m = torch.empty(rows, heads, num_splits, dtype=torch.float32, device=q.device)
        mid_l = torch.empty_like(mid_m)
        mid_acc = torch.empty(rows, heads, num_splits, block_d, dtype=torch.float32, device=q.device)

    kq, vq = (quant.k_quant, quant.v_quant) if quant is not None else (k_cache, v_cache)
    _decode_split_kernel[(rows, kv_heads, num_splits)](
        q, k_cache, v_cache, kq, vq, block_tables, row_seq, row_len, k_scales, v_scales,
        out, mid_m, mid_l, mid_acc,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *kq.stride(), *vq.stride(), *block_tables.stride(),
        *sc_strides, *out.stride(),
        block_tables.shape[1], float(scale), float(softcap or 0.0), int(sliding_window or 0),
        quant.base if quant is not None else 0, quant.key_base if quant is not None else 0,
        HEAD_DIM=d, BLOCK_D=block_d, GROUP=group, GROUP_P=group_p,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits, DIRECT=direct,
        SCALED=scaled and not mixed, SOFTCAP=bool(softcap), MIXED=mixed,
        USE_DOT=bool(use_dot), DOT_DTYPE=dot_dtype, DOT_PREC=dot_prec, INTERPRET=interp,
        num_warps=8 if dot_prec == "ieee" and dot_dtype == tl.float32 else 4,  # FMA dots: more registers
    )
    if not direct:
        _decode_merge_kernel[(rows, heads)](
            out, mid_m, mid_l, mid_acc, row_len, *out.stride(),
            HEAD_DIM=d, BLOCK_D=block_d, NUM_SPLITS=num_splits, SPLITS_P=_next_pow2(num_splits),
            num_warps=1 if block_d <= 64 else 2,
        )
    return out


__all__ = ["MAX_SPLITS", "TOKENS_PER_SPLIT", "default_num_splits", "paged_decode_attention"]
