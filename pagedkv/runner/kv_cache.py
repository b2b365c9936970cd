"""KV-cache tensors: a device pool and a host pool for swapped-out blocks, and their sizing.

Both pools hold every layer in one tensor::

    [num_layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]

so ``kv[layer, 0]`` is one layer's K cache ``[num_blocks, block_size, kv_heads, head_dim]``. The bytes
of one block come from :mod:`pagedkv.model_shape` (the one KV-bytes formula); a test checks that they
equal what these tensors take.
"""

from __future__ import annotations

import torch

from pagedkv.model_shape import SCALED_KV_DTYPES, check_block_size, kv_bytes_per_block
from pagedkv.models.config import ModelConfig
from pagedkv.units import parse_bytes


def parse_memory_size(value: str | int) -> int:
    """Bytes from an int or a string like ``"2GiB"``, ``"512 MB"``, ``"1.5g"``; raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"kv_cache_memory must be bytes or a size string, got {value!r}")
    size = value if isinstance(value, int) else parse_bytes(value, "kv_cache_memory")
    if size <= 0:
        raise ValueError(f"kv_cache_memory must be > 0 bytes, got {value!r}")
    return size


def _kv_dtype_name(dtype: torch.dtype) -> str:
    """torch's name of ``dtype`` (``"float16"``), which :mod:`pagedkv.model_shape` reads."""
    return str(dtype).removeprefix("torch.")


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes one block of :class:`KVCache` takes across all layers, K and V
    (:func:`pagedkv.model_shape.kv_bytes_per_block`). Raises ValueError for a bad ``block_size``
    and for KV kinds with per-block scales (int8), which these pools do not hold."""
    name = _kv_dtype_name(dtype)
    if name in SCALED_KV_DTYPES:
        raise ValueError(f"KVCache holds no per-block scales: {name} KV is not supported")
    return kv_bytes_per_block(config, block_size, name)


def num_blocks_for_memory(config: ModelConfig, block_size: int, memory: str | int,
                          dtype: torch.dtype = torch.float32) -> int:
    """How many blocks fit in ``memory`` (a size string or bytes); at least 1 or ValueError."""
    n = parse_memory_size(memory) // bytes_per_block(config, block_size, dtype)
    if n < 1:
        raise ValueError(
            f"kv_cache_memory {memory!r} is smaller than one block "
            f"({bytes_per_block(config, block_size, dtype)} bytes at block_size={block_size})"
        )
    return n


class KVCache:
    """The device pool (``kv``) and the host pool (``host_kv``, may have 0 blocks)."""

    def __init__(self, config: ModelConfig, *, block_size: int, num_blocks: int, num_host_blocks: int = 0,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        check_block_size(block_size)
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.dtype = dtype
        shape = (config.num_hidden_layers, 2, block_size, config.num_key_value_heads, config.head_dim)
        self.kv = torch.zeros(shape[:2] + (num_blocks,) + shape[2:], dtype=dtype, device=device)
        pin = False  # CPU-only development machines: pinned memory buys nothing
        self.host_kv = torch.zeros(shape[:2] + (num_host_blocks,) + shape[2:], dtype=dtype, pin_memory=pin)

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer, each ``[num_blocks, block_size, kv_heads, head_dim]`` (views)."""
        return self.kv[layer_idx, 0], self.kv[layer_idx, 1]

    @property
    def device_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def __repr__(self) -> str:
        return (f"KVCache(block_size={self.block_size}, num_blocks={self.num_blocks}, "
                f"num_host_blocks={self.num_host_blocks}, dtype={self.dtype}, "
                f"device_bytes={self.device_bytes})")
