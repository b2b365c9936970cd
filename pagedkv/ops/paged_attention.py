"""Paged attention in plain PyTorch: batched decode and (chunked) prefill over a block-table cache.

Decode (one new token per sequence, ``B`` sequences of ragged lengths, padded to ``L`` slots) is
memory bound: the time goes into reading K and V. So each is read as few times as plain PyTorch
allows, with every index built once per step (``DecodeMetadata``) and shared by all layers::

    K: index_select rows (slot * kv_heads + h) of the cache   -> k_buf [B * kv_heads, L, d]  (head-major)
       baddbmm(q [B * kv_heads, group, d], k_buf^T) + mask    -> scores [B * kv_heads, group, L] = [B, H, L]
       softmax over L (padding slots hold -inf)
    V: embedding_bag(rows (slot * kv_heads + kv_head(h)), weights = probabilities, mode="sum")
       gathers and reduces V straight from the cache: no [B, L, ...] copy of V is ever made.

Padding slots point at row 0 (any valid row): their score is -inf and their weight exactly 0.
The cache is zero-initialised and only ever holds finite values, so 0 * V stays 0.

Prefill (``n`` new tokens after ``start_pos`` cached ones): new tokens attend causally to the cached
prefix and to themselves; key ``j`` is visible to query ``i`` iff ``j <= start_pos + i``.

``softcap`` c (Gemma 2) bounds each scaled score s to ``c * tanh(s / c)`` before the mask and the
softmax; torch's SDPA has no such step, so capped prefills take an explicit softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedkv.ops import native


@dataclass(slots=True)
class DecodeMetadata:
    """Per-step gather indices, padding mask and the K buffer for batched decode."""

    k_rows: torch.Tensor  # [B * kv_heads * L] int64: cache row (slot * kv_heads + h) per (seq, h, pos)
    v_rows: torch.Tensor  # [B * heads, L] int64: cache row per (seq, query head, pos)
    mask: torch.Tensor  # [B * kv_heads, 1, L] float: 0 for context slots, -inf for padding
    k_buf: torch.Tensor  # [B * kv_heads * L, head_dim], reused by every layer
    num_seqs: int
    padded_len: int

    @classmethod
    def build(cls, block_tables: list[list[int]], context_lens: list[int], *, block_size: int,
              num_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
              sliding_window: int | None = None) -> DecodeMetadata:
        """``context_lens[i]`` = tokens of sequence i (cached + the new one); with ``sliding_window``
        only the last ``sliding_window`` of them are visible."""
        b, heads = len(context_lens), num_heads
        max_blocks = max((n + block_size - 1) // block_size for n in context_lens)
        padded = [t[: (n + block_size - 1) // block_size] for t, n in zip(block_tables, context_lens)]
        tables = torch.tensor([r + [0] * (max_blocks - len(r)) for r in padded], dtype=torch.long)
        length = max(context_lens)
        pos = torch.arange(length)
        lens = torch.tensor(context_lens).view(-1, 1)
        valid = pos.view(1, -1) < lens  # [B, L]
        if sliding_window is not None:
            valid &= pos.view(1, -1) >= lens - sliding_window
        slots = tables[:, pos // block_size] * block_size + pos % block_size  # [B, L]
        slots = torch.where(valid, slots, 0)
        k_rows = slots.view(b, 1, length) * kv_heads + torch.arange(kv_heads).view(1, kv_heads, 1)
        kv_of_head = torch.arange(heads) // (heads // kv_heads)  # [heads]
        v_rows = slots.view(b, 1, length) * kv_heads + kv_of_head.view(1, heads, 1)  # [B, heads, L]
        mask = torch.zeros(b, 1, 1, length, dtype=dtype).masked_fill(~valid.view(b, 1, 1, length), -math.inf)
        return cls(
            k_rows=k_rows.reshape(-1),
            v_rows=v_rows.reshape(b * heads, length),
            mask=mask.expand(b, kv_heads, 1, length).reshape(b * kv_heads, 1, length).contiguous(),
            k_buf=torch.empty(b * kv_heads * length, head_dim, dtype=dtype),
            num_seqs=b,
            padded_len=length,
        )


def paged_decode_attention(
    q: torch.Tensor,  # [B, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    meta: DecodeMetadata,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query per sequence against its whole paged context; returns ``[B, heads, head_dim]``."""
    b, heads, d = q.shape
    kvh = k_cache.shape[2]
    if meta.v_rows.shape[0] != b * heads:
        raise ValueError(f"DecodeMetadata was built for {meta.v_rows.shape[0] // b} heads, q has {heads}")
    length = meta.padded_len
    torch.index_select(k_cache.view(-1, d), 0, meta.k_rows, out=meta.k_buf)
    keys = meta.k_buf.view(b * kvh, length, d)  # [B * kv_heads, L, d]
    alpha = scale if scale is not None else d ** -0.5
    if softcap:
        scores = torch.bmm(q.reshape(b * kvh, heads // kvh, d), keys.transpose(1, 2)).mul_(alpha / softcap)
        scores = scores.tanh_().mul_(softcap).add_(meta.mask)
    else:
        scores = torch.baddbmm(meta.mask, q.reshape(b * kvh, heads // kvh, d), keys.transpose(1, 2),
                               alpha=alpha)  # [B * kv_heads, group, L]
    probs = torch.softmax(scores, dim=-1).view(b * heads, length)
    out = F.embedding_bag(meta.v_rows, v_cache.view(-1, d), mode="sum", per_sample_weights=probs)
    return out.view(b, heads, d)


def paged_prefill_attention(
    q: torch.Tensor,  # [n, heads, head_dim] new tokens' queries
    k: torch.Tensor,  # [n, kv_heads, head_dim] new tokens' keys (already written to the cache)
    v: torch.Tensor,  # [n, kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [>= ceil((start_pos + n) / block_size)] int64
    start_pos: int,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of ``n`` new tokens over ``start_pos`` cached tokens plus themselves.

    With ``sliding_window`` w, query i sees key j only when ``i - w < j`` (Mistral's rule).
    """
    n, heads, d = q.shape
    kvh = k.shape[1]
    gqa = heads != kvh
    # 4-D inputs: torch's CPU flash kernel (2-3x faster than the math path 3-D inputs take)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
    windowed = sliding_window is not None and start_pos + n > sliding_window
    if start_pos == 0 and not windowed and not softcap:  # no cached prefix: the fresh K/V are the whole context
        out = F.scaled_dot_product_attention(qh, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                             is_causal=True, scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)
    ctx = start_pos + n
    block_size = k_cache.shape[1]
    blocks = block_table[: (ctx + block_size - 1) // block_size]
    keys = k_cache.index_select(0, blocks).view(-1, kvh, d)[:ctx]  # [ctx, kv_heads, d]
    values = v_cache.index_select(0, blocks).view(-1, kvh, d)[:ctx]
    query_pos = (torch.arange(n) + start_pos).view(n, 1)
    key_pos = torch.arange(ctx).view(1, ctx)
    mask = key_pos <= query_pos  # [n, ctx]
    if windowed:  # sliding_window is set: not tested again per layer
        mask &= key_pos > query_pos - sliding_window  # type: ignore[operator]
    if softcap:
        return _capped_attention(q, keys, values, mask, scale if scale is not None else d ** -0.5, softcap)
    out = F.scaled_dot_product_attention(qh, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
                                         attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)  # [n, heads, d]


def _capped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float, softcap: float) -> torch.Tensor:
    """Softmax attention with soft-capped scores: q ``[n, heads, d]``, keys/values ``[ctx, kv_heads,
    d]``, mask ``[n, ctx]`` (True: visible) -> ``[n, heads, d]``."""
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, d]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.bmm(q.transpose(0, 1), k.transpose(1, 2)).mul_(scale / softcap).tanh_().mul_(softcap)
    scores.masked_fill_(~mask, float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), v).transpose(0, 1)  # [n, heads, d]


@dataclass(frozen=True, slots=True)
class QuantBlocks:
    """A mixed pool's 8-bit blocks of one layer: block ``b >= base`` is ``k_quant[b - base] *
    k_scales[b - base, kv_head]`` (V alike); ids below ``base`` are the float caches'. ``k_base``:
    K's own base where it differs from V's (``kv_quant_parts`` "v": every block's K in the float
    ``k_cache``, ``k_quant`` and ``k_scales`` with 0 blocks)."""

    k_quant: torch.Tensor  # [num_blocks - key_base, block_size, kv_heads, head_dim] int8 / fp8
    v_quant: torch.Tensor  # [num_blocks - base, ...]
    k_scales: torch.Tensor  # [num_blocks - key_base, kv_heads] float32
    v_scales: torch.Tensor
    base: int
    k_base: int | None = None

    @property
    def key_base(self) -> int:
        """Block ids below it hold K at full precision (the float ``k_cache``)."""
        return self.base if self.k_base is None else self.k_base


def blocks_as_float(ids: torch.Tensor, full: torch.Tensor | None, quant: torch.Tensor | None,
                    scales: torch.Tensor | None, base: int, dtype: torch.dtype) -> torch.Tensor:
    """A pool's blocks ``ids`` (sorted int64) read each in its format into a ``dtype`` cache
    ``[base + num_quant, block_size, kv_heads, head_dim]`` that the plain kernels above read: block
    ``b < base`` is ``full[b]`` (any float dtype), block ``b >= base`` is ``quant[b - base] *
    scales[b - base]`` per KV head (8-bit). A mixed pool gives both; an 8-bit pool ``full`` None and
    ``base`` 0; a float pool ``quant`` None. Only ``ids`` are filled (the step reads no other)."""
    ref = full if full is not None else quant
    assert ref is not None  # one of the two storages
    out = torch.empty(base + (quant.shape[0] if quant is not None else 0), *ref.shape[1:], dtype=dtype,
                      device=ref.device)
    ids = ids.to(ref.device)
    cut = int(torch.searchsorted(ids, base))
    if full is not None:
        out.index_copy_(0, ids[:cut], full.index_select(0, ids[:cut]).to(dtype))
    if quant is not None and scales is not None:
        local = ids[cut:] - base
        raw = quant.view(torch.uint8) if quant.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else quant
        values = raw.index_select(0, local).view(quant.dtype).float() * scales.index_select(0, local)[:, None, :, None]
        out.index_copy_(0, ids[cut:], values.to(dtype))
    return out


@dataclass(slots=True)
class NativeMetadata:
    """Per-step inputs of the native kernel, shared by every layer: each token row's sequence (a
    row of ``block_tables``) and visible length (position + 1; 0: the row is attended elsewhere)."""

    block_tables: torch.Tensor  # [seqs, max_blocks] int32
    row_seq: torch.Tensor  # [rows] int32
    row_len: torch.Tensor  # [rows] int32
    num_rows: int  # rows with row_len > 0

    @classmethod
    def build(cls, tables: list[list[int]], row_seq: list[int], row_len: list[int]) -> NativeMetadata:
        width = max((len(t) for t in tables), default=1) or 1
        return cls(torch.tensor([t + [0] * (width - len(t)) for t in tables] or [[0]], dtype=torch.int32),
                   torch.tensor(row_seq, dtype=torch.int32), torch.tensor(row_len, dtype=torch.int32),
                   sum(1 for n in row_len if n > 0))


def native_paged_attention(
    out: torch.Tensor,  # [rows, heads, head_dim]: rows with row_len > 0 are written
    q: torch.Tensor,  # [rows, heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: NativeMetadata,
    scale: float | None = None,
    sliding_window: int | None = None,
    k_scales: torch.Tensor | None = None,  # [num_blocks, kv_heads] float32: 8-bit caches only
    v_scales: torch.Tensor | None = None,
    softcap: float | None = None,
    quant: QuantBlocks | None = None,
) -> torch.Tensor:
    """Attention of each row over its sequence's first ``row_len`` cached tokens (the last
    ``sliding_window`` of them), reading K and V blocks in place (``csrc/paged_attention.cpp``;
    needs ``pagedkv.ops.native.available()``). Caches: float32, float16, bfloat16, or int8 /
    fp8 (e4m3, e5m2) with their per-block scales, dequantized inside the kernel; or, with
    ``quant``, a mixed pool: block ids below ``quant.base`` in the float ``k_cache``/``v_cache``,
    the others 8-bit in ``quant`` (the format of a block is its id's range; K's range ends at
    ``quant.key_base``, the length of ``k_cache``). Accumulates in float32; returns ``out``."""
    if not native.available():  # loads (or builds) the kernel on first use; a dict lookup after
        raise RuntimeError(f"the native paged-attention kernel is unavailable: {native.why_unavailable()}")
    d = q.shape[-1]
    qf = q.float().contiguous() if q.dtype != torch.float32 or not q.is_contiguous() else q
    target = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32)
    alpha = scale if scale is not None else d ** -0.5
    if quant is not None:  # a mixed pool: ids from quant.base are 8-bit blocks of k_quant / v_quant
        if not hasattr(torch.ops.pagedkv, "paged_attention_mixed"):
            raise RuntimeError("the native kernels were built without paged_attention_mixed (an older build): "
                               "rebuild them with 'python -m pagedkv.ops.native'")
        if k_cache.shape[0] != quant.key_base or v_cache.shape[0] != quant.base:  # (the kernel reads them so)
            raise ValueError(f"a mixed pool's float caches hold the ids below its bases: k_cache {k_cache.shape[0]} "
                             f"blocks for key_base {quant.key_base}, v_cache {v_cache.shape[0]} for base {quant.base}")
        torch.ops.pagedkv.paged_attention_mixed(target, qf, k_cache, v_cache, quant.k_quant, quant.v_quant,
                                                quant.k_scales, quant.v_scales, meta.block_tables, meta.row_seq,
                                                meta.row_len, alpha, sliding_window or 0, softcap or 0.0)
    else:
        torch.ops.pagedkv.paged_attention(target, qf, k_cache, v_cache, meta.block_tables, meta.row_seq,
                                          meta.row_len, alpha, sliding_window or 0, k_scales, v_scales,
                                          softcap or 0.0)
    if target is not out:
        rows = meta.row_len > 0
        out[rows] = target[rows].to(out.dtype)
    return out
