"""Paged-KV operators in plain PyTorch: cache writes, paged attention, block copy and swap."""

from pagedkv.ops.cache_ops import copy_blocks, swap_blocks, write_kv
from pagedkv.ops.paged_attention import DecodeMetadata, paged_decode_attention, paged_prefill_attention
from pagedkv.ops.reference import reference_attention

__all__ = [
    "DecodeMetadata", "copy_blocks", "paged_decode_attention", "paged_prefill_attention",
    "reference_attention", "swap_blocks", "write_kv",
]
