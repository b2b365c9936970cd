"""Make the GGUF fixtures of tests/models/test_moe_gguf.py: tiny random mixture-of-experts and MLA
models built with transformers, converted with llama.cpp's ``convert_hf_to_gguf.py`` (f32).

Run once (the files are committed under tests/data/gguf/)::

    PYTHONPATH=/path/to/llama.cpp/gguf-py .venv/bin/python tests/data/make_moe_gguf.py /path/to/llama.cpp

``/path/to/llama.cpp`` holds ``convert_hf_to_gguf.py`` with its ``conversion/`` folder beside it (the
llama-cpp-python sdist's ``vendor/llama.cpp``). Two things are done around the converter:

- the tiny byte-level tokenizer has no pre-tokenizer hash llama.cpp knows, so its check
  (``get_vocab_base_pre``) is answered "default" (the tests use token ids, not text), and the llama
  architecture (Mixtral) goes straight to that byte-level vocabulary (its first try, a
  SentencePiece model, is absent from the folder);
- ``deepseek2_kvb_fused.gguf`` is the converter's output rewritten into the older DeepSeek layout
  (llama.cpp before the split): ``attn_k_b`` / ``attn_v_b`` joined back into one ``attn_kv_b`` (the
  checkpoint's ``kv_b_proj``), every other key and tensor copied as is.

The test rebuilds each reference model from :data:`MODELS` with the same seed (``build``), so a
fixture and its transformers model always carry the same weights (the test checks one tensor).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent / "gguf"
SPECIALS = ["<|endoftext|>", "<|bos|>", "<|eos|>"]
BASE: dict[str, Any] = dict(vocab_size=259, hidden_size=40, intermediate_size=44, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
MLA: dict[str, Any] = dict(hidden_size=42, num_key_value_heads=3, num_attention_heads=3, n_routed_experts=8,
                           num_experts_per_tok=3, moe_intermediate_size=12, first_k_dense_replace=1,
                           kv_lora_rank=20, qk_rope_head_dim=6, qk_nope_head_dim=10, v_head_dim=14)
# DeepSeek's YaRN: mscale == mscale_all_dim as in the released configs (GGUF stores only the latter)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 0.8, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
# fixture stem -> (transformers config class, model class, config overrides, seed)
MODELS: dict[str, tuple[str, str, dict[str, Any], int]] = {
    # V2-Lite's layout: no q_lora_rank (attn_q), softmax greedy routing, a shared expert
    "deepseek2_v2lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        **MLA, "q_lora_rank": None, "n_shared_experts": 1, "topk_method": "greedy"}, 11),
    # V3: q_lora_rank (attn_q_a / attn_q_a_norm / attn_q_b), sigmoid + exp_probs_b, n_group/topk_group,
    # first_k_dense_replace, scaled weights, YaRN
    "deepseek2_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        **MLA, "q_lora_rank": 18, "n_shared_experts": 1, "n_group": 4, "topk_group": 2,
        "routed_scaling_factor": 2.5, "rope_interleave": True, "rope_parameters": YARN}, 12),
    # V3 again (other seed), written with the fused attn_kv_b of older llama.cpp files
    "deepseek2_kvb_fused": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        **MLA, "q_lora_rank": 18, "n_shared_experts": 2, "n_group": 2, "topk_group": 1,
        "routed_scaling_factor": 1.5, "rope_interleave": True}, 13),
    # Qwen3-MoE: per-head q/k norms, head_dim off hidden / heads, renormalized top-k (llama.cpp's
    # qwen3moe has no dense layers: mlp_only_layers cannot be written)
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 14, "norm_topk_prob": True,
        "head_dim": 12}, 14),
    # Qwen2-MoE: gated shared expert, top-k not renormalized
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 14,
        "shared_expert_intermediate_size": 18, "norm_topk_prob": False}, 15),
    # Mixtral: llama architecture with ffn_*_exps and ffn_gate_inp (q/k rows permuted by llama.cpp)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 5, "num_experts_per_tok": 2, "intermediate_size": 16}, 16),
}


def build(stem: str) -> torch.nn.Module:
    """The transformers model of fixture ``stem``, float32, weights drawn from its seed."""
    import transformers

    cfg_cls, model_cls, overrides, seed = MODELS[stem]
    config = getattr(transformers, cfg_cls)(**{**BASE, **overrides})
    torch.manual_seed(seed)
    # eager experts and attention: the reference the tests compare with (grouped_mm wants 16-byte strides)
    model = getattr(transformers, model_cls)._from_config(config, attn_implementation="eager",
                                                          experts_implementation="eager").float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # O(1) activations (HF's 0.02 init gives near-uniform logits and greedy ties)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("bias", "e_score_correction_bias")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():  # a correction bias that changes the choice
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=gen))
    return model


def _save_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[1], eos_token=SPECIALS[2],
                                   unk_token=None)
    fast.save_pretrained(folder)


def _convert(llama_cpp: Path, folder: Path, out: Path) -> None:
    sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    # llama.cpp's converter is not installed: it is imported from the folder given on the command line.
    import convert_hf_to_gguf  # type: ignore[import-not-found]  # from llama_cpp's folder, not installed
    from conversion import base, llama  # type: ignore[import-not-found]  # the same folder

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"  # the module docstring
    llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(folder), "--outtype", "f32", "--outfile", str(out)]
    try:
        convert_hf_to_gguf.main()
    finally:
        sys.argv = argv


def _fuse_kv_b(src: Path, dst: Path) -> None:
    """Rewrite ``src`` with each layer's attn_k_b ([H, rank, nope], K transposed) and attn_v_b
    ([H, v, rank]) joined into attn_kv_b ([H * (nope + v), rank], kv_b_proj's rows)."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.name.endswith("attn_v_b.weight"):
            continue
        if t.name.endswith("attn_k_b.weight"):
            k_b = np.asarray(t.data, dtype=np.float32).transpose(0, 2, 1)  # stored [H, rank, nope]
            v_b = np.asarray(tensors[t.name.replace("attn_k_b", "attn_v_b")].data, dtype=np.float32)  # [H, v, rank]
            kv_b = np.concatenate((k_b, v_b), axis=1)
            writer.add_tensor(t.name.replace("attn_k_b", "attn_kv_b"), kv_b.reshape(-1, kv_b.shape[-1]))
            continue
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    import tempfile

    llama_cpp = Path(sys.argv[1])
    HERE.mkdir(parents=True, exist_ok=True)
    for stem in MODELS:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "model"
            build(stem).save_pretrained(folder, safe_serialization=True)
            _save_tokenizer(folder)
            out = HERE / f"{stem}.gguf"
            if stem.endswith("_fused"):
                split = Path(tmp) / "split.gguf"
                _convert(llama_cpp, folder, split)
                _fuse_kv_b(split, out)
            else:
                _convert(llama_cpp, folder, out)
        print(f"{out}: {out.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
