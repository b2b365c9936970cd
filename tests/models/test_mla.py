"""Multi-head latent attention (models/mla.py): tiny random DeepSeek-V2 / V3 checkpoints of odd
shapes against transformers (float32): the cache holds one latent KV head per token and layer, and
the absorbed attention gives transformers' logits and greedy tokens on both attention paths; the
engine on a tiny DeepSeek-V3 (prefix hits, n > 1, beam search, swap and recompute preemption,
fault injection) gives a clean run's outputs with check_integrity() after every step."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv import LLM
from pagedkv.engine import LLMEngine
from pagedkv.model_shape import kv_bytes_per_block
from pagedkv.models import load_model
from pagedkv.models.config import ModelConfig
from pagedkv.ops import native
from pagedkv.runner import ModelRunner, SeqChunk
from pagedkv.sampling_params import SamplingParams
from pagedkv_testing.hf_checkpoints import TinyAllocator, hf_greedy, load_hf_reference
from pagedkv_testing.moe_cases import DEEPSEEK_CASES as CASES
from pagedkv_testing.moe_cases import make_deepseek, transformers_tests
from pagedkv_testing.moe_cases import prompt as _prompt

FULL = os.environ.get("PAGEDKV_MOE_FULL_MATRIX") == "1"  # docs/environment.md


@pytest.fixture(scope="module")
def built() -> dict[str, Any]:
    return {}


def _case(name: str, tmp_path_factory: pytest.TempPathFactory, cache: dict[str, Any]) -> Any:
    if name not in cache:
        version, overrides = CASES[name]
        folder = make_deepseek(tmp_path_factory.mktemp(name), version, seed=len(name), **overrides)
        cache[name] = (load_hf_reference(folder), load_model(str(folder)), folder)
    return cache[name][:2]


@pytest.mark.parametrize("name", list(CASES))
def test_the_cache_head_is_the_latent(name: str, tmp_path_factory: pytest.TempPathFactory,
                                      built: dict[str, Any]) -> None:
    _, loaded = _case(name, tmp_path_factory, built)
    cfg: ModelConfig = loaded.config
    assert cfg.is_mla and cfg.num_key_value_heads == 1 and cfg.head_dim == cfg.latent_dim == 20 + 6
    assert cfg.moe is not None and cfg.moe.sparse_layers == {1, 2}
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg  # what a GGUF conversion writes reads back
    # one latent row of kv_lora_rank + qk_rope_head_dim per token and layer, stored once (K and V)
    assert kv_bytes_per_block(cfg, 16, "float32") == 3 * 16 * 26 * 4
    assert ModelRunner(loaded, block_size=16, num_blocks=10).cache.device_bytes == 10 * 3 * 16 * 26 * 4
    if native.available():  # 8-bit latent blocks: one byte a value, one fp32 scale per block and layer
        runner = ModelRunner(loaded, block_size=16, num_blocks=10, kv_cache_dtype="int8")
        assert runner.cache.device_bytes == 10 * kv_bytes_per_block(cfg, 16, "int8") == 10 * (3 * 16 * 26 + 3 * 4)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_8bit_latent_blocks_stay_close_to_model_precision(kv_dtype: str, tmp_path_factory: pytest.TempPathFactory,
                                                          built: dict[str, Any]) -> None:
    """8-bit latent blocks (per-block scales, RoPE part included): logits of a 45-token prompt
    prefilled in two chunks (the second reads the first's 8-bit blocks) stay within a few percent of
    model-precision blocks, with the same top-1 token almost everywhere."""
    if not native.available():
        pytest.skip("8-bit KV blocks need the native kernels")
    _, loaded = _case("v3_groups", tmp_path_factory, built)
    ids = _prompt(45, loaded.config.vocab_size, 2)
    table = TinyAllocator(16).take(3)

    def logits(kv_dtype: str) -> torch.Tensor:
        runner = ModelRunner(loaded, block_size=16, num_blocks=16, kv_cache_dtype=kv_dtype)
        first = runner.execute([SeqChunk(ids[:20], 0, table)], return_all_logits=True)
        return torch.cat((first, runner.execute([SeqChunk(ids[20:], 20, table)], return_all_logits=True)))

    want, got = logits("auto"), logits(kv_dtype)
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).mean().item()
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    assert rel < 0.05 and top1 >= 0.9, (rel, top1)
    assert not torch.equal(got, want)  # the blocks really were 8-bit


# prefill logits (block sizes 1, 16, 64) and greedy 32 tokens (native, plain) against transformers
test_prefill_logits_whole_and_in_chunks, test_greedy_32_tokens_match_transformers = transformers_tests(
    list(CASES), _case, 45, FULL)


def _workload(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    for i, p in enumerate(prompts):
        if i % 3 == 2:
            params = SamplingParams(temperature=0.9, top_k=40, n=3, seed=i, max_tokens=10, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0, max_tokens=12 + i, ignore_eos=True)
        engine.add_request(f"r{i}", p, params)
    engine.add_request("beam", prompts[0], SamplingParams(max_tokens=5, ignore_eos=True), beam_width=3)
    results: dict[str, list[list[int]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = [c.token_ids for c in out.outputs]
    return results


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_on_latent_blocks_survives_faults(mode: str, tmp_path_factory: pytest.TempPathFactory,
                                                 built: dict[str, Any]) -> None:
    """Prefix hits (a shared prefix), n > 1, beam search, preemption by ``mode`` under seeded
    fault injection on a small pool: every output equals a clean run's, with check_integrity()
    after every step (debug_integrity), and no block stays in use."""
    ref, _ = _case("v3_groups", tmp_path_factory, built)
    folder = built["v3_groups"][2]
    rng = random.Random(2)
    shared = [rng.randrange(3, 256) for _ in range(12)]
    prompts = [shared + [rng.randrange(3, 256) for _ in range(n)] for n in (5, 17, 2, 9, 22, 3)]
    options = dict(block_size=4, num_kv_blocks=36, max_num_batched_tokens=40, swap_space=0.0002,
                   preemption_mode=mode, debug_integrity=True)
    clean = LLMEngine.from_options(str(folder), **{**options, "num_kv_blocks": 400})
    expected = _workload(clean, prompts)
    assert expected["r0"][0] == hf_greedy(ref, prompts[0], 12)
    assert clean.stats().kv.prefix_hit_tokens >= 12 * (len(prompts) - 1) - 12  # the shared prefix's full blocks
    faults = 0
    for seed in range(2):
        engine = LLMEngine.from_options(str(folder), fault_injection=f"seed={seed},rate=0.15", **options)
        assert _workload(engine, prompts) == expected, f"fault seed {seed} changed an output"
        stats = engine.stats()
        assert stats.kv.used_blocks == 0 and stats.kv.host_used_blocks == 0
        faults += stats.faults_fired
    assert faults > 0


@pytest.mark.slow
def test_latent_blocks_through_the_disk_tier_and_speculative_decoding(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, built: dict[str, Any]) -> None:
    """Latent blocks written to the disk tier are served after a restart with the same outputs
    (bit-identical payloads), and n-gram speculative decoding (KV rollback on latent blocks) gives
    the same greedy tokens as plain decoding."""
    _case("v3_groups", tmp_path_factory, built)
    folder = str(built["v3_groups"][2])
    prefix = [(7 * i + 3) % 97 + 5 for i in range(32)]  # 8 blocks
    prompts = [prefix + [200 + 3 * i, 201 + i, 150 + i] for i in range(2)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]

    with LLM(folder, block_size=4, num_kv_blocks=200, enable_prefix_caching=False) as plain:
        reference = run(plain)
    options = dict(block_size=4, num_kv_blocks=40, kv_offloading_size=0.002, debug_integrity=True,
                   kv_offload_dir=str(tmp_path / "kv"))
    with LLM(folder, **options) as first:
        assert run(first) == reference
    with LLM(folder, **options) as second:
        assert run(second) == reference
        assert second.stats().kv.disk_hit_tokens >= len(prefix)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    with LLM(folder, block_size=4, num_kv_blocks=200, speculative_config=spec, debug_integrity=True) as llm:
        assert run(llm) == reference
