"""Tensor parallelism: one rank's group and the rules that split a model (``group.py``); the
launcher of the ranks. ``group.py`` imports torch and the facts only, so the models and the
runner may use it."""

from pagedkv.distributed.group import (
    COLLECTIVES,
    SINGLE,
    ShardingError,
    TPGroup,
    check_shardable,
    kv_head_range,
    shard_range,
)

__all__ = ["COLLECTIVES", "SINGLE", "ShardingError", "TPGroup", "check_shardable", "kv_head_range", "shard_range"]
