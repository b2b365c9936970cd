"""KV-cache tensors: a device pool and a host pool for swapped-out blocks, and their sizing.

Both pools hold every layer in one tensor::

    [num_layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]

so ``kv[layer, 0]`` is one layer's K cache ``[num_blocks, block_size, kv_heads, head_dim]``. A hybrid
model (full and sliding-window layers, ``model_shape.kv_groups``) has ``group size`` slots in place
of ``num_layers``: layer ``l`` of group ``g`` lives in slot ``slot_of[l]``, and each group has its
own block tables, so one block id means one block of tokens of one group's layers. The 8-bit
formats (int8, fp8) also hold ``scales [num_layers, 2, num_blocks, kv_heads]`` float32, one per block,
layer, K/V and KV head (see :mod:`pagedkv.ops.kv_format`): the block's quantization descriptor,
indexed by the same block id, so a copy-on-write copy or a swap moves it with the block. The bytes
of one block come from :mod:`pagedkv.model_shape` (the one KV-bytes formula); a test checks that they
equal what these tensors take.

A mixed pool (an 8-bit kind with ``full_blocks`` F > 0: sink blocks and full-precision requests
at model precision beside 8-bit blocks) holds two storages, and a block's format is its id's range::

    ids [0, F)        kv        [num_layers, 2, F, block_size, kv_heads, head_dim]  model dtype
    ids [F, F + Q)    quant_kv  [num_layers, 2, Q, ...]  8-bit, scales [num_layers, 2, Q, kv_heads]

so one block table mixes formats and every kernel picks a block's from its id (``quant_base`` = F;
:class:`LayerBlocks`). Each storage keeps today's layout, and an all-float or all-8-bit pool is
exactly today's (``quant_base`` = num_blocks or 0).

``quant_parts="v"`` (``kv_quant_parts``: V 8-bit, K at the model dtype) splits K from V: K of every
block lies in one model-dtype tensor, and V is a mixed pool of its own (F >= 0 full-precision
blocks, the sink blocks and full-precision requests'; the rest 8-bit)::

    all ids           keys      [num_layers, 1, F + Q, block_size, kv_heads, head_dim]  model dtype
    ids [0, F)        kv        [num_layers, 1, F, ...]  V, model dtype
    ids [F, F + Q)    quant_kv  [num_layers, 1, Q, ...]  V 8-bit, scales [num_layers, 1, Q, kv_heads]

so a block's K is read in place, its V by its id's range (:class:`LayerBlocks` ``k_base`` = F + Q,
``base`` = F), and a block move is a plain copy of K plus the mixed move of V (:meth:`KVCache.copy`,
:meth:`KVCache.swap`, :meth:`KVCache.payloads`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedkv.model_shape import check_block_size, check_kv_quant_parts, kv_bytes_per_block, kv_groups, mixed_block_split
from pagedkv.models.config import ModelConfig
from pagedkv.ops.cache_ops import (
    MixedBlocks,
    block_payloads,
    copy_blocks,
    copy_blocks_mixed,
    load_block_payloads,
    load_mixed_payloads,
    mixed_payloads,
    move_blocks_mixed,
    swap_blocks,
)
from pagedkv.ops.kv_format import KVFormat, kv_format
from pagedkv.units import parse_bytes


def parse_memory_size(value: str | int) -> int:
    """Bytes from an int or a string like ``"2GiB"``, ``"512 MB"``, ``"1.5g"``; raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"kv_cache_memory must be bytes or a size string, got {value!r}")
    size = value if isinstance(value, int) else parse_bytes(value, "kv_cache_memory")
    if size <= 0:
        raise ValueError(f"kv_cache_memory must be > 0 bytes, got {value!r}")
    return size


def bytes_per_block(config: ModelConfig, block_size: int, kv_dtype: str | torch.dtype = torch.float32,
                    k_dtype: str | torch.dtype | None = None) -> int:
    """Bytes one block of :class:`KVCache` takes across all layers, K and V, scales included
    (:func:`pagedkv.model_shape.kv_bytes_per_block`). ``kv_dtype``: a KV kind or torch dtype
    (:func:`pagedkv.ops.kv_format.kv_format`); ``k_dtype``: K's kind where it differs (``quant_parts``
    "v": the model dtype). Raises ValueError for a bad ``block_size`` or kind."""
    k_name = kv_format(k_dtype).name if k_dtype is not None else None
    return kv_bytes_per_block(config, block_size, kv_format(kv_dtype).name, k_dtype=k_name)


def num_blocks_for_memory(config: ModelConfig, block_size: int, memory: str | int,
                          kv_dtype: str | torch.dtype = torch.float32, k_dtype: str | torch.dtype | None = None) -> int:
    """How many blocks fit in ``memory`` (a size string or bytes); at least 1 or ValueError."""
    per_block = bytes_per_block(config, block_size, kv_dtype, k_dtype)
    n = parse_memory_size(memory) // per_block
    if n < 1:
        raise ValueError(
            f"kv_cache_memory {memory!r} is smaller than one block "
            f"({per_block} bytes at block_size={block_size})"
        )
    return n


def host_bytes_per_block(config: ModelConfig, block_size: int, kv_dtype: str, full_dtype: str | None,
                         k_dtype: str | None = None) -> int:
    """Bytes one host block takes: a mixed pool's (``full_dtype`` given) hold both formats (with
    ``k_dtype``, K at the model dtype, only V has two: K's bytes once)."""
    own = bytes_per_block(config, block_size, kv_dtype, k_dtype)
    if full_dtype is None:
        return own
    full = bytes_per_block(config, block_size, full_dtype)
    return own + (full // 2 if k_dtype is not None else full)  # (K and V of a full block: equal halves)


def mixed_split(config: ModelConfig, block_size: int, memory: str | int, kv_dtype: str, full_dtype: str,
                full_fraction: float, k_dtype: str | None = None) -> tuple[int, int]:
    """(full-precision blocks, 8-bit blocks) of a mixed pool in ``memory``: a ``full_fraction``
    share of the blocks (at least 1) at ``full_dtype``, the rest at ``kv_dtype`` (K at ``k_dtype``
    where given). ValueError when not even one block of each fits."""
    full = bytes_per_block(config, block_size, full_dtype)
    quant = bytes_per_block(config, block_size, kv_dtype, k_dtype)
    num_full, num_quant = mixed_block_split(parse_memory_size(memory), full, quant, full_fraction)
    if num_quant < 1:
        raise ValueError(f"kv_cache_memory {memory!r} holds no 8-bit block beside {num_full} full-precision ones "
                         f"({full} and {quant} bytes a block at block_size={block_size}); give more memory "
                         f"or kv_sink_blocks=0")
    return num_full, num_quant


@dataclass(frozen=True, slots=True)
class LayerBlocks:
    """Where one layer's blocks lie (views). A single-format pool: ``k``/``v`` ``[num_blocks,
    block_size, kv_heads, head_dim]`` (with ``k_scales``/``v_scales`` ``[num_blocks, kv_heads]``
    for the 8-bit kinds), ``k_quant`` None. A mixed pool: block ``b < base`` is ``k[b]``, block
    ``b >= base`` is ``k_quant[b - base] * k_scales[b - base, kv_head]`` (V alike). ``k_base``: K's
    own base where it differs (``quant_parts`` "v": every block's K in ``k``, ``k_quant`` empty)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None
    v_scales: torch.Tensor | None
    k_quant: torch.Tensor | None = None
    v_quant: torch.Tensor | None = None
    base: int = 0
    k_base: int | None = None

    @property
    def mixed(self) -> bool:
        return self.k_quant is not None

    @property
    def key_base(self) -> int:
        """Block ids below it hold K at full precision in ``k``."""
        return self.base if self.k_base is None else self.k_base


class KVCache:
    """The device pool (``kv``, ``scales``) and the host pool (``host_kv``, ``host_scales``; may
    have 0 blocks). ``scales``/``host_scales`` are None for the float formats.

    ``full_blocks`` > 0 with an 8-bit ``dtype`` makes a mixed pool (module docstring): block ids
    ``[0, full_blocks)`` at ``full_dtype`` (the model dtype), the other ``num_blocks - full_blocks``
    8-bit (``quant_kv``; ``scales`` indexed by id - ``quant_base``). Its host pool holds both
    storages for every host block (``host_kv``, ``host_quant_kv``, ``host_scales``) and
    ``host_full[h]``: a swapped block keeps its format there (``ops/cache_ops.MixedBlocks``).

    ``quant_parts="v"`` (an 8-bit ``dtype``): V 8-bit, K of every block at ``full_dtype`` in
    ``keys`` (host: ``host_keys``); ``kv``/``quant_kv``/``scales`` then hold V alone (one part, not
    two) as a mixed pool with ``full_blocks`` >= 0 (module docstring). ValueError for a bad value,
    or on an MLA model (its one latent is K and V at once).

    ``host_full`` False: the full-precision device blocks never leave the device (``kv_recent_block``'s
    shadows, with no sink blocks): the host pool and the payloads hold 8-bit blocks alone, as an
    all-8-bit pool's (the same payload bytes: a disk tier serves either)."""

    def __init__(self, config: ModelConfig, *, block_size: int, num_blocks: int, num_host_blocks: int = 0,
                 dtype: str | torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 full_blocks: int = 0, full_dtype: str | torch.dtype = torch.float32,
                 quant_parts: str = "kv", host_full: bool = True) -> None:
        check_block_size(block_size)
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.format: KVFormat = kv_format(dtype)
        self.dtype = self.format.storage
        self.bytes_per_block = bytes_per_block(config, block_size, self.format.name)
        self.full_format: KVFormat = kv_format(full_dtype)
        self.quant_kv: torch.Tensor | None = None  # a mixed pool's 8-bit storage
        self.host_quant_kv: torch.Tensor | None = None  # and its host pool's
        self.host_full: list[bool] = []  # a mixed pool's host blocks: which storage holds each
        self.quant_parts = check_kv_quant_parts(quant_parts, self.format.name, "quant_parts")
        self.keys: torch.Tensor | None = None  # quant_parts "v": K of every block, model dtype
        self.host_keys: torch.Tensor | None = None
        if self.quant_parts == "v":
            if getattr(config, "is_mla", False):
                raise ValueError("kv_quant_parts 'v' splits K from V; an MLA model's one latent is both: use "
                                 "kv_quant_parts kv")
            if self.full_format.scaled:
                raise ValueError(f"kv_quant_parts 'v' keeps K at the model dtype: it needs a float model dtype, "
                                 f"got {self.full_format.name}")
            if not 0 <= full_blocks < num_blocks:
                raise ValueError(f"full_blocks must be in [0, num_blocks - 1] = [0, {num_blocks - 1}] with "
                                 f"quant_parts 'v', got {full_blocks}")
        elif full_blocks:
            if not self.format.scaled or self.full_format.scaled:
                raise ValueError(f"a mixed KV pool needs an 8-bit kv_cache_dtype and a float model dtype, got "
                                 f"{self.format.name} and {self.full_format.name}")
            if not 0 < full_blocks < num_blocks:
                raise ValueError(f"full_blocks must be in [1, num_blocks - 1] = [1, {num_blocks - 1}] for a "
                                 f"mixed pool, got {full_blocks}")
        # ids below quant_base are full precision (model dtype), the others 8-bit
        self.quant_base = full_blocks if full_blocks else (0 if self.format.scaled else num_blocks)
        self.host_full_blocks = bool(full_blocks) and host_full  # host blocks (and payloads) may be full precision
        self.groups = kv_groups(config)
        self.group_of = [0] * config.num_hidden_layers  # layer -> its KV group
        self.slot_of = [0] * config.num_hidden_layers  # layer -> its slot in a block
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layers):
                self.group_of[layer], self.slot_of[layer] = g, slot
        layers, kvh = max(len(g.layers) for g in self.groups), config.num_key_value_heads
        pairs = 1 if getattr(config, "is_mla", False) else 2  # MLA: one latent serves as K and V
        shape = (layers, pairs, block_size, kvh, config.head_dim)
        self.scales: torch.Tensor | None = None
        self.host_scales: torch.Tensor | None = None
        if self.quant_parts == "v":
            self._init_v_parts(config, shape, full_blocks, device)
            return
        if full_blocks:
            full_bytes = bytes_per_block(config, block_size, self.full_format.name)
            self.bytes_per_full_block, self.bytes_per_quant_block = full_bytes, self.bytes_per_block
            # the mean, so that blocks * bytes_per_block is the pool's bytes
            self.bytes_per_block = -(-(full_blocks * full_bytes + (num_blocks - full_blocks) * self.bytes_per_block)
                                     // num_blocks)
            num_quant = num_blocks - full_blocks
            self.kv = torch.zeros(shape[:2] + (full_blocks,) + shape[2:], dtype=self.full_format.storage,
                                  device=device)
            self.quant_kv = torch.zeros(shape[:2] + (num_quant,) + shape[2:], dtype=self.dtype, device=device)
            self.scales = torch.zeros(layers, pairs, num_quant, kvh, dtype=torch.float32, device=device)
            # the host pool holds either format in every block (both storages; host_full says which)
            pin = torch.device(device).type == "cuda"
            host = shape[:2] + (num_host_blocks,) + shape[2:]
            full_host = shape[:2] + ((num_host_blocks if host_full else 0),) + shape[2:]
            self.host_kv = torch.zeros(full_host, dtype=self.full_format.storage, pin_memory=pin)
            self.host_quant_kv = torch.zeros(host, dtype=self.dtype, pin_memory=pin)
            self.host_scales = torch.zeros(layers, pairs, num_host_blocks, kvh, dtype=torch.float32)
            self.host_full = [False] * num_host_blocks
            return
        self.kv = torch.zeros(shape[:2] + (num_blocks,) + shape[2:], dtype=self.dtype, device=device)
        pin = torch.device(device).type == "cuda"  # pinned host blocks: faster swaps to and from the GPU
        self.host_kv = torch.zeros(shape[:2] + (num_host_blocks,) + shape[2:], dtype=self.dtype, pin_memory=pin)
        if self.format.scaled:
            self.scales = torch.zeros(layers, pairs, num_blocks, kvh, dtype=torch.float32, device=device)
            self.host_scales = torch.zeros(layers, pairs, num_host_blocks, kvh, dtype=torch.float32)

    def _init_v_parts(self, config: ModelConfig, shape: tuple[int, ...], full_blocks: int,
                      device: torch.device | str) -> None:
        """``quant_parts`` "v": K of every block in ``keys``, V as a mixed pool of one part."""
        layers, _, block_size, kvh, d = shape
        num_quant, num_host = self.num_blocks - full_blocks, self.num_host_blocks
        part = (layers, 1)
        full_dtype = self.full_format.storage
        full_bytes = bytes_per_block(config, block_size, self.full_format.name)
        self.bytes_per_full_block = full_bytes
        self.bytes_per_quant_block = bytes_per_block(config, block_size, self.format.name, self.full_format.name)
        # the mean, so that blocks * bytes_per_block is the pool's bytes
        self.bytes_per_block = -(-(full_blocks * full_bytes + num_quant * self.bytes_per_quant_block)
                                 // self.num_blocks)
        self.keys = torch.zeros(part + (self.num_blocks, block_size, kvh, d), dtype=full_dtype, device=device)
        self.kv = torch.zeros(part + (full_blocks, block_size, kvh, d), dtype=full_dtype, device=device)
        self.quant_kv = torch.zeros(part + (num_quant, block_size, kvh, d), dtype=self.dtype, device=device)
        self.scales = torch.zeros(part + (num_quant, kvh), dtype=torch.float32, device=device)
        # K's 0 8-bit blocks: the kernels' K storage past k_base (never read)
        self._no_k_quant = torch.zeros(0, block_size, kvh, d, dtype=self.dtype, device=device)
        self._no_k_scales = torch.zeros(0, kvh, dtype=torch.float32, device=device)
        pin = torch.device(device).type == "cuda"
        host = (num_host, block_size, kvh, d)
        self.host_keys = torch.zeros(part + host, dtype=full_dtype, pin_memory=pin)
        # V's host blocks hold either format (host_full says which); no full-precision V without F
        self.host_kv = torch.zeros(part + ((num_host if self.host_full_blocks else 0),) + host[1:], dtype=full_dtype,
                                   pin_memory=pin)
        self.host_quant_kv = torch.zeros(part + host, dtype=self.dtype, pin_memory=pin)
        self.host_scales = torch.zeros(part + (num_host, kvh), dtype=torch.float32)
        self.host_full = [False] * num_host

    @property
    def is_mixed(self) -> bool:
        """Whether the pool mixes formats (``quant_kv`` is set): full-precision and 8-bit blocks, or
        ``quant_parts`` "v"."""
        return self.quant_kv is not None

    def block_format(self, block_id: int) -> KVFormat:
        """The format block ``block_id`` is stored in."""
        return self.full_format if block_id < self.quant_base else self.format

    def layer_blocks(self, layer_idx: int) -> LayerBlocks:
        """Where one layer's blocks lie, whatever the pool (:class:`LayerBlocks`)."""
        slot = self.slot_of[layer_idx]
        k_scales, v_scales = self.layer_scales(layer_idx)
        if self.keys is not None:  # quant_parts "v": K of every block in keys, V mixed
            assert self.quant_kv is not None
            return LayerBlocks(self.keys[slot, 0], self.kv[slot, 0], self._no_k_scales, v_scales, self._no_k_quant,
                               self.quant_kv[slot, 0], self.quant_base, self.num_blocks)
        if self.quant_kv is None:
            return LayerBlocks(self.kv[slot, 0], self.kv[slot, -1], k_scales, v_scales, base=self.quant_base)
        return LayerBlocks(self.kv[slot, 0], self.kv[slot, -1], k_scales, v_scales, self.quant_kv[slot, 0],
                           self.quant_kv[slot, -1], self.quant_base)

    def mixed_blocks(self, host: bool = False) -> MixedBlocks:
        """A mixed pool's device (or host) blocks as block moves see them."""
        assert self.quant_kv is not None and self.scales is not None and self.host_quant_kv is not None
        assert self.host_scales is not None  # a mixed pool has all four
        if host:
            return MixedBlocks(self.host_kv, self.host_quant_kv, self.host_scales, self.host_full)
        return MixedBlocks(self.kv, self.quant_kv, self.scales)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer, each ``[num_blocks, block_size, kv_heads, head_dim]`` (views; a
        mixed pool's full-precision blocks only: see :meth:`layer_blocks`)."""
        slot = self.slot_of[layer_idx]
        return self.kv[slot, 0], self.kv[slot, -1]  # (MLA: one latent, K's view twice)

    def layer_scales(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(K, V) scales of one layer, each ``[num_blocks, kv_heads]`` (views), or (None, None)."""
        if self.scales is None:
            return None, None
        slot = self.slot_of[layer_idx]
        return self.scales[slot, 0], self.scales[slot, -1]

    def copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write in a mixed pool: block ``src`` -> ``dst`` for each pair, every layer, each
        block keeping its destination's format (``ops/cache_ops.copy_blocks_mixed``; ``quant_parts``
        "v": K copied as it is)."""
        assert self.quant_kv is not None and self.scales is not None  # a mixed pool
        if self.keys is not None:
            copy_blocks(self.keys, pairs)
        copy_blocks_mixed(self.kv, self.quant_kv, self.scales, self.format, pairs)

    def swap(self, pairs: Sequence[tuple[int, int]], to_host: bool) -> None:
        """A mixed pool's swap: (device, host) pairs out to the host pool, or (host, device) pairs
        back in; each block keeps its format on the host, and comes back in its device block's
        (``ops/cache_ops.move_blocks_mixed``)."""
        if self.keys is not None:
            assert self.host_keys is not None
            swap_blocks(*((self.keys, self.host_keys) if to_host else (self.host_keys, self.keys)), pairs)
        move_blocks_mixed(self.mixed_blocks(host=not to_host), self.mixed_blocks(host=to_host), pairs, self.format)

    def payloads(self, block_ids: Sequence[int], host: bool = False) -> list[bytes]:
        """A mixed pool's blocks (device or host) as disk-tier payloads, all one size: the mixed
        layout of ``ops/cache_ops.mixed_payloads`` (format byte 1 full precision, 0 8-bit). With
        ``quant_parts`` "v": format byte 2 (V full precision) or 3 (V 8-bit), K's bytes, then V's
        (scales after 8-bit V), zero-padded to the larger V; the other bytes than "kv"'s, so a
        payload of one pool is refused by the other's :meth:`load_host_payloads`."""
        pool = self.mixed_blocks(host)
        if self.keys is None and not self.host_full_blocks:  # 8-bit blocks alone: an all-8-bit pool's bytes
            assert self.host_quant_kv is not None and self.quant_kv is not None
            if host:
                return block_payloads(self.host_quant_kv, block_ids, self.host_scales)
            return block_payloads(self.quant_kv, [b - self.quant_base for b in block_ids], self.scales)
        if self.keys is None:
            return mixed_payloads(pool, block_ids)
        keys = self.host_keys if host else self.keys
        assert keys is not None
        v_size = self._v_payload_size()
        return [bytes([_V_FULL if v[0] else _V_QUANT]) + k + v[1:v_size]
                for k, v in zip(block_payloads(keys, block_ids), mixed_payloads(pool, block_ids))]

    def load_host_payloads(self, pairs: Sequence[tuple[int, bytes]]) -> None:
        """Write ``(host block, payload)`` pairs made by :meth:`payloads` into a mixed pool's host
        blocks, each in the format its payload names; ValueError, writing nothing, for a payload of
        another size or format byte (another pool's)."""
        if self.keys is None and not self.host_full_blocks:
            assert self.host_quant_kv is not None
            load_block_payloads(self.host_quant_kv, pairs, self.host_scales)
            for h, _ in pairs:
                self.host_full[h] = False
            return
        if self.keys is None:
            load_mixed_payloads(self.mixed_blocks(host=True), pairs, self.format)
            return
        assert self.host_keys is not None
        assert self.keys is not None
        k_size = self.keys[:, :, 0].numel() * self.keys.element_size()  # one block's K, every layer
        v_size, padded = self._v_payload_size(), self._v_payload_size(padded=True)
        allowed = (_V_FULL, _V_QUANT) if self.host_full_blocks else (_V_QUANT,)
        for _, payload in pairs:
            if len(payload) != k_size + v_size or payload[0] not in allowed:
                raise ValueError(f"a KV block payload (kv_quant_parts v) has {len(payload)} bytes (format byte "
                                 f"{payload[:1]!r}); this pool's take {k_size + v_size}, format byte "
                                 f"{' or '.join(map(str, allowed))}")
        keys = [(h, p[1:1 + k_size]) for h, p in pairs]
        values = [(h, bytes([p[0] == _V_FULL]) + p[1 + k_size:] + bytes(padded - v_size)) for h, p in pairs]
        load_block_payloads(self.host_keys, keys)
        load_mixed_payloads(self.mixed_blocks(host=True), values, self.format)

    def _v_payload_size(self, padded: bool = False) -> int:
        """``quant_parts`` "v": bytes of V's part of a payload (format byte included): as
        ``mixed_payloads`` pads it, or (not ``padded``) to the 8-bit size where the pool holds no
        full-precision V."""
        assert self.quant_kv is not None and self.scales is not None
        per_block = (self.quant_kv[:, :, :1].numel() * self.quant_kv.element_size()
                     + self.scales[:, :, :1].numel() * self.scales.element_size())
        full = self.quant_kv[:, :, :1].numel() * self.full_format.storage.itemsize
        return 1 + (max(per_block, full) if padded or self.host_full_blocks else per_block)

    @property
    def device_bytes(self) -> int:
        return _bytes(self.kv) + _bytes(self.quant_kv) + _bytes(self.scales) + _bytes(self.keys)

    @property
    def host_bytes(self) -> int:
        return _bytes(self.host_kv) + _bytes(self.host_quant_kv) + _bytes(self.host_scales) + _bytes(self.host_keys)

    def __repr__(self) -> str:
        return (f"KVCache(block_size={self.block_size}, num_blocks={self.num_blocks}, "
                f"num_host_blocks={self.num_host_blocks}, kv_dtype={self.format.name}, "
                + (f"full_blocks={self.quant_base} ({self.full_format.name}), " if self.is_mixed else "")
                + ("quant_parts=v, " if self.keys is not None else "") +
                f"device_bytes={self.device_bytes})")


_V_FULL, _V_QUANT = 2, 3  # quant_parts "v" payloads' format bytes ("kv" pools: 1 and 0)


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@dataclass(slots=True)
class _Shadow:
    slot: int  # the shadow's block id (a full-precision id of the runner's pool)
    filled: int  # rows of its block written so far (all of them in the shadow too)
    used: int  # the step that last wrote it (least recently used: reclaimed first)


class RecentShadows:
    """``kv_recent_block``: which 8-bit blocks (the tail block of a sequence, while it fills) are
    also held at model precision in a shadow block, ids ``[first, first + count)`` of the pool's
    full-precision range. The runner reads a block through its shadow while it has a valid one
    and writes the shadow into the 8-bit block when the block fills, when the shadow is
    reclaimed (:attr:`evicted`) and before a block move reads the 8-bit block (the 8-bit block is
    complete whenever anything but the kernels reads it, so a block without a shadow is always
    correct, only rounded). A shadow is valid
    while every row of its block since offset 0 went through it: a write at offset 0 takes a
    fresh one, a write elsewhere keeps it only where the shadow holds every row before it
    (``filled`` >= the write's offset: it follows on, or rewrites rows, as a speculative step's
    rejected tokens are), and any other way a block id gets data (copy, swap-in) drops it (the
    runner's movers call :meth:`drop`)."""

    def __init__(self, first: int, count: int) -> None:
        if count < 1:
            raise ValueError(f"a recent-block shadow pool needs >= 1 block, got {count}")
        self.first, self.count = first, count
        self.free = list(range(first + count - 1, first - 1, -1))  # popped from the end: lowest id first
        self.of: dict[int, _Shadow] = {}  # block id -> its shadow
        self.step = 0
        self.written_through = 0  # block writes that went through a shadow (tests, stats)
        # (shadow, block) of shadows reclaimed by assign: the runner stores each into its block first
        self.evicted: list[tuple[int, int]] = []

    def drop(self, block: int) -> None:
        """Block ``block`` loses its shadow (if any); the shadow is free again."""
        shadow = self.of.pop(block, None)
        if shadow is not None:
            self.free.append(shadow.slot)

    def assign(self, block: int, busy: set[int], reclaim: bool) -> int | None:
        """A fresh shadow for ``block`` (its id), or None where none is free and ``reclaim`` is
        off or every holder is ``busy`` (written this step); with ``reclaim`` the least recently
        used holder outside ``busy`` loses its shadow (it reads its 8-bit block from then on)."""
        self.drop(block)
        if not self.free:
            victims = [b for b in self.of if b not in busy] if reclaim else []
            if not victims:
                return None
            victim = min(victims, key=lambda b: self.of[b].used)
            self.evicted.append((self.of[victim].slot, victim))
            self.drop(victim)
        slot = self.free.pop()
        self.of[block] = _Shadow(slot, 0, self.step)
        return slot

    def plan_writes(self, writes: Sequence[tuple[int, int, int]], block_size: int) -> tuple[list[int], list[int]]:
        """One step's writes ``(block, first row, end row)`` (8-bit blocks only): each block's
        shadow kept, taken or dropped by the rules above, ``filled`` set to ``end``. A block that
        stays partly filled may reclaim a shadow and is served first; one that fills within the step
        takes a free one only. Returns (the fresh shadows, to be zeroed before use: a block's 8-bit copy is
        rounded by its absmax over all rows; the blocks written through a shadow)."""
        self.step += 1
        busy = {b for b, _, _ in writes}
        fresh, through = [], []
        for block, first, end in sorted(writes, key=lambda w: w[2] >= block_size):  # the tails first
            if first == 0:
                slot = self.assign(block, busy, reclaim=end < block_size)
                if slot is not None:
                    fresh.append(slot)
            elif block in self.of and self.of[block].filled < first:
                self.drop(block)  # rows that went by another way: stale
            shadow = self.of.get(block)
            if shadow is not None:
                shadow.filled, shadow.used = end, self.step
                through.append(block)
        through = [b for b in dict.fromkeys(through) if b in self.of]  # (a block written twice: once)
        self.written_through += len(through)
        return fresh, through

    def take_evicted(self) -> list[tuple[int, int]]:
        """The (shadow, block) pairs reclaimed since the last call (their rows still only in the
        shadow: store them before the shadow is reused)."""
        evicted, self.evicted = self.evicted, []
        return evicted

    def read_id(self, block: int) -> int:
        """The id the kernels read block ``block`` by: its shadow's, or its own."""
        shadow = self.of.get(block)
        return block if shadow is None else shadow.slot
