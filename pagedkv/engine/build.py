"""From an EngineConfig to a ModelRunner: load the model, size the device and host KV pools."""

from __future__ import annotations

import logging

from pagedkv.engine.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig

logger = logging.getLogger(__name__)


def build_runner(config: EngineConfig):
    """Load the model and size its KV pools: returns (runner, tokenizer, model name,
    max_position_embeddings, model identity). The identity (``models/identity.py``) is computed only
    for the disk tier's fingerprint, else None."""
    import torch

    from pagedkv.models import load_model
    from pagedkv.models.dtype import resolve_dtype
    from pagedkv.models.loader import resolve_model_path
    from pagedkv.ops.kv_format import kv_format
    from pagedkv.runner import ModelRunner, bytes_per_block
    from pagedkv.runner.kv_cache import num_blocks_for_memory

    if config.threads:
        torch.set_num_threads(config.threads)
    path, _ = resolve_model_path(config.model)
    dtype = getattr(torch, resolve_dtype(config.dtype, path))
    kv_dtype = kv_format(config.kv_cache_dtype, dtype).name
    loaded = load_model(config.model, dtype=dtype, quantization=config.quantization)
    per_block = bytes_per_block(loaded.config, config.block_size, kv_dtype)  # scales included
    device_blocks = config.num_kv_blocks or num_blocks_for_memory(
        loaded.config, config.block_size, config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY, kv_dtype)
    if config.swap_space is not None:
        logger.warning("swap_space is deprecated: it is an alias of kv_offloading_size (--kv-offloading-size), "
                       "the size of the host tier in GiB")
    # More host blocks than 4x the device pool buy nothing.
    host_blocks = min(int(config.host_tier_gib * (1 << 30)) // per_block, 4 * device_blocks)
    runner = ModelRunner(loaded, block_size=config.block_size, num_blocks=device_blocks,
                         num_host_blocks=host_blocks, kv_cache_dtype=kv_dtype)
    identity = None
    if config.kv_offload_dir is not None:
        from pagedkv.models.identity import model_identity
        identity = model_identity(loaded.path)
    return runner, loaded.tokenizer, loaded.name, loaded.config.max_position_embeddings, identity
