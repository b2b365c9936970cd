"""pagedkv.model_shape: the one owner of model shapes, KV bytes and block-size bounds.

It imports no torch; its KV bytes per block equal what the runner's KVCache tensors take; the
config.json and GGUF readers agree (and fill left-out keys with transformers' defaults); and
EngineConfig, the runner and ``pagedkv size`` accept exactly the same block sizes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv.engine import EngineConfig
from pagedkv.model_shape import (
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    ModelShape,
    kv_bytes_per_block,
    kv_bytes_per_token,
    scale_bytes_per_block,
    shape_from_gguf,
    shape_from_hf_dict,
)
from pagedkv.models import ModelConfig, UnsupportedModelError
from pagedkv.runner import KVCache, bytes_per_block
from pagedkv.sim.presets import PRESETS
from pagedkv.sim.sizing import SizingInputs

CONFIGS = {  # name -> ModelConfig keywords
    "gqa": dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=128, head_dim=16),
    "head_dim_not_hidden_over_heads": dict(num_attention_heads=4, num_key_value_heads=1, hidden_size=64,
                                           head_dim=24),
    "mha": dict(num_attention_heads=3, num_key_value_heads=3, hidden_size=96, head_dim=32),
}
DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "int8",
          torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8_e5m2"}


def _config(name: str, layers: int = 3) -> ModelConfig:
    return ModelConfig(model_type="llama", vocab_size=100, intermediate_size=64, num_hidden_layers=layers,
                       **CONFIGS[name])


def test_model_shape_and_its_users_import_no_torch() -> None:
    code = ("import sys, pagedkv.model_shape, pagedkv.sim.model_spec, pagedkv.sim.presets, "
            "pagedkv.sim.sizing, pagedkv.engine.config\n"
            "from pagedkv.model_shape import kv_bytes_per_block\n"
            "from pagedkv.sim.presets import PRESETS\n"
            "assert kv_bytes_per_block(PRESETS['llama-3-8b'], 16, 'int8', tp=2) > 0\n"
            "print(sorted(m for m in ('torch', 'numpy', 'gguf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]"]


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 16, MAX_BLOCK_SIZE])
def test_kv_bytes_per_block_equal_the_kvcache_tensors(name: str, dtype: torch.dtype, block_size: int) -> None:
    config = _config(name)
    cache = KVCache(config, block_size=block_size, num_blocks=3, num_host_blocks=2, dtype=dtype)
    per_block = kv_bytes_per_block(config, block_size, DTYPES[dtype])
    assert cache.device_bytes == 3 * per_block
    assert cache.host_bytes == 2 * per_block
    assert bytes_per_block(config, block_size, dtype) == per_block
    scales = scale_bytes_per_block(config, DTYPES[dtype])
    assert per_block == block_size * kv_bytes_per_token(config, DTYPES[dtype]) + scales
    # the 8-bit kinds hold one float32 scale per block, layer, K/V and KV head; the float kinds none
    assert (cache.scales is not None) == (dtype.itemsize == 1)
    if cache.scales is not None:
        assert scales == 3 * 2 * config.num_key_value_heads * 4
        assert cache.host_scales is not None and cache.host_scales.shape[2] == 2


def _write_gguf(path: Path, arch: str, metadata: dict[str, Any], tensors: list[str]) -> None:
    gguf = pytest.importorskip("gguf")
    np = pytest.importorskip("numpy")
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        getattr(writer, f"add_{key}")(value)
    for name in tensors:
        writer.add_tensor(name, np.zeros((2, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


GGUF_CASES = {  # name -> (arch, GGUFWriter.add_* metadata, tensor names, the same model as config.json);
    # float figures are powers of two or round numbers: GGUF stores float32
    "llama_untied_head_dim_24": (
        "llama",
        dict(block_count=3, head_count=8, head_count_kv=2, embedding_length=128, feed_forward_length=320,
             context_length=512, key_length=24, vocab_size=1000, layer_norm_rms_eps=2**-16, rope_freq_base=5e5),
        ["token_embd.weight", "output.weight"],
        dict(model_type="llama", num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
             hidden_size=128, intermediate_size=320, max_position_embeddings=512, head_dim=24,
             vocab_size=1000, rms_norm_eps=2**-16, rope_theta=5e5, tie_word_embeddings=False)),
    "qwen2_tied_bias": (
        "qwen2",
        dict(block_count=2, head_count=4, head_count_kv=4, embedding_length=64, feed_forward_length=96,
             context_length=256, vocab_size=300, layer_norm_rms_eps=2**-20, rope_freq_base=1e6),
        ["token_embd.weight", "blk.0.attn_q.bias"],
        dict(model_type="qwen2", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             hidden_size=64, intermediate_size=96, max_position_embeddings=256, vocab_size=300,
             rms_norm_eps=2**-20, rope_theta=1e6, tie_word_embeddings=True)),
    "llama_only_required_keys": (  # every other figure comes from the shared defaults
        "llama", dict(block_count=2, head_count=4, embedding_length=64), [],
        dict(model_type="llama", num_hidden_layers=2, num_attention_heads=4, hidden_size=64,
             tie_word_embeddings=True)),
}


@pytest.mark.parametrize("case", GGUF_CASES)
def test_hf_and_gguf_readers_agree(tmp_path: Path, case: str) -> None:
    gguf = pytest.importorskip("gguf")
    from pagedkv.models.gguf_loader import gguf_config

    arch, metadata, tensors, hf = GGUF_CASES[case]
    path = tmp_path / "m.gguf"
    _write_gguf(path, arch, metadata, tensors)
    reader = gguf.GGUFReader(str(path))
    from_gguf, from_hf = shape_from_gguf(reader), shape_from_hf_dict(hf)
    assert from_gguf == from_hf
    assert from_gguf.num_params == 4 * len(tensors) and from_hf.num_params is None  # provenance only
    assert gguf_config(reader)[0] == ModelConfig.from_hf_dict(hf)  # the loaders read through them


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_left_out_keys_take_transformers_defaults(model_type: str) -> None:
    transformers = pytest.importorskip("transformers")
    given = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config}[model_type]
    theirs = cls(**given)
    ours = shape_from_hf_dict({"model_type": model_type, **given})
    for key in ("vocab_size", "intermediate_size", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.num_key_value_heads == 4  # = heads, as LlamaConfig, Qwen2Config and llama.cpp (MistralConfig: 8)
    assert ours.sliding_window == getattr(theirs, "sliding_window", None)  # llama has none
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or 16)


def test_model_config_is_a_runnable_shape() -> None:
    config = _config("gqa")
    assert isinstance(config, ModelShape)
    assert ModelConfig.from_shape(config, rope=config.rope, rms_norm_eps=config.rms_norm_eps) == config
    with pytest.raises(UnsupportedModelError):
        ModelConfig.from_shape(PRESETS["deepseek-v2-lite"])
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        ModelConfig.from_hf_dict({"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
                                  "num_hidden_layers": 2, "use_sliding_window": True, "sliding_window": 32})


@pytest.mark.parametrize("block_size", [-1, 0, 1, 2, 255, 256, 257, 300, 1024, 4096])
def test_block_size_bounds_are_one_rule(block_size: int) -> None:
    valid = MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE
    assert (MIN_BLOCK_SIZE, MAX_BLOCK_SIZE) == (1, 256)  # the engine's user-facing range
    config = _config("gqa", layers=1)
    checks = {
        "EngineConfig": lambda: EngineConfig(block_size=block_size),
        "KVCache": lambda: KVCache(config, block_size=block_size, num_blocks=1),
        "bytes_per_block": lambda: bytes_per_block(config, block_size),
        "pagedkv size": lambda: SizingInputs(kv_memory=1 << 30, block_size=block_size).validate(),
        "model_shape": lambda: kv_bytes_per_block(PRESETS["llama-3-8b"], block_size, "fp16"),
    }
    for check in checks.values():
        if valid:
            check()
        else:
            with pytest.raises(ValueError, match="block.size"):
                check()
