"""GGUF loading: a tiny llama GGUF written with gguf.GGUFWriter (q/k permuted like llama.cpp, F32 and
Q8_0 tensors, a gpt2 BPE vocabulary) loads and matches transformers on the same weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedkv.models import load_model
from pagedkv.models.gguf_loader import unpermute_rows
from pagedkv.runner import ModelRunner, SeqChunk
from pagedkv_testing.hf_checkpoints import hf_greedy, hf_logits, randomize_

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402 - only once importorskip found gguf
from tokenizers import pre_tokenizers  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "Ġ w", "o r", "Ġw or"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",
}
PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 20000.0, "short_factor": [1.0, 1.2, 1.5, 2.0],
             "long_factor": [1.0, 2.0, 3.0, 5.0], "partial_rotary_factor": 0.5}


def _vocab() -> list[str]:
    tokens = list(SPECIALS) + sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens += [m.replace(" ", "") for m in MERGES]
    return tokens


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # what llama.cpp's convert script does to q_proj / k_proj rows
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> str:
    if hf in HF_TO_GGUF:
        return HF_TO_GGUF[hf]
    parts = hf.split(".")
    return f"blk.{parts[2]}." + HF_TO_GGUF[".".join(parts[3:])]


def _write_gguf(path: Path, tied: bool, qtype: gguf.GGMLQuantizationType, arch: str = "llama"
                ) -> torch.nn.Module:
    """Write the GGUF; return the transformers reference carrying the same (dequantized) weights."""
    import transformers

    tokens = _vocab()
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM)}[arch]
    extra = {"qwen3": {"head_dim": 24},
             "phi3": {"pad_token_id": 0, "original_max_position_embeddings": 64, "rope_parameters": PHI3_ROPE},
             }.get(arch, {"rope_theta": 20000.0})
    cfg = config_cls(
        vocab_size=len(tokens), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, **({"rope_theta": 20000.0} if arch == "qwen3" else {}), **extra,
    )
    ref = model_cls(cfg).eval()
    randomize_(ref, seed=3)
    w = gguf.GGUFWriter(str(path), arch)
    if arch == "qwen3":
        w.add_key_length(24)
        w.add_value_length(24)
    if arch == "phi3":
        w.add_rope_dimension_count(8)
        w.add_uint32("phi3.rope.scaling.original_context_length", 64)
        w.add_tensor("rope_factors_long.weight", np.array(PHI3_ROPE["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(PHI3_ROPE["short_factor"], dtype=np.float32))
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(20000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_chat_template(TEMPLATE)
    state = ref.state_dict()
    with torch.no_grad():
        for name, t in state.items():
            if tied and name == "lm_head.weight":
                continue
            arr = t.numpy().astype(np.float32)
            if arr.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
                q = quantize(arr, qtype)
                t.copy_(torch.from_numpy(dequantize(q, qtype).reshape(arr.shape)))  # the reference sees the rounding
                arr_q = q
            else:
                arr_q = arr
            if arch == "llama" and name.endswith("q_proj.weight"):  # llama.cpp permutes llama only
                arr_q = _llama_cpp_permute(arr_q, 4)
            elif arch == "llama" and name.endswith("k_proj.weight"):
                arr_q = _llama_cpp_permute(arr_q, 2)
            raw = qtype if (arr.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32) else None
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(arr_q), raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return ref


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for n_head in (1, 2, 8):
        assert np.array_equal(unpermute_rows(_llama_cpp_permute(w, n_head), n_head), w)


@pytest.mark.parametrize("arch,tied,qtype", [("llama", False, gguf.GGMLQuantizationType.F32),
                                             ("llama", True, gguf.GGMLQuantizationType.Q8_0),
                                             ("llama", False, gguf.GGMLQuantizationType.Q4_0),
                                             ("qwen2", True, gguf.GGMLQuantizationType.Q8_0),
                                             ("qwen3", False, gguf.GGMLQuantizationType.Q8_0),
                                             ("phi3", False, gguf.GGMLQuantizationType.F32)])
def test_gguf_matches_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, tied: bool,
                                   qtype: gguf.GGMLQuantizationType) -> None:
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    ref = _write_gguf(path, tied, qtype, arch)
    loaded = load_model(str(path))
    assert loaded.config.model_type == arch and loaded.config.attention_bias == (arch == "qwen2")
    assert loaded.config.tie_word_embeddings == tied
    assert (loaded.config.num_key_value_heads, loaded.config.rope.theta) == (2, 20000.0)
    assert loaded.config.qk_norm == (arch == "qwen3") and loaded.config.head_dim == (24 if arch == "qwen3" else 16)
    if arch == "phi3":
        assert loaded.config.rope.rope_type == "longrope" and loaded.config.rotary_dim == 8
    ids = [5, 40, 77, 120, 9, 200, 33, 64, 100, 3, 250]
    runner = ModelRunner(loaded, block_size=4, num_blocks=32)
    got = runner.execute([SeqChunk(ids, 0, [9, 1, 30, 4, 2, 8, 7, 6, 5, 3, 0])], return_all_logits=True)
    torch.testing.assert_close(got, hf_logits(ref, ids), atol=1e-4, rtol=1e-4)
    # greedy continuation, token for token
    table = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    out, pos, logits = [], len(ids), runner.execute([SeqChunk(ids, 0, table)])
    for _ in range(24):
        out.append(int(logits[0].argmax()))
        logits = runner.execute([SeqChunk([out[-1]], pos, table)])
        pos += 1
    assert out == hf_greedy(ref, ids, 24)
    # converted once: a second load reads the cached folder
    assert len(list((tmp_path / "cache" / "gguf").glob("*/.complete"))) == 1
    again = load_model(str(path.parent))  # a folder holding one .gguf file loads that file
    assert again.path == path
    assert torch.equal(again.model.embed_tokens.weight, loaded.model.embed_tokens.weight)


def test_gguf_tokenizer_and_chat_template(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tok.gguf"
    _write_gguf(path, True, gguf.GGMLQuantizationType.F32)
    tok = load_model(str(path)).tokenizer
    assert tok is not None
    vocab = _vocab()
    ids = tok.encode("hello world 42<|im_end|>", add_special_tokens=True)
    assert [vocab[i] for i in ids] == ["hell", "o", "Ġwor", "l", "d", "Ġ", "4", "2", "<|im_end|>"]
    assert tok.decode(ids) == "hello world 42"
    assert tok.decode(ids, skip_special_tokens=False) == "hello world 42<|im_end|>"
    assert tok.eos_token_ids == {2} and tok.bos_token_id == 1
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(text)[:2] == [1, vocab.index("u")]
