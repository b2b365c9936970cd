"""Paged prefill attention in Triton: FlashAttention-2 over K/V read in place through the block table.

A prefill chunk is ``n`` consecutive query rows of one sequence at positions ``start_pos ..
start_pos + n - 1``; its new K/V are already in the paged cache, so every key (the cached prefix and
the chunk itself) is read from there. Query ``i`` sees keys ``0 .. start_pos + i`` (causal), or only
the last ``sliding_window`` of them (key ``j`` visible iff ``start_pos + i - w < j``, Mistral's rule).

One program per (chunk, tile of ``BLOCK_M`` query rows, KV head). It handles all ``group`` query
heads of its KV head at once: its M dimension is ``BLOCK_M * GROUP_P`` (``GROUP_P``: the group
rounded up to a power of two; row ``r`` is query row ``r // GROUP_P``, head ``r % GROUP_P``), so
each K/V row is read once for the whole group. It walks the keys in tiles of ``BLOCK_N`` tokens
(gathered through the block table: a tile spans several blocks when ``block_size < BLOCK_N``, or
takes part of one), from the first tile that any of its rows' windows reaches to its last row's
position, with an online softmax in float32 (``exp2``, log2(e) folded into the scale).

Scores: ``scale * q.k``, soft-capped (``c * tanh(s / c)``, Gemma 2) when ``softcap`` is given,
then masked. 8-bit caches (int8, fp8 e4m3 / e5m2) hold ``value / scale`` per (block, KV head):
the K scale multiplies the scores after the dot (exact in float32), V is dequantized before its dot.

A mixed pool (``quant``): each key / value token is read from the storage its block id names
(``decode._load_mixed``), 8-bit ones scaled, into float32 tiles.

Dots run on float16 / bfloat16 operands when q and the cache allow it (8-bit values convert to
them exactly) and on float32 otherwise ("ieee", no TF32); in Triton's interpreter always on float32
(its bfloat16 dot is unreliable). The interpreter also walks the key tiles with a ``while`` loop:
with numpy 2 its ``range()`` over tensor bounds fails; compiled kernels keep the pipelined ``for``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedkv.ops.paged_attention import QuantBlocks
from pagedkv.ops.triton import interpreting
from pagedkv.ops.triton.decode import _check_mixed, _load_mixed

__all__ = ["paged_prefill_attention"]

_EIGHT_BIT = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
_TORCH_TO_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_LOG2E = math.log2(math.e)


@triton.jit
def _tanh(x):
    x = tl.minimum(tl.maximum(x, -15.0), 15.0)  # tanh(15) == 1 in float32; keeps exp finite
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _attend_tile(start, hi, q, qpos, m_i, l_i, acc, k_ptr, v_ptr, kq_ptr, vq_ptr, ks_ptr, vs_ptr, bt_row, kvh64,
                 window, base, k_base, sc_in, sc_out, s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd,
                 s_kqb, s_kqs, s_kqh, s_kqd, s_vqb, s_vqs, s_vqh, s_vqd, s_ksb, s_ksh, s_vsb, s_vsh,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 HAS_SCALES: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, DOT_F32: tl.constexpr, MIXED: tl.constexpr):
    """One key tile ``start .. start + BLOCK_N - 1`` (keys >= ``hi`` masked) into the online softmax.
    ``MIXED``: a mixed pool, each token read in its block's format (``decode._load_mixed``; K by its
    own base ``k_base``)."""
    d = tl.arange(0, HEAD_DIM)
    t = start + tl.arange(0, BLOCK_N)
    t_ok = t < hi
    if BLOCK_SIZE >= BLOCK_N:  # the whole tile lies in one block
        blk = tl.zeros([BLOCK_N], tl.int64) + tl.load(bt_row + start // BLOCK_SIZE).to(tl.int64)
    else:
        blk = tl.load(bt_row + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
    slot = (t % BLOCK_SIZE).to(tl.int64)

    if MIXED:  # float32 [HEAD_DIM, BLOCK_N], scales applied
        k = _load_mixed(k_ptr, kq_ptr, ks_ptr, blk, slot, kvh64, d, t_ok[None, :], k_base, s_kb, s_ks, s_kh, s_kd,
                        s_kqb, s_kqs, s_kqh, s_kqd, s_ksb, s_ksh, True)
    else:
        k = tl.load(k_ptr + (blk * s_kb + slot * s_ks + kvh64 * s_kh)[None, :] + d[:, None] * s_kd,
                    mask=t_ok[None, :], other=0.0)  # [HEAD_DIM, BLOCK_N]
    if HAS_SCALES:
        k = k.to(tl.float32)
    k = k.to(DOT_DTYPE)
    if DOT_F32:
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    if HAS_SCALES:
        s = s * tl.load(ks_ptr + blk * s_ksb + kvh64 * s_ksh, mask=t_ok, other=0.0)[None, :]
    if HAS_SOFTCAP:
        s = _tanh(s * sc_in) * sc_out
    else:
        s = s * sc_out
    visible = (t[None, :] <= qpos[:, None]) & t_ok[None, :]
    if HAS_WINDOW:
        visible = visible & (t[None, :] > qpos[:, None] - window)
    s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)

    if MIXED:
        v = _load_mixed(v_ptr, vq_ptr, vs_ptr, blk, slot, kvh64, d, t_ok[:, None], base, s_vb, s_vs, s_vh, s_vd,
                        s_vqb, s_vqs, s_vqh, s_vqd, s_vsb, s_vsh, False)
    else:
        v = tl.load(v_ptr + (blk * s_vb + slot * s_vs + kvh64 * s_vh)[:, None] + d[None, :] * s_vd,
                    mask=t_ok[:, None], other=0.0)  # [BLOCK_N, HEAD_DIM]
    if HAS_SCALES:
        vsc = tl.load(vs_ptr + blk * s_vsb + kvh64 * s_vsh, mask=t_ok, other=0.0)
        v = v.to(tl.float32) * vsc[:, None]
    v = v.to(DOT_DTYPE)
    if DOT_F32:
        pv = tl.dot(p.to(DOT_DTYPE), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(DOT_DTYPE), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, kq_ptr, vq_ptr, ks_ptr, vs_ptr, bt_ptr,
    chunk_seq_ptr, chunk_row_ptr, chunk_len_ptr, chunk_pos_ptr,
    sc_in, sc_out, window, base, k_base,
    s_qr, s_qh, s_qd, s_or, s_oh, s_od,
    s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd,
    s_kqb, s_kqs, s_kqh, s_kqd, s_vqb, s_vqs, s_vqh, s_vqd,
    s_ksb, s_ksh, s_vsb, s_vsh, s_bt,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_F32: tl.constexpr, INTERPRET: tl.constexpr,
    MIXED: tl.constexpr,
):
    c = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    n = tl.load(chunk_len_ptr + c)
    m0 = tile * BLOCK_M
    if m0 >= n:
        return
    seq = tl.load(chunk_seq_ptr + c).to(tl.int64)
    row0 = tl.load(chunk_row_ptr + c)
    pos0 = tl.load(chunk_pos_ptr + c)

    M: tl.constexpr = BLOCK_M * GROUP_P
    r = tl.arange(0, M)
    mi = r // GROUP_P
    g = r % GROUP_P
    row_ok = (m0 + mi < n) & (g < GROUP)
    qpos = pos0 + m0 + mi  # [M] position of each row's query
    rows = (row0 + m0 + mi).to(tl.int64)
    heads = (kvh * GROUP + g).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + rows[:, None] * s_qr + heads[:, None] * s_qh + d[None, :] * s_qd,
                mask=row_ok[:, None], other=0.0).to(DOT_DTYPE)

    hi = pos0 + tl.minimum(m0 + BLOCK_M, n)  # one past the tile's last query position
    lo = 0
    if HAS_WINDOW:  # the first tile any row's window reaches: the first row's
        lo = (tl.maximum(pos0 + m0 - window + 1, 0) // BLOCK_N) * BLOCK_N

    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + seq * s_bt
    kvh64 = kvh.to(tl.int64)
    if INTERPRET:  # numpy 2 breaks the interpreter's range() over tensor bounds
        start = lo
        while start < hi:
            m_i, l_i, acc = _attend_tile(
                start, hi, q, qpos, m_i, l_i, acc, k_ptr, v_ptr, kq_ptr, vq_ptr, ks_ptr, vs_ptr, bt_row, kvh64,
                window, base, k_base, sc_in, sc_out, s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd,
                s_kqb, s_kqs, s_kqh, s_kqd, s_vqb, s_vqs, s_vqh, s_vqd, s_ksb, s_ksh, s_vsb, s_vsh, BLOCK_N, HEAD_DIM,
                BLOCK_SIZE, HAS_SCALES, HAS_WINDOW, HAS_SOFTCAP, DOT_DTYPE, DOT_F32, MIXED)
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                start, hi, q, qpos, m_i, l_i, acc, k_ptr, v_ptr, kq_ptr, vq_ptr, ks_ptr, vs_ptr, bt_row, kvh64,
                window, base, k_base, sc_in, sc_out, s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd,
                s_kqb, s_kqs, s_kqh, s_kqd, s_vqb, s_vqs, s_vqh, s_vqd, s_ksb, s_ksh, s_vsb, s_vsh, BLOCK_N, HEAD_DIM,
                BLOCK_SIZE, HAS_SCALES, HAS_WINDOW, HAS_SOFTCAP, DOT_DTYPE, DOT_F32, MIXED)

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + rows[:, None] * s_or + heads[:, None] * s_oh + d[None, :] * s_od,
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _tiles(head_dim: int, group_p: int) -> tuple[int, int, int]:
    """(BLOCK_M query rows, BLOCK_N key tokens, num_warps); the M dimension is BLOCK_M * group_p."""
    block_m = max(1, 64 // group_p)
    block_n = 64 if head_dim <= 128 else 32
    return block_m, block_n, 4 if head_dim <= 64 else 8


def paged_prefill_attention(
    out: torch.Tensor,  # [rows, heads, head_dim]: rows of the chunks are written
    q: torch.Tensor,  # [rows, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [seqs, max_blocks] int32
    chunk_seq: torch.Tensor,  # [num_chunks] int32: the chunk's row of block_tables
    chunk_row_start: torch.Tensor,  # [num_chunks] int32: its first row of q / out
    chunk_num_rows: torch.Tensor,  # [num_chunks] int32: its rows (queries)
    chunk_start_pos: torch.Tensor,  # [num_chunks] int32: position of its first query
    scale: float,
    sliding_window: int | None = None,
    k_scales: torch.Tensor | None = None,  # [num_blocks, kv_heads] float32: 8-bit caches only
    v_scales: torch.Tensor | None = None,
    softcap: float | None = None,
    *,
    max_chunk_rows: int | None = None,
    quant: QuantBlocks | None = None,
) -> torch.Tensor:
    """Causal attention of each chunk's query rows over its sequence's paged K/V (already holding
    the chunk's own); writes those rows of ``out`` (other rows untouched) and returns it.

    ``max_chunk_rows`` (optional, >= every ``chunk_num_rows``) sizes the launch grid without reading
    ``chunk_num_rows`` back from the device. ``sliding_window`` None or 0: no window. ``quant``: a
    mixed pool (block ids below ``quant.base`` in the float ``k_cache`` / ``v_cache``, the others
    8-bit in ``quant``; K's below ``quant.key_base``; ``k_scales`` / ``v_scales`` unused), each block
    read in its own format.
    """
    if quant is not None:
        _check_mixed(k_cache, v_cache, quant)
    if q.dim() != 3 or out.shape != q.shape:
        raise ValueError(f"q and out must both be [rows, heads, head_dim]; got {tuple(q.shape)}, {tuple(out.shape)}")
    if k_cache.dim() != 4 or v_cache.shape[1:] != k_cache.shape[1:] \
            or (quant is None and v_cache.shape != k_cache.shape):  # (mixed: K and V have a base each)
        raise ValueError("k_cache and v_cache must both be [num_blocks, block_size, kv_heads, head_dim]")
    _, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and the cache ({cache_dim}) differ")
    if not _pow2(head_dim) or not 16 <= head_dim <= 256:
        raise ValueError(f"head_dim must be a power of two in 16..256, got {head_dim}")
    if not _pow2(block_size) or block_size > 256:
        raise ValueError(f"block_size must be a power of two in 1..256, got {block_size}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if q.dtype not in _FLOAT or out.dtype not in _FLOAT:
        raise ValueError(f"q and out must be float32, float16 or bfloat16; got {q.dtype}, {out.dtype}")
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) dtypes differ")
    eight_bit = k_cache.dtype in _EIGHT_BIT
    if quant is not None:  # the 8-bit blocks' scales come with quant
        k_scales, v_scales = quant.k_scales, quant.v_scales
    if not eight_bit and k_cache.dtype not in _FLOAT:
        raise ValueError(f"unsupported cache dtype {k_cache.dtype}")
    if eight_bit:
        for name, sc in (("k_scales", k_scales), ("v_scales", v_scales)):
            if sc is None or sc.shape != (num_blocks, kv_heads) or sc.dtype != torch.float32:
                raise ValueError(f"a {k_cache.dtype} cache needs {name} [num_blocks, kv_heads] float32")
    if sliding_window is not None and sliding_window < 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    if softcap is not None and softcap < 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if block_tables.dim() != 2:
        raise ValueError("block_tables must be [seqs, max_blocks]")
    num_chunks = chunk_seq.numel()
    if not (chunk_row_start.numel() == chunk_num_rows.numel() == chunk_start_pos.numel() == num_chunks):
        raise ValueError("chunk_seq, chunk_row_start, chunk_num_rows and chunk_start_pos differ in length")
    if num_chunks == 0 or q.shape[0] == 0:
        return out
    if max_chunk_rows is None:
        max_chunk_rows = int(chunk_num_rows.max())
    if max_chunk_rows <= 0:
        return out

    chunk_seq, chunk_row_start, chunk_num_rows, chunk_start_pos, block_tables = (
        t.contiguous() for t in (chunk_seq, chunk_row_start, chunk_num_rows, chunk_start_pos, block_tables))
    group = heads // kv_heads
    group_p = triton.next_power_of_2(group)
    block_m, block_n, num_warps = _tiles(head_dim, group_p)
    if interpreting() or q.dtype == torch.float32 or quant is not None:  # mixed: dequantized float32 tiles
        dot_dtype = torch.float32
    elif eight_bit or k_cache.dtype == q.dtype:
        dot_dtype = q.dtype
    else:
        dot_dtype = torch.float32
    has_softcap = bool(softcap)
    sc_in = scale / softcap if softcap else 1.0
    sc_out = (softcap if softcap else scale) * _LOG2E
    # an 8-bit cache has both scales (checked above)
    read_scales = eight_bit or quant is not None
    ks_strides = k_scales.stride() if read_scales and k_scales is not None else (0, 0)
    vs_strides = v_scales.stride() if read_scales and v_scales is not None else (0, 0)
    if not read_scales:
        k_scales = v_scales = out  # never read (HAS_SCALES and MIXED are off): any pointer will do
    kq, vq = (quant.k_quant, quant.v_quant) if quant is not None else (k_cache, v_cache)

    grid = (num_chunks, triton.cdiv(max_chunk_rows, block_m), kv_heads)
    _prefill_kernel[grid](
        out, q, k_cache, v_cache, kq, vq, k_scales, v_scales, block_tables,
        chunk_seq, chunk_row_start, chunk_num_rows, chunk_start_pos,
        float(sc_in), float(sc_out), int(sliding_window or 0), quant.base if quant is not None else 0,
        quant.key_base if quant is not None else 0,
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), *kq.stride(), *vq.stride(),
        *ks_strides, *vs_strides, block_tables.stride(0),
        GROUP=group, GROUP_P=group_p, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, HAS_SCALES=eight_bit, HAS_WINDOW=bool(sliding_window),
        HAS_SOFTCAP=has_softcap, DOT_DTYPE=_TORCH_TO_TL[dot_dtype], DOT_F32=dot_dtype == torch.float32,
        INTERPRET=interpreting(), MIXED=quant is not None,
        num_warps=num_warps,
    )
    return out
