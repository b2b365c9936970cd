"""Gemma 3 GGUF files: tiny random Gemma 3 models written the way llama.cpp's converter writes them
(gemma3 tensor names, 1 added to every norm weight, q/k rows not permuted, the head tied, metadata
only where llama.cpp keeps it) load and run like transformers on the original checkpoint, through the
runner and through the engine, whose sliding groups release their out-of-window blocks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pagedkv import LLM, SamplingParams
from pagedkv.model_shape import FULL_ATTENTION, SLIDING_ATTENTION
from pagedkv.models import load_model
from pagedkv.models.gguf_loader import converted_folder, gguf_config, hf_name
from pagedkv.runner import ModelRunner, SeqChunk
from pagedkv_testing.hf_checkpoints import hf_greedy, hf_logits, load_hf_reference, make_hf_checkpoint, paged_greedy

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402 - only once importorskip found gguf

SP = "\u2581"
# <pad> <eos> <bos> <unk> <start_of_turn> <end_of_turn>, 256 byte pieces, then word pieces
TOKENS = (["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
          + [f"<0x{b:02X}>" for b in range(256)] + [SP] + [f"{SP}w{i}" for i in range(37)])
TYPES = [3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * 38
HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
HF_TO_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}


@pytest.fixture(autouse=True, scope="module")
def _native_kernels_built() -> None:
    """Build (or find) the native kernels in the usual cache first: each test points the cache at its
    own folder, where the first runner would otherwise build them again (tens of seconds)."""
    from pagedkv.ops import native

    native.available()


def _rope(full_theta: float, local_theta: float, factor: float | None = None) -> dict[str, Any]:
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": full_theta}
    if factor is not None:
        full = {"rope_type": "linear", "factor": factor, "rope_theta": full_theta}
    return {"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}


# name -> (Gemma3TextConfig overrides, how the GGUF states the layer pattern and the local RoPE base).
# llama.cpp does not store query_pre_attn_scalar: it uses head_dim (all but the 27B), so the HF side does too.
CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # a period of 3 and the local base in the file; linear-scaled global RoPE; final soft-cap
    "period3_scaled_softcap": (
        dict(num_hidden_layers=5, head_dim=20, query_pre_attn_scalar=20, sliding_window=6, sliding_window_pattern=3,
             final_logit_softcapping=30.0, rope_parameters=_rope(1e6, 2e4, factor=2.0)),
        dict(pattern=3, freq_base_swa=True)),
    # no pattern key (llama.cpp: every 6th layer global), no local base (llama.cpp: 10000); MQA, untied head
    "llama_cpp_defaults": (
        dict(num_hidden_layers=7, head_dim=40, query_pre_attn_scalar=40, num_key_value_heads=1, sliding_window=5,
             tie_word_embeddings=False, rope_parameters=_rope(2e4, 1e4)),
        dict(pattern=None, freq_base_swa=False)),
    # one flag per layer (the newer converters' array form)
    "per_layer_flags": (
        dict(num_hidden_layers=4, head_dim=24, query_pre_attn_scalar=24, sliding_window=7,
             layer_types=[SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION, SLIDING_ATTENTION],
             rope_parameters=_rope(1e6, 5e3)),
        dict(pattern=[True, False, True, True], freq_base_swa=True)),
}


def _write_gemma3_gguf(path: Path, ref: torch.nn.Module, how: dict[str, Any],
                       qtype: Any = gguf.GGMLQuantizationType.F32) -> None:
    """``ref``'s weights as llama.cpp's gemma3 GGUF; with a quantized ``qtype`` the reference's matrices
    are replaced by their rounded values, so both sides run the same weights."""
    cfg = ref.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    full, local = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
    w.add_rope_freq_base(full["rope_theta"])
    if full["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    if how["freq_base_swa"]:
        w.add_rope_freq_base_swa(local["rope_theta"])
    w.add_sliding_window(cfg.sliding_window)
    if how["pattern"] is not None:
        w.add_sliding_window_pattern(how["pattern"])
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_tokenizer_model("llama")
    w.add_token_list(TOKENS)
    w.add_token_scores([-float(i) for i in range(len(TOKENS))])
    w.add_token_types(TYPES)
    w.add_pad_token_id(0)
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)
    w.add_add_space_prefix(False)
    quantized = qtype != gguf.GGMLQuantizationType.F32
    with torch.no_grad():
        for name, t in ref.state_dict().items():
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            arr = t.numpy().astype(np.float32)
            raw = None
            if name.endswith("norm.weight"):
                arr = arr + 1.0  # llama.cpp's norm_shift for gemma3
            elif quantized and arr.ndim == 2 and arr.shape[1] % 32 == 0:
                arr, raw = quantize(arr, qtype), qtype
                t.copy_(torch.from_numpy(dequantize(arr, qtype).reshape(t.shape)))
            parts = name.split(".")
            gguf_name = HF_TO_GGUF_TOP.get(name) or f"blk.{parts[2]}." + HF_TO_GGUF_LAYER[".".join(parts[3:])]
            w.add_tensor(gguf_name, np.ascontiguousarray(arr), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _case(name: str, tmp_path: Path, qtype: Any = gguf.GGMLQuantizationType.F32
          ) -> tuple[Path, torch.nn.Module, Path]:
    """(GGUF path, transformers reference, the HF checkpoint folder) of case ``name``."""
    overrides, how = CASES[name]
    folder = make_hf_checkpoint(tmp_path, "gemma3", seed=len(name), vocab_size=len(TOKENS), **overrides)
    ref = load_hf_reference(folder)
    path = tmp_path / f"{name}.gguf"
    _write_gemma3_gguf(path, ref, how, qtype)
    return path, ref, folder


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(6, len(TOKENS), (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_matches_transformers(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Config as the HF checkpoint's, norm weights back to the checkpoint's w, logits and greedy
    tokens equal to transformers' on the original model."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    path, ref, folder = _case(name, tmp_path)
    loaded = load_model(str(path))
    config, want = loaded.config, load_model(str(folder)).config
    assert config.model_type == "gemma3" and config.is_hybrid
    for field in ("layer_types", "sliding_window", "head_dim", "num_key_value_heads", "tie_word_embeddings",
                  "query_pre_attn_scalar", "final_logit_softcapping", "hidden_act", "rope", "rope_local"):
        assert getattr(config, field) == getattr(want, field), field
    converted = load_file(converted_folder(path) / "model.safetensors")
    for key, tensor in load_file(folder / "model.safetensors").items():
        if key.endswith("norm.weight"):
            torch.testing.assert_close(converted[key], tensor, atol=1e-6, rtol=0)
    ids = _prompt(30, 1)
    runner = ModelRunner(loaded, block_size=4, num_blocks=256)
    groups = len(runner.cache.groups)
    tables = [list(range(g * 8, g * 8 + 8)) for g in range(groups)]
    got = runner.execute([SeqChunk(ids, 0, tables[0], group_tables=tuple(tables[1:]))], return_all_logits=True)
    torch.testing.assert_close(got, hf_logits(ref, ids), atol=1e-4, rtol=1e-4)
    prompts = [_prompt(n, 10 + n) for n in (13, 21, 4)]
    runner = ModelRunner(loaded, block_size=3, num_blocks=512)
    assert paged_greedy(runner, prompts, 20, chunk=5) == [hf_greedy(ref, p, 20) for p in prompts]
    assert loaded.tokenizer is not None and loaded.tokenizer.bos_token_id == 2


def test_q8_0_gguf_matches_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Q8_0 matrices (kept quantized by the "auto" choice) beside F32 norms that still get their 1 back."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    path, ref, _ = _case("per_layer_flags", tmp_path, gguf.GGMLQuantizationType.Q8_0)
    loaded = load_model(str(path))
    prompts = [_prompt(n, 40 + n) for n in (17, 9)]
    runner = ModelRunner(loaded, block_size=4, num_blocks=256)
    assert paged_greedy(runner, prompts, 16) == [hf_greedy(ref, p, 16) for p in prompts]


def test_engine_releases_window_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the engine: prompts longer than the window, chunked prefill, a second pass from the
    prefix cache; the sliding groups release blocks and every request matches transformers."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    path, ref, _ = _case("period3_scaled_softcap", tmp_path)
    prompts = [_prompt(n, 5 + n) for n in (5, 19, 33)]
    want = [hf_greedy(ref, p, 20) for p in prompts]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    with LLM(str(path), block_size=4, num_kv_blocks=160, max_num_batched_tokens=16, debug_integrity=True) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
        assert llm.engine.kv.stats().window_released_blocks > 0
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
        assert llm.engine.kv.stats().used_blocks == 0


def _metadata_only(path: Path, layers: int, hidden: int, heads: int, head_dim: int, **keys: Any) -> Any:
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(4 * hidden)
    w.add_head_count(heads)
    w.add_head_count_kv(1)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(1000)
    w.add_rope_freq_base(1e6)
    if "window" in keys:
        w.add_sliding_window(keys["window"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return gguf.GGUFReader(str(path))


def test_config_follows_llama_cpp(tmp_path: Path) -> None:
    """llama.cpp's hparams: the 27B (62 layers) scales attention by hidden / heads, the others by
    head_dim; no window means every layer global; the default period is 6; the local base 10000."""
    config, _ = gguf_config(_metadata_only(tmp_path / "27b.gguf", 62, 5376, 32, 128, window=1024))
    assert config.query_pre_attn_scalar == 168 and config.attention_scale == 168 ** -0.5
    assert config.layer_types.count(FULL_ATTENTION) == 10 and config.layer_types[5] == FULL_ATTENTION
    assert config.rope.theta == 1e6 and config.rope_local is not None and config.rope_local.theta == 10000.0
    assert config.final_logit_softcapping is None and config.tie_word_embeddings
    config, _ = gguf_config(_metadata_only(tmp_path / "1b.gguf", 26, 1152, 4, 256, window=512))
    assert config.query_pre_attn_scalar == 256 and config.sliding_window == 512
    config, _ = gguf_config(_metadata_only(tmp_path / "nowindow.gguf", 6, 64, 4, 16))
    assert config.sliding_window is None and set(config.layer_types) == {FULL_ATTENTION} and not config.is_hybrid
    config_json = config.to_hf_dict()
    assert json.loads(json.dumps(config_json))["layer_types"] == [FULL_ATTENTION] * 6


def test_tensor_names() -> None:
    assert hf_name("blk.3.ffn_norm.weight", "gemma3") == "model.layers.3.pre_feedforward_layernorm.weight"
    assert hf_name("blk.3.post_attention_norm.weight", "gemma3") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_name("blk.3.post_ffw_norm.weight", "gemma3") == "model.layers.3.post_feedforward_layernorm.weight"
    assert hf_name("blk.0.attn_norm.weight", "gemma3") == "model.layers.0.input_layernorm.weight"
    assert hf_name("blk.0.attn_k_norm.weight", "gemma3") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_name("blk.3.ffn_norm.weight", "llama") == "model.layers.3.post_attention_layernorm.weight"
