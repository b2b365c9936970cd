"""EngineConfig and SamplingParams: bad values raise ValueError naming the field."""

import pytest

from pagedkv.engine import EngineConfig
from pagedkv.engine.faults import FaultInjector, FaultSpec
from pagedkv.sampling_params import SamplingParams


@pytest.mark.parametrize("field,value", [
    ("block_size", 0), ("block_size", 300), ("max_num_seqs", 0), ("max_num_batched_tokens", -1),
    ("kv_cache_memory", "lots"), ("kv_cache_memory", 0), ("num_kv_blocks", 0), ("swap_space", -1),
    ("watermark", 1.0), ("preemption_mode", "kill"), ("eviction_policy", "random"),
    ("prefix_index", "trie"), ("dtype", "int4"), ("fault_injection", "rate=2"), ("max_model_len", 0),
])
def test_engine_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field if field != "fault_injection" else "rate"):
        EngineConfig(**{field: value})


def test_engine_config_rejects_unknown_and_conflicting_options():
    with pytest.raises(TypeError, match="unknown engine option"):
        EngineConfig.from_options(None, blocksize=16)
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(kv_cache_memory="1GiB", num_kv_blocks=10)


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("max_tokens", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("min_p", 2.0), ("logprobs", 21), ("stop", [""]), ("seed", "x"),
])
def test_sampling_params_name_the_bad_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_fault_injection_is_deterministic_per_seed():
    def draws(seed):
        inj = FaultInjector(FaultSpec.parse(f"seed={seed},rate=0.3,kinds=recompute+evict"))
        return [inj.draw() for _ in range(200)]

    assert draws(7) == draws(7) != draws(8)
    assert set(draws(7)) == {None, "recompute", "evict"}
    with pytest.raises(ValueError, match="kinds"):
        FaultSpec.parse("kinds=meteor")
