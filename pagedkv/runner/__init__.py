"""Runs a model on the paged KV cache: step input (SeqChunk), KV cache pools, ModelRunner, and the
``Runner`` protocol the engine types against (``protocol.py``)."""

from pagedkv.runner.batch import SeqChunk
from pagedkv.runner.kv_cache import KVCache, bytes_per_block, num_blocks_for_memory, parse_memory_size
from pagedkv.runner.model_runner import ModelRunner
from pagedkv.runner.protocol import Runner
from pagedkv.runner.step_inputs import BatchError

__all__ = [
    "BatchError", "KVCache", "ModelRunner", "Runner", "SeqChunk", "bytes_per_block", "num_blocks_for_memory",
    "parse_memory_size",
]
