"""EngineConfig and SamplingParams: bad values raise ValueError naming the field."""

import pytest

from pagedkv.engine import EngineConfig
from pagedkv.engine.faults import FaultInjector, FaultSpec
from pagedkv.sampling_params import SamplingParams


@pytest.mark.parametrize("field,value", [
    ("block_size", 0), ("block_size", 300), ("max_num_seqs", 0), ("max_num_batched_tokens", -1),
    ("kv_cache_memory", "lots"), ("kv_cache_memory", 0), ("num_kv_blocks", 0), ("swap_space", -1),
    ("kv_offloading_size", -0.5), ("kv_offloading_size", float("nan")), ("kv_cache_dtype", "int4"),
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
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(kv_offloading_size=1.0, swap_space=1.0)
    with pytest.raises(ValueError, match="not both"):  # given at the default's value is still given
        EngineConfig(kv_offloading_size=0.5, swap_space=1.0)


def test_host_tier_size_is_kv_offloading_size_or_its_alias_swap_space():
    assert EngineConfig().kv_offloading_size == 0.5
    assert EngineConfig(kv_offloading_size=2).kv_offloading_size == 2.0
    assert EngineConfig(swap_space=0.25).kv_offloading_size == 0.25
    assert EngineConfig(kv_offloading_size=0).kv_offloading_size == 0.0


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


def test_every_engine_option_has_a_flag_with_its_default():
    import argparse
    import dataclasses

    from pagedkv.engine.flags import add_engine_arguments, engine_options

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    flags = {a.dest: a for a in parser._actions if a.dest != "help"}
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model"}
    assert set(flags) == fields
    assert engine_options(parser.parse_args([])) == {}
    args = parser.parse_args(["--prefix-index", "radix", "--watermark", "0.05", "--debug-integrity",
                              "--fault-injection", "seed=1,rate=0.1", "--kv-cache-memory", "64MiB"])
    config = EngineConfig.from_options(None, **engine_options(args))
    assert (config.prefix_index, config.watermark, config.debug_integrity) == ("radix", 0.05, True)
    assert config.fault_injection == "seed=1,rate=0.1" and config.kv_cache_memory == "64MiB"
