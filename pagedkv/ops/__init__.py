"""Paged-KV operators: cache writes, paged attention, block copy and swap, in plain PyTorch, and
the native CPU kernel that attends blocks in place (``native``, ``native_paged_attention``)."""

from pagedkv.ops.cache_ops import copy_blocks, swap_blocks, write_kv
from pagedkv.ops.paged_attention import (
    DecodeMetadata,
    NativeMetadata,
    native_paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
)
from pagedkv.ops.reference import reference_attention

__all__ = [
    "DecodeMetadata", "NativeMetadata", "copy_blocks", "native_paged_attention",
    "paged_decode_attention", "paged_prefill_attention",
    "reference_attention", "swap_blocks", "write_kv",
]
