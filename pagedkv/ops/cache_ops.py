"""KV-cache writes, copy-on-write block copies and host <-> device block swaps (plain PyTorch).

Layout of one layer's cache (K and V each)::

    [num_blocks, block_size, kv_heads, head_dim]
     block b, offset o  <->  slot b * block_size + o

The runner keeps all layers in one tensor ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``
so a block copy or swap moves every layer's K and V in one indexed copy (and, for the 8-bit
formats, the block's scales ``[num_layers, 2, num_blocks, kv_heads]`` in a second).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedkv.ops.kv_format import KVFormat, dequantize, kv_format, quantize


def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64 slot of each new token
) -> None:
    """Store new tokens' K and V at their slots (``slot = block_id * block_size + offset``)."""
    kvh, d = k_cache.shape[-2:]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def write_kv_scaled(
    cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim] int8 / fp8
    scales: torch.Tensor,  # [num_blocks, kv_heads] float32
    x: torch.Tensor,  # [T, kv_heads, head_dim] new tokens' K (or V)
    slot_mapping: torch.Tensor,  # [T] int64
    error: torch.Tensor,  # [2] float64: += sum((dequantized - x)^2), sum(x^2)
) -> None:
    """Quantize new tokens into an 8-bit cache, growing their blocks' scales as needed (native
    kernel; the rule is in :mod:`pagedkv.ops.kv_format`). Without the native kernels the same rule
    in plain PyTorch (:func:`write_kv_scaled_plain`)."""
    if not hasattr(torch.ops.pagedkv, "write_kv_scaled"):
        write_kv_scaled_plain(cache, scales, x, slot_mapping, error)
        return
    torch.ops.pagedkv.write_kv_scaled(cache, scales, x.float().contiguous(), slot_mapping, error)


def write_kv_scaled_plain(cache: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor,
                          error: torch.Tensor) -> None:
    """:func:`write_kv_scaled` in plain PyTorch, run by run (the plain backend's write; the native
    kernel is the fast one): the tokens split into runs of consecutive slots of one block; a run at
    offset 0 opens its block (scale = the run's absmax / qmax per KV head), a later run whose
    absmax needs a larger scale requantizes the block's filled rows to it; new values are stored as
    ``quantize(x, scale)``."""
    fmt = _SCALED_FORMATS[cache.dtype]
    assert fmt.qmax is not None  # an 8-bit format
    block_size = cache.shape[1]
    raw = _raw(cache)
    slots = slot_mapping.tolist()
    xf = x.float()
    e2 = r2 = 0.0
    i = 0
    while i < len(slots):
        b, first = divmod(slots[i], block_size)
        j = i + 1
        while j < len(slots) and slots[j] == slots[j - 1] + 1 and slots[j] // block_size == b:
            j += 1
        run = xf[i:j]  # [n, kv_heads, d]
        need = torch.nan_to_num(run.abs(), nan=0.0).amax(dim=(0, 2)).clamp(max=torch.finfo(torch.float32).max)
        need = need / fmt.qmax
        old = scales[b]
        if first == 0:
            scale = need
        else:
            scale = torch.maximum(old, need)
            grow = need > old
            if bool(grow.any()):  # requantize the filled rows of the heads whose scale grows
                ratio = torch.where(grow, old / torch.where(grow, need, 1.0), 1.0)  # as the C++ loop: q(v * ratio)
                ones = torch.ones_like(ratio)[None, :, None]
                again = quantize(cache[b, :first].float() * ratio[None, :, None], fmt, ones)
                raw[b, :first] = torch.where(grow[None, :, None], _raw(again), raw[b, :first])
        scales[b] = scale
        stored = quantize(run, fmt, scale[None, :, None])
        raw[b, first:first + (j - i)] = _raw(stored)
        diff = dequantize(stored, fmt, scale[None, :, None]).double() - run.double()
        finite = torch.isfinite(diff)
        e2 += float(torch.where(finite, diff * diff, 0.0).sum())
        r2 += float(torch.where(finite, run.double() ** 2, 0.0).sum())
        i = j
    error += torch.tensor([e2, r2], dtype=torch.float64, device=error.device)


_SCALED_FORMATS = {kv_format(k).storage: kv_format(k) for k in ("int8", "fp8_e4m3", "fp8_e5m2")}


def _raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or its bytes for dtypes torch's CPU indexing ops do not cover (fp8)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _pairs_to_index(pairs: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.tensor([p[0] for p in pairs], dtype=torch.long)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.long)
    return src, dst


def copy_blocks(kv: torch.Tensor, pairs: Sequence[tuple[int, int]], scales: torch.Tensor | None = None) -> None:
    """Copy-on-write: block ``src`` -> block ``dst`` for every (src, dst) pair, in every layer.

    ``kv`` is ``[num_layers, 2, num_blocks, ...]``, ``scales`` (8-bit formats) ``[num_layers, 2,
    num_blocks, kv_heads]``: a block's scales go with it. All sources are read before any
    destination is written, so a block may be both a source and (of another pair) a destination.
    """
    if not pairs:
        return
    src, dst = _pairs_to_index(pairs)
    if len(set(dst.tolist())) != len(dst):
        raise ValueError("copy_blocks: a destination block appears twice")
    src, dst = src.to(kv.device), dst.to(kv.device)
    for t in (_raw(kv),) if scales is None else (_raw(kv), scales):
        t.index_copy_(2, dst, t.index_select(2, src))


@dataclass(frozen=True, slots=True)
class MixedBlocks:
    """One pool of a mixed cache (``runner/kv_cache.py``) as block moves see it: ``full_kv`` and
    ``quant_kv`` ``[num_layers, 2, blocks, ...]`` (model dtype; 8-bit, with ``scales [num_layers, 2,
    blocks, kv_heads]``). The device pool (``host_full`` None) places block ``b`` by its id: below
    ``full_kv``'s block count in ``full_kv``, else at ``b - that`` in ``quant_kv``. A host pool holds
    both storages for every block id and ``host_full[b]`` says which one block ``b`` was last
    written in (a host block keeps the format its device block had)."""

    full_kv: torch.Tensor
    quant_kv: torch.Tensor
    scales: torch.Tensor
    host_full: list[bool] | None = None

    def read(self, b: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Block ``b``'s data (a copy) and, 8-bit, its scales."""
        if self.host_full is not None:
            if self.host_full[b]:
                return self.full_kv[:, :, b].clone(), None
            return _raw(self.quant_kv)[:, :, b].clone(), self.scales[:, :, b].clone()
        base = self.full_kv.shape[2]
        if b < base:
            return self.full_kv[:, :, b].clone(), None
        return _raw(self.quant_kv)[:, :, b - base].clone(), self.scales[:, :, b - base].clone()

    def write(self, b: int, data: torch.Tensor, scale: torch.Tensor | None, fmt: KVFormat) -> None:
        """Store a block read by :meth:`read` at ``b``: as it is where the formats agree (a host
        block takes the source's), else converted: 8-bit into full precision exactly, full
        precision into 8-bit with fresh absmax scales per (layer, K/V, KV head)."""
        if self.host_full is not None:
            self.host_full[b] = scale is None
            full, local = scale is None, b
        else:
            base = self.full_kv.shape[2]
            full, local = b < base, (b if b < base else b - base)
        if full:
            if scale is not None:  # 8-bit -> full precision: exact
                data = dequantize(data.view(self.quant_kv.dtype), fmt, scale[:, :, None, :, None])
            self.full_kv[:, :, local] = data.to(self.full_kv.dtype)
        elif scale is not None:
            _raw(self.quant_kv)[:, :, local] = data
            self.scales[:, :, local] = scale
        else:  # full precision -> 8-bit: [layers, 2, block_size, kv_heads, d], absmax per head
            new_scale = data.float().abs().amax(dim=(2, 4)) / fmt.qmax  # type: ignore[operator]  # 8-bit: qmax set
            _raw(self.quant_kv)[:, :, local] = _raw(quantize(data, fmt, new_scale[:, :, None, :, None]))
            self.scales[:, :, local] = new_scale


def move_blocks_mixed(src: MixedBlocks, dst: MixedBlocks, pairs: Sequence[tuple[int, int]], fmt: KVFormat) -> None:
    """Block ``s`` of ``src`` -> block ``d`` of ``dst`` for every pair, every layer (copy-on-write
    within the device pool, swaps between it and the host pool), each block converted where the
    destination's format differs (:meth:`MixedBlocks.write`). All sources are read before any
    destination is written."""
    if not pairs:
        return
    if len({d for _, d in pairs}) != len(pairs):
        raise ValueError("copy_blocks: a destination block appears twice")
    read = [src.read(s) for s, _ in pairs]
    for (data, scale), (_, d) in zip(read, pairs):
        dst.write(d, data, scale, fmt)


def mixed_payloads(pool: MixedBlocks, block_ids: Sequence[int]) -> list[bytes]:
    """A mixed pool's blocks as disk-tier payloads, all one size: a format byte (1: full
    precision, 0: 8-bit), then :func:`block_payloads`'s bytes of that format (scales after the
    8-bit K/V), zero-padded to the larger format's size. :func:`load_mixed_payloads` is the inverse."""
    full_bytes, quant_bytes = _mixed_payload_sizes(pool)
    size = max(full_bytes, quant_bytes)
    out = []
    for b in block_ids:
        data, scale = pool.read(b)
        if scale is None:
            body = block_payloads(data.unsqueeze(2), [0])[0]
        else:
            body = block_payloads(data.view(pool.quant_kv.dtype).unsqueeze(2), [0], scale.unsqueeze(2))[0]
        out.append(bytes([scale is None]) + body + bytes(size - len(body)))
    return out


def load_mixed_payloads(pool: MixedBlocks, pairs: Sequence[tuple[int, bytes]], fmt: KVFormat) -> None:
    """Write ``(block id, payload)`` pairs made by :func:`mixed_payloads` into a mixed pool (a host
    pool keeps each block's format); ValueError, writing nothing, for a payload of another size or
    format byte."""
    full_bytes, quant_bytes = _mixed_payload_sizes(pool)
    size = 1 + max(full_bytes, quant_bytes)
    for _, payload in pairs:
        if len(payload) != size or payload[0] not in (0, 1):
            raise ValueError(f"a mixed KV block payload has {len(payload)} bytes (format byte {payload[:1]!r}); "
                             f"this pool's take {size}, format byte 0 or 1")
    layers, pairs_kv = pool.full_kv.shape[:2]
    for block_id, payload in pairs:
        if payload[0]:
            data = torch.empty_like(pool.full_kv[:, :, :1])
            load_block_payloads(data, [(0, payload[1:1 + full_bytes])])
            pool.write(block_id, data[:, :, 0], None, fmt)
        else:
            data = torch.empty_like(pool.quant_kv[:, :, :1])
            scale = torch.empty(layers, pairs_kv, 1, pool.scales.shape[-1], dtype=pool.scales.dtype)
            load_block_payloads(data, [(0, payload[1:1 + quant_bytes])], scale)
            pool.write(block_id, _raw(data[:, :, 0]), scale[:, :, 0], fmt)


def _mixed_payload_sizes(pool: MixedBlocks) -> tuple[int, int]:
    """Bytes of one block's payload in each format (full precision; 8-bit with its scales)."""
    def per_block(t: torch.Tensor) -> int:  # (a pool may hold no block at all)
        return math.prod(n for i, n in enumerate(t.shape) if i != 2) * t.element_size()

    return per_block(pool.full_kv), per_block(pool.quant_kv) + per_block(pool.scales)


def copy_blocks_mixed(full_kv: torch.Tensor, quant_kv: torch.Tensor, scales: torch.Tensor, fmt: KVFormat,
                      pairs: Sequence[tuple[int, int]]) -> None:
    """Copy-on-write in a mixed device pool (:class:`MixedBlocks`): block ``src`` -> block ``dst``,
    every layer; within one storage a plain copy (scales with the 8-bit blocks), across them the
    block is converted (:meth:`MixedBlocks.write`)."""
    pool = MixedBlocks(full_kv, quant_kv, scales)
    move_blocks_mixed(pool, pool, pairs, fmt)


def swap_blocks(src_kv: torch.Tensor, dst_kv: torch.Tensor, pairs: Sequence[tuple[int, int]],
                src_scales: torch.Tensor | None = None, dst_scales: torch.Tensor | None = None) -> None:
    """Move blocks between two pools (device -> host or back): ``dst_kv[..., d, ...] = src_kv[..., s, ...]``,
    and their scales (8-bit formats) likewise.

    Both tensors are ``[num_layers, 2, num_blocks_of_that_pool, block_size, kv_heads, head_dim]``.
    """
    if not pairs:
        return
    if (src_scales is None) != (dst_scales is None):
        raise ValueError("swap_blocks: both pools or neither hold scales")
    src, dst = _pairs_to_index(pairs)
    if len(set(dst.tolist())) != len(dst):
        raise ValueError("swap_blocks: a destination block appears twice")
    pools: list[tuple[torch.Tensor, torch.Tensor | None]] = [(_raw(src_kv), _raw(dst_kv))]
    if src_scales is not None:
        pools.append((src_scales, dst_scales))
    for a, b in pools:
        assert a is not None and b is not None
        b.index_copy_(2, dst.to(b.device), a.index_select(2, src.to(a.device)).to(b.device, non_blocking=False))


def block_payloads(kv: torch.Tensor, block_ids: Sequence[int], scales: torch.Tensor | None = None) -> list[bytes]:
    """Each block's bytes, for the disk tier: its K/V ``[num_layers, 2, block_size, kv_heads,
    head_dim]`` in the pool's storage format, then (8-bit formats) its scales ``[num_layers, 2,
    kv_heads]`` float32, both C-contiguous. :func:`load_block_payloads` is the inverse."""
    if not block_ids:
        return []
    index = torch.tensor(list(block_ids), dtype=torch.long)
    index = index.to(kv.device)
    parts = [_raw(kv).index_select(2, index).movedim(2, 0).contiguous().cpu()]
    if scales is not None:
        parts.append(scales.index_select(2, index).movedim(2, 0).contiguous().cpu())
    out = []
    for i in range(len(block_ids)):
        out.append(b"".join(p[i].view(torch.uint8).numpy().tobytes() for p in parts))
    return out


def load_block_payloads(kv: torch.Tensor, pairs: Sequence[tuple[int, bytes]],
                        scales: torch.Tensor | None = None) -> None:
    """Write ``(block id, payload)`` pairs made by :func:`block_payloads` into a pool; raises
    ValueError, writing nothing, when a payload's size does not match the pool's block."""
    if not pairs:
        return
    raw = _raw(kv)
    kv_bytes = raw[:, :, 0].numel() * raw.element_size()
    scale_bytes = 0 if scales is None else scales[:, :, 0].numel() * scales.element_size()
    for _, payload in pairs:
        if len(payload) != kv_bytes + scale_bytes:
            raise ValueError(f"a KV block payload has {len(payload)} bytes; this pool's blocks take "
                             f"{kv_bytes + scale_bytes}")
    for block_id, payload in pairs:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        raw[:, :, block_id] = data[:kv_bytes].view(raw.dtype).view(raw[:, :, block_id].shape)
        if scales is not None:
            scales[:, :, block_id] = data[kv_bytes:].view(scales.dtype).view(scales[:, :, block_id].shape)
