"""Gemma 3 and Gemma 2 against transformers on tiny random models, and their hybrid KV cache.

Gemma 3 mixes sliding-window layers (each with its own RoPE base) and full-attention layers; the
KV cache keeps them in groups with their own block tables (``model_shape.kv_groups``) and releases
a sliding group's blocks once no query can see them. Outputs must equal transformers' greedy
tokens however the sequence is cut into chunks, preempted, forked or served from the prefix cache.
Gemma 2 adds a tanh soft-cap on the attention scores (native kernel and plain paths).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedkv import LLM, SamplingParams
from pagedkv.model_shape import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    ModelShape,
    kv_blocks_per_sequence,
    kv_bytes_per_block,
    kv_groups,
    kv_layer_slots,
)
from pagedkv.models import load_model
from pagedkv.models.config import ModelConfig
from pagedkv.models.errors import UnsupportedModelError
from pagedkv.runner import ModelRunner, SeqChunk
from pagedkv_testing.hf_checkpoints import (
    TinyAllocator,
    check_greedy_both_ways,
    hf_greedy,
    hf_logits,
    load_hf_reference,
    make_hf_checkpoint,
    paged_greedy,
)

# name -> constructor overrides of a tiny Gemma3TextConfig / Gemma2Config (odd head dims, windows
# and patterns); "model_type" picks the family (gemma3 when absent)
CASES: dict[str, dict[str, Any]] = {
    # pattern 3: layers 0, 1 sliding, 2 full, ...; linear-scaled global RoPE, its own local base
    "pattern3_softcap": dict(num_hidden_layers=5, head_dim=24, sliding_window=6, sliding_window_pattern=3,
                             query_pre_attn_scalar=20, final_logit_softcapping=30.0, rope_parameters={
                                 "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    # explicit layer_types, MQA, untied head, attention bias, window wider than a block
    "layer_types_mqa": dict(num_hidden_layers=4, head_dim=40, num_key_value_heads=1, sliding_window=9,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                         "sliding_attention"], tie_word_embeddings=False, attention_bias=True),
    # gemma2: alternating sliding/full layers, small soft-caps so that they bite; head_dim 64 takes
    # the native kernel's vector path, 40 its scalar one
    "gemma2_caps_d64": dict(model_type="gemma2", num_hidden_layers=4, head_dim=64, sliding_window=7,
                            query_pre_attn_scalar=48, attn_logit_softcapping=3.0, final_logit_softcapping=5.0),
    "gemma2_defaults_d40": dict(model_type="gemma2", num_hidden_layers=3, head_dim=40, num_key_value_heads=1,
                                sliding_window=5),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return {}


def _case(name: str, tmp_path_factory: pytest.TempPathFactory, cache: dict[str, Any]) -> Any:
    if name not in cache:
        overrides = dict(CASES[name])
        model_type = overrides.pop("model_type", "gemma3")
        folder = make_hf_checkpoint(tmp_path_factory.mktemp(name), model_type, seed=len(name), **overrides)
        cache[name] = (folder, load_hf_reference(folder), load_model(str(folder)))
    return cache[name]


def _prompt(n: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_logits_match_transformers(name: str, tmp_path_factory: pytest.TempPathFactory,
                                           built: dict[str, Any]) -> None:
    _, ref, loaded = _case(name, tmp_path_factory, built)
    assert loaded.config.model_type == CASES[name].get("model_type", "gemma3") and loaded.config.is_hybrid
    ids = _prompt(40, 1)
    runner = ModelRunner(loaded, block_size=4, num_blocks=256)
    groups = len(runner.cache.groups)
    assert groups > 1
    alloc = TinyAllocator(256)
    tables = [alloc.take(10) for _ in range(groups)]
    got = runner.execute([SeqChunk(ids, 0, tables[0], group_tables=tuple(tables[1:]))], return_all_logits=True)
    torch.testing.assert_close(got, hf_logits(ref, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("native", [True, False], ids=["native", "plain"])
@pytest.mark.parametrize("name", list(CASES))
def test_greedy_matches_transformers_in_chunks(name: str, tmp_path_factory: pytest.TempPathFactory,
                                               built: dict[str, Any], native: bool) -> None:
    _, ref, loaded = _case(name, tmp_path_factory, built)
    prompts = [_prompt(n, 10 + n) for n in (13, 21, 5)]
    check_greedy_both_ways(loaded, prompts, [hf_greedy(ref, p, 24) for p in prompts], native=native,
                           num_blocks=512, chunk=4)


def test_runner_refuses_chunks_without_group_tables(tmp_path_factory: pytest.TempPathFactory,
                                                    built: dict[str, Any]) -> None:
    from pagedkv.runner import BatchError

    _, _, loaded = _case("pattern3_softcap", tmp_path_factory, built)
    runner = ModelRunner(loaded, block_size=4, num_blocks=64)
    with pytest.raises(BatchError, match="group_tables"):
        runner.execute([SeqChunk([5, 6, 7], 0, [0])])


ENGINE_RUNS = {
    "whole_prompts": dict(),
    "chunked_radix": dict(max_num_batched_tokens=8, prefix_index="radix"),
    "swap": dict(num_kv_blocks=50, max_num_batched_tokens=16, preemption_mode="swap",
                 kv_offloading_size=0.001),
    "host_tier": dict(num_kv_blocks=50, max_num_batched_tokens=16, kv_offloading_size=0.01),
    "recompute_faults": dict(num_kv_blocks=50, max_num_batched_tokens=16, preemption_mode="recompute",
                             fault_injection="seed=3,rate=0.3"),
}


@pytest.mark.parametrize("run", list(ENGINE_RUNS))
def test_engine_releases_window_blocks_and_matches_transformers(run: str, tmp_path_factory: pytest.TempPathFactory,
                                                                built: dict[str, Any]) -> None:
    """Prompts longer than the window, a shared prefix, chunked prefill, preemption by swap and by
    recompute, the host tier, seeded faults: integrity after every step, greedy tokens equal to transformers', the
    second pass served from the prefix cache, and every block back in the pool at the end."""
    folder, ref, _ = _case("pattern3_softcap", tmp_path_factory, built)
    prompts = [_prompt(n, 5 + n) for n in (5, 17, 30, 41)]
    prompts.append(prompts[2][:25] + [7, 8, 9])  # shares 6 blocks with prompt 2
    want = [hf_greedy(ref, p, 24) for p in prompts]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(str(folder), block_size=4, debug_integrity=True, **ENGINE_RUNS[run]) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
        stats = llm.engine.kv.stats()
        assert stats.window_released_blocks > 0
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert again == want
        assert llm.engine.kv.stats().prefix_hit_tokens > stats.prefix_hit_tokens or run == "swap"
        assert llm.engine.kv.stats().used_blocks == 0
        engine_stats = llm.engine.stats()
        if run == "swap":
            assert engine_stats.preemptions_swap > 0
        if run == "recompute_faults":
            assert engine_stats.preemptions_recompute > 0
        if run == "host_tier":  # evicted blocks of every group came back from the host tier
            assert engine_stats.kv.host_hit_tokens > 0 and engine_stats.kv.reloaded_blocks > 0


def test_disk_tier_keeps_every_group_across_a_restart(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                     built: dict[str, Any]) -> None:
    """Every group's blocks are written to the disk tier (under their own keys) and persist at
    close; a new engine on the same directory serves the prefix from disk for every group and
    still gives transformers' tokens."""
    folder, ref, _ = _case("pattern3_softcap", tmp_path_factory, built)
    prompts = [_prompt(n, 40 + n) for n in (30, 41)]
    want = [hf_greedy(ref, p, 12) for p in prompts]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    options = dict(block_size=4, debug_integrity=True, num_kv_blocks=80, kv_offloading_size=0.0005,
                   kv_offload_dir=str(tmp_path / "kv"))
    with LLM(str(folder), **options) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    with LLM(str(folder), **options) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
        kv = llm.engine.kv.stats()
        assert kv.disk_hit_tokens > 0 and kv.prefix_hit_tokens >= kv.disk_hit_tokens


def test_sliding_groups_hold_only_the_window_while_decoding(tmp_path_factory: pytest.TempPathFactory,
                                                            built: dict[str, Any]) -> None:
    """One long sequence: the blocks it holds follow ``kv_blocks_per_sequence`` (window blocks in
    the sliding groups), far fewer than a cache that keeps every layer's history."""
    folder, ref, loaded = _case("pattern3_softcap", tmp_path_factory, built)
    config = loaded.config
    prompt = _prompt(60, 99)
    with LLM(str(folder), block_size=4, debug_integrity=True, enable_prefix_caching=False) as llm:
        engine = llm.engine
        engine.add_request("r", prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        held = []
        while engine.has_unfinished_requests():
            engine.step()
            if "r" in {g.request_id for g in engine.scheduler.running}:
                seq = next(g for g in engine.scheduler.running if g.request_id == "r").seqs[0]
                held.append((engine.kv.num_computed(seq.seq_id), len(engine.kv.block_ids(seq.seq_id))))
    assert held
    for computed, blocks in held:  # after each step: the blocks of the computed tokens
        assert blocks == kv_blocks_per_sequence(config, computed, 4), (computed, blocks)
    computed, blocks = held[-1]
    full_cache = len(kv_groups(config)) * -(-computed // 4)
    assert blocks < full_cache


def test_parallel_samples_fork_every_group(tmp_path_factory: pytest.TempPathFactory,
                                           built: dict[str, Any]) -> None:
    """n=3 greedy samples fork the prompt's blocks in every group (copy-on-write of the partial
    last block in each) and all continue like transformers. (Beam search, sampling, logprobs and
    aborts run on Gemma 3 too, in test_engine.py.)"""
    folder, ref, _ = _case("layer_types_mqa", tmp_path_factory, built)
    prompt = _prompt(23, 3)
    with LLM(str(folder), block_size=4, debug_integrity=True, seed=1) as llm:
        out = llm.generate([prompt], SamplingParams(n=3, max_tokens=12, temperature=0, ignore_eos=True))[0]
        assert [c.token_ids for c in out.outputs] == [hf_greedy(ref, prompt, 12)] * 3
        assert llm.engine.kv.stats().cow_copies >= len(llm.engine.runner.cache.groups)
        assert llm.engine.kv.stats().used_blocks == 0


def test_multimodal_checkpoint_loads_its_language_model(tmp_path: Path) -> None:
    """Gemma3ForConditionalGeneration keeps the text model under ``language_model`` and a vision
    tower beside it: the language model loads, the rest is skipped."""
    folder = make_hf_checkpoint(tmp_path, "gemma3", seed=2, **CASES["layer_types_mqa"])
    ref = load_hf_reference(folder)
    tensors = load_file(folder / "model.safetensors")
    renamed = {"language_model." + k: v for k, v in tensors.items()}  # the hub's layout
    renamed["vision_tower.vision_model.embeddings.patch_embedding.weight"] = torch.zeros(4, 3)
    renamed["multi_modal_projector.mm_input_projection_weight"] = torch.zeros(2, 2)
    save_file(renamed, folder / "model.safetensors")
    text = json.loads((folder / "config.json").read_text())
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": {**text, "model_type": "gemma3_text"}, "vision_config": {"hidden_size": 4}}
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(folder))
    ids = _prompt(19, 4)
    runner = ModelRunner(loaded, block_size=4, num_blocks=64)
    want = hf_logits(ref, ids)
    assert paged_greedy(runner, [ids], 1)[0][0] == int(want[-1].argmax())


def test_config_reading_and_unsupported_variants() -> None:
    base = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 1, "num_hidden_layers": 7, "head_dim": 32,
            "intermediate_size": 96, "vocab_size": 300, "sliding_window": 512, "rope_theta": 1e6,
            "rope_local_base_freq": 2e4, "sliding_window_pattern": 6}
    config = ModelConfig.from_hf_dict(base)
    assert config.layer_types == (SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION, SLIDING_ATTENTION)
    assert config.rope.theta == 1e6 and config.rope_local is not None and config.rope_local.theta == 2e4
    assert config.layer_rope(5) is config.rope and config.layer_rope(0) is config.rope_local
    assert config.attention_scale == 256 ** -0.5  # query_pre_attn_scalar's default
    assert config.tie_word_embeddings and config.qk_norm and config.hidden_act == "gelu_pytorch_tanh"
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config
    with pytest.raises(UnsupportedModelError, match="encoder"):
        ModelConfig.from_hf_dict({**base, "use_bidirectional_attention": True})
    gemma2 = ModelConfig.from_hf_dict({**base, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                                       "sliding_window_pattern": None})
    assert gemma2.layer_types[:2] == (SLIDING_ATTENTION, FULL_ATTENTION) and not gemma2.qk_norm
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)  # transformers' defaults
    assert ModelConfig.from_hf_dict(gemma2.to_hf_dict()) == gemma2
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf_dict({**base, "layer_types": ["full_attention"] * 3})


def _gemma3_shape(layers: int, window: int, kv_heads: int, head_dim: int) -> ModelShape:
    types = tuple(SLIDING_ATTENTION if (i + 1) % 6 else FULL_ATTENTION for i in range(layers))
    return ModelShape(model_type="gemma3", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv_heads,
                      head_dim=head_dim, sliding_window=window, layer_types=types)


@pytest.mark.parametrize("layers,window,kv_heads,head_dim", [(26, 512, 1, 256), (34, 1024, 4, 256),
                                                            (48, 1024, 8, 256), (62, 1024, 16, 128)])
def test_kv_groups_cover_every_layer_once_and_save_memory(layers: int, window: int, kv_heads: int,
                                                          head_dim: int) -> None:
    """Gemma 3 1B/4B/12B/27B shapes: groups of one kind each, every layer in exactly one slot, and
    a sequence at 8k tokens holds well under half the bytes of a full cache."""
    shape = _gemma3_shape(layers, window, kv_heads, head_dim)
    groups = kv_groups(shape)
    assert sorted(layer for g in groups for layer in g.layers) == list(range(layers))
    for g in groups:
        assert len({shape.layer_window(layer) for layer in g.layers}) == 1
        assert g.window == shape.layer_window(g.layers[0])
    assert groups[0].window is None and len(groups[0].layers) == kv_layer_slots(shape)
    full = ModelShape(**{**{f: getattr(shape, f) for f in shape.__dataclass_fields__}, "layer_types": ()})
    B = 16
    hybrid_bytes = kv_blocks_per_sequence(shape, 8192, B) * kv_bytes_per_block(shape, B, "bfloat16")
    full_bytes = kv_blocks_per_sequence(full, 8192, B) * kv_bytes_per_block(full, B, "bfloat16")
    assert hybrid_bytes < 0.45 * full_bytes
    # short sequences hold every block: nothing is out of the window yet
    assert kv_blocks_per_sequence(shape, window // 2, B) == len(groups) * -(-(window // 2) // B)


def test_random_hybrid_schedules_keep_outputs(tmp_path_factory: pytest.TempPathFactory,
                                              built: dict[str, Any]) -> None:
    """Random prompt lengths around the window, a small pool and random arrival order: every
    request's greedy tokens equal a run of it alone."""
    folder, ref, _ = _case("layer_types_mqa", tmp_path_factory, built)
    rng = random.Random(7)
    prompts = [_prompt(rng.randrange(1, 40), 100 + i) for i in range(8)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    with LLM(str(folder), block_size=2, num_kv_blocks=140, max_num_batched_tokens=12,
             debug_integrity=True) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == [hf_greedy(ref, p, 10) for p in prompts]
