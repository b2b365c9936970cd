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
"""

from __future__ import annotations

import torch

from pagedkv.model_shape import check_block_size, kv_bytes_per_block, kv_groups
from pagedkv.models.config import ModelConfig
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


def bytes_per_block(config: ModelConfig, block_size: int, kv_dtype: str | torch.dtype = torch.float32) -> int:
    """Bytes one block of :class:`KVCache` takes across all layers, K and V, scales included
    (:func:`pagedkv.model_shape.kv_bytes_per_block`). ``kv_dtype``: a KV kind or torch dtype
    (:func:`pagedkv.ops.kv_format.kv_format`). Raises ValueError for a bad ``block_size`` or kind."""
    return kv_bytes_per_block(config, block_size, kv_format(kv_dtype).name)


def num_blocks_for_memory(config: ModelConfig, block_size: int, memory: str | int,
                          kv_dtype: str | torch.dtype = torch.float32) -> int:
    """How many blocks fit in ``memory`` (a size string or bytes); at least 1 or ValueError."""
    per_block = bytes_per_block(config, block_size, kv_dtype)
    n = parse_memory_size(memory) // per_block
    if n < 1:
        raise ValueError(
            f"kv_cache_memory {memory!r} is smaller than one block "
            f"({per_block} bytes at block_size={block_size})"
        )
    return n


class KVCache:
    """The device pool (``kv``, ``scales``) and the host pool (``host_kv``, ``host_scales``; may
    have 0 blocks). ``scales``/``host_scales`` are None for the float formats."""

    def __init__(self, config: ModelConfig, *, block_size: int, num_blocks: int, num_host_blocks: int = 0,
                 dtype: str | torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
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
        self.groups = kv_groups(config)
        self.group_of = [0] * config.num_hidden_layers  # layer -> its KV group
        self.slot_of = [0] * config.num_hidden_layers  # layer -> its slot in a block
        for g, group in enumerate(self.groups):
            for slot, layer in enumerate(group.layers):
                self.group_of[layer], self.slot_of[layer] = g, slot
        layers, kvh = max(len(g.layers) for g in self.groups), config.num_key_value_heads
        shape = (layers, 2, block_size, kvh, config.head_dim)
        self.kv = torch.zeros(shape[:2] + (num_blocks,) + shape[2:], dtype=self.dtype, device=device)
        pin = torch.device(device).type == "cuda"  # pinned host blocks: faster swaps to and from the GPU
        self.host_kv = torch.zeros(shape[:2] + (num_host_blocks,) + shape[2:], dtype=self.dtype, pin_memory=pin)
        self.scales: torch.Tensor | None = None
        self.host_scales: torch.Tensor | None = None
        if self.format.scaled:
            self.scales = torch.zeros(layers, 2, num_blocks, kvh, dtype=torch.float32, device=device)
            self.host_scales = torch.zeros(layers, 2, num_host_blocks, kvh, dtype=torch.float32)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer, each ``[num_blocks, block_size, kv_heads, head_dim]`` (views)."""
        slot = self.slot_of[layer_idx]
        return self.kv[slot, 0], self.kv[slot, 1]

    def layer_scales(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(K, V) scales of one layer, each ``[num_blocks, kv_heads]`` (views), or (None, None)."""
        if self.scales is None:
            return None, None
        slot = self.slot_of[layer_idx]
        return self.scales[slot, 0], self.scales[slot, 1]

    @property
    def device_bytes(self) -> int:
        return _bytes(self.kv) + _bytes(self.scales)

    @property
    def host_bytes(self) -> int:
        return _bytes(self.host_kv) + _bytes(self.host_scales)

    def __repr__(self) -> str:
        return (f"KVCache(block_size={self.block_size}, num_blocks={self.num_blocks}, "
                f"num_host_blocks={self.num_host_blocks}, kv_dtype={self.format.name}, "
                f"device_bytes={self.device_bytes})")


def _bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()
