"""Runs a model on the paged KV cache: step input (SeqChunk), KV cache pools, ModelRunner."""

from pagedkv.runner.batch import SeqChunk
from pagedkv.runner.kv_cache import KVCache, bytes_per_block, num_blocks_for_memory, parse_memory_size
from pagedkv.runner.model_runner import ModelRunner
from pagedkv.runner.step_inputs import BatchError

__all__ = [
    "BatchError", "KVCache", "ModelRunner", "SeqChunk", "bytes_per_block", "num_blocks_for_memory",
    "parse_memory_size",
]
