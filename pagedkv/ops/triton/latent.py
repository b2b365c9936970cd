"""Paged attention over MLA latent blocks in Triton (DeepSeek-V2/V3's absorbed attention).

An MLA layer's cache holds one latent row per token, ``[c, k_pe]`` (``rank`` + ``rope`` values,
576 for V3), as one KV head (``models/mla.py``, ``docs/mla.md``)::

    cache  [num_blocks, block_size, 1, rank + rope]      one row:  | c (rank) | k_pe (rope) |
    q      [T, H, rank + rope]                            one head: | W_UK^T q_nope | q_pe |
    out    [T, H, rank + rope]                            the first ``rank`` dims written: sum_j p_j c_j

The key of token ``j`` is its whole row and its value the row's first ``rank`` dims: one kernel
reads each latent tile once for both (``c`` [BLOCK_N, BLOCK_C] and ``k_pe`` [BLOCK_N, BLOCK_R],
the two parts padded apart to powers of two, so no 576 -> 1024 padding), for ``BLOCK_H`` heads at
once (the heads are the matmul's M dimension: MLA has one KV head for all of them).

One launch, grid ``(T, cdiv(H, BLOCK_H))``: every row of the step, decode or prefill, is a query
at position ``row_len[r] - 1`` of sequence ``row_seq[r]`` attending to that sequence's tokens
``0 .. row_len[r] - 1`` (a prefill row's causal prefix: the chunk's own rows are written to the
cache before the call); rows with ``row_len == 0`` are skipped. An online softmax (base 2, float32)
walks the context in tiles of ``BLOCK_N`` tokens, each token's block looked up through the block
table (any ``block_size``). A prefill chunk's rows each read their prefix: no tile is shared
across query rows (long prompts pay n^2 / 2 latent reads; not timed on a GPU yet, and no split-K
over the context for decode at batch 1 either).

Caches: float32, float16, bfloat16, and int8 / fp8 with ``scales [num_blocks, 1]`` (value =
stored * scale, one per block and layer, RoPE part included, as ``runner/kv_cache.py`` stores
MLA's 8-bit kinds). Dots: float32 caches IEEE float32, 8-bit caches TF32 (the stored values are
exact in it), float16 / bfloat16 caches their dtype, accumulating in float32; in the interpreter
everything is float32.

Proved in Triton's interpreter against a plain PyTorch reference
(``tests/ops/triton/test_triton_latent.py``), and through ``ModelRunner(attention_backend="triton")``
on tiny DeepSeek models (``tests/models/test_mla_triton.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.ops.triton import interpreting

_FLOAT_CACHES = (torch.float32, torch.float16, torch.bfloat16)
_SCALED_CACHES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@triton.jit
def _fold_tile(start, n, qc, qr, m_i, l_i, acc, c_ptr, sc_ptr, bt_row, bt_s1, c_s0, c_s1, sc_s0, max_blocks,
               offs_c, offs_r, c_mask, r_mask, RANK: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
               SCALED: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr):
    """Tokens ``start .. start + BLOCK_N - 1`` (those below ``n``) folded into the online softmax
    state ``(m_i, l_i, acc)``: each latent row read once, as key (all of it) and value (``c``)."""
    t = start + tl.arange(0, BLOCK_N)
    t_mask = t < n
    idx = t // BLOCK_SIZE
    blk = tl.load(bt_row + idx * bt_s1, mask=t_mask & (idx < max_blocks), other=0).to(tl.int64)
    row = blk * c_s0 + (t % BLOCK_SIZE).to(tl.int64) * c_s1
    c = tl.load(c_ptr + row[:, None] + offs_c[None, :], mask=t_mask[:, None] & c_mask[None, :], other=0.0)
    pe = tl.load(c_ptr + row[:, None] + RANK + offs_r[None, :], mask=t_mask[:, None] & r_mask[None, :], other=0.0)
    c = c.to(DOT_DTYPE)
    s = tl.dot(qc, tl.trans(c), input_precision=DOT_PREC)  # [BLOCK_H, BLOCK_N]
    s += tl.dot(qr, tl.trans(pe.to(DOT_DTYPE)), input_precision=DOT_PREC)
    sc = t_mask.to(tl.float32)  # unused unless SCALED
    if SCALED:
        sc = tl.load(sc_ptr + blk * sc_s0, mask=t_mask, other=0.0)
        s = s * sc[None, :]
    s = tl.where(t_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if SCALED:
        p = p * sc[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), c, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _latent_kernel(
    q_ptr, c_ptr, sc_ptr, bt_ptr, row_seq_ptr, row_len_ptr, out_ptr,
    q_s0, q_s1, c_s0, c_s1, bt_s0, bt_s1, sc_s0, o_s0, o_s1,
    heads, max_blocks, scale,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SCALED: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, INTERPRET: tl.constexpr,
):
    r = tl.program_id(0)
    hb = tl.program_id(1)
    n = tl.load(row_len_ptr + r)
    if n > 0:
        seq = tl.load(row_seq_ptr + r).to(tl.int64)
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_c = tl.arange(0, BLOCK_C)
        offs_r = tl.arange(0, BLOCK_R)
        h_mask = offs_h < heads
        c_mask = offs_c < RANK
        r_mask = offs_r < ROPE
        q_row = q_ptr + r.to(tl.int64) * q_s0 + offs_h[:, None] * q_s1
        qc = tl.load(q_row + offs_c[None, :], mask=h_mask[:, None] & c_mask[None, :], other=0.0)
        qr = tl.load(q_row + RANK + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
        qc = (qc.to(tl.float32) * (scale * 1.4426950408889634)).to(DOT_DTYPE)  # base 2 from here on
        qr = (qr.to(tl.float32) * (scale * 1.4426950408889634)).to(DOT_DTYPE)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
        bt_row = bt_ptr + seq * bt_s0
        if INTERPRET:  # numpy 2 breaks the interpreter's range() over tensor bounds (decode.py)
            start = 0
            while start < n:
                m_i, l_i, acc = _fold_tile(start, n, qc, qr, m_i, l_i, acc, c_ptr, sc_ptr, bt_row, bt_s1, c_s0, c_s1,
                                           sc_s0, max_blocks, offs_c, offs_r, c_mask, r_mask, RANK, BLOCK_SIZE,
                                           BLOCK_N, SCALED, DOT_DTYPE, DOT_PREC)
                start += BLOCK_N
        else:
            for start in range(0, n, BLOCK_N):
                m_i, l_i, acc = _fold_tile(start, n, qc, qr, m_i, l_i, acc, c_ptr, sc_ptr, bt_row, bt_s1, c_s0, c_s1,
                                           sc_s0, max_blocks, offs_c, offs_r, c_mask, r_mask, RANK, BLOCK_SIZE,
                                           BLOCK_N, SCALED, DOT_DTYPE, DOT_PREC)
        acc = acc / l_i[:, None]
        tl.store(out_ptr + r.to(tl.int64) * o_s0 + offs_h[:, None] * o_s1 + offs_c[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & c_mask[None, :])


def latent_attention(out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                     row_seq: torch.Tensor, row_len: torch.Tensor, scale: float, rank: int,
                     scales: torch.Tensor | None = None, *, block_n: int | None = None) -> torch.Tensor:
    """Absorbed MLA attention of every row of ``q [T, H, rank + rope]`` over the latent blocks
    ``cache [num_blocks, block_size, 1, rank + rope]`` (the module docstring): row ``r`` attends to
    tokens ``0 .. row_len[r] - 1`` of block-table row ``row_seq[r]``; ``out[r, :, :rank]`` gets
    ``sum_j p_j c_j`` (the rest of ``out`` and rows with ``row_len == 0`` are left as they are).
    ``scales [num_blocks, 1]`` float32 for an 8-bit cache. Raises ValueError naming what is wrong."""
    if q.dim() != 3 or cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != q.shape[2]:
        raise ValueError(f"latent attention takes q [T, H, d] and one latent head [num_blocks, block_size, 1, d]; "
                         f"got q {tuple(q.shape)}, cache {tuple(cache.shape)}")
    rows, heads, d = q.shape
    if not 0 < rank <= d:
        raise ValueError(f"rank must be in 1..{d} (the latent's kv_lora_rank), got {rank}")
    if out.shape[:2] != q.shape[:2] or out.shape[2] < rank or out.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError(f"out must be [T, H, >= rank] like q {tuple(q.shape)}, last dims contiguous; got "
                         f"{tuple(out.shape)}")
    if cache.stride(3) != 1:
        raise ValueError("cache: the latent dims must be contiguous")
    scaled = cache.dtype in _SCALED_CACHES
    if cache.dtype not in _FLOAT_CACHES and not scaled:
        raise ValueError(f"cache dtype {cache.dtype} is not one the latent kernel reads "
                         f"({', '.join(str(t) for t in _FLOAT_CACHES + _SCALED_CACHES)})")
    if scaled != (scales is not None) or (scales is not None and (scales.dim() != 2 or scales.shape[1] != 1
                                                                  or scales.dtype != torch.float32)):
        raise ValueError("an 8-bit cache takes scales [num_blocks, 1] float32, a float cache none")
    if row_seq.shape != (rows,) or row_len.shape != (rows,):
        raise ValueError(f"row_seq and row_len must be [T] = [{rows}]")
    if rows == 0:
        return out
    block_size = cache.shape[1]
    block_c, block_r = max(16, _next_pow2(rank)), max(16, _next_pow2(d - rank))
    block_h = 16  # the heads as the dots' M dimension (tl.dot needs >= 16): [16, 512] float32 accumulator
    if block_n is None:
        block_n = 16 if block_c >= 512 else 32
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if interpreting() or cache.dtype == torch.float32:
        dot_dtype, dot_prec = tl.float32, "ieee"
    elif scaled:  # the stored values are exact in TF32 (AMD has no TF32: IEEE there)
        dot_dtype, dot_prec = tl.float32, ("tf32" if torch.version.hip is None else "ieee")
    else:
        dot_dtype, dot_prec = (tl.float16 if cache.dtype == torch.float16 else tl.bfloat16), "ieee"
    sc = scales if scales is not None else row_len  # any pointer: never read unless SCALED
    _latent_kernel[(rows, triton.cdiv(heads, block_h))](
        q, cache, sc, block_tables, row_seq, row_len, out,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), *block_tables.stride(),
        scales.stride(0) if scales is not None else 0, out.stride(0), out.stride(1),
        heads, block_tables.shape[1], float(scale),
        RANK=rank, ROPE=d - rank, BLOCK_H=block_h, BLOCK_C=block_c, BLOCK_R=block_r, BLOCK_SIZE=block_size,
        BLOCK_N=block_n, SCALED=scaled, DOT_DTYPE=dot_dtype, DOT_PREC=dot_prec, INTERPRET=interpreting(),
        num_warps=8 if block_c >= 512 else 4,
    )
    return out


__all__ = ["latent_attention"]
