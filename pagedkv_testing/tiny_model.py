"""A tiny random Llama model folder for server tests and benchmarks (seconds to build, ms per step).

The folder is a normal Hugging Face layout (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a chat template), so the engine loads it like any model. The tokenizer
is byte-level BPE trained on a few sentences: any text encodes, and decoding never loses bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "paged attention keeps the key value cache in fixed size blocks",
    "a block table maps logical blocks to physical blocks",
    "hello world, this is a tiny model for testing the server",
    "Once upon a time there was a little engine that could serve many requests at once.",
]


def write_tiny_model(
    folder: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    seed: int = 0,
) -> Path:
    """Write a random Llama folder into ``folder`` and return its path."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    vocab_size = tok.get_vocab_size()
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE,
    }))

    head_dim = hidden_size // num_heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-5,
        "max_position_embeddings": max_position_embeddings, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": bos, "eos_token_id": eos, "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))

    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.5 / shape[-1] ** 0.5 * 4

    kv = num_kv_heads * head_dim
    tensors = {
        "model.embed_tokens.weight": torch.randn(vocab_size, hidden_size, generator=g),
        "model.norm.weight": torch.ones(hidden_size),
        "lm_head.weight": rand(vocab_size, hidden_size),
    }
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(num_heads * head_dim, hidden_size),
            p + "self_attn.k_proj.weight": rand(kv, hidden_size),
            p + "self_attn.v_proj.weight": rand(kv, hidden_size),
            p + "self_attn.o_proj.weight": rand(hidden_size, num_heads * head_dim),
            p + "mlp.gate_proj.weight": rand(intermediate_size, hidden_size),
            p + "mlp.up_proj.weight": rand(intermediate_size, hidden_size),
            p + "mlp.down_proj.weight": rand(hidden_size, intermediate_size),
            p + "input_layernorm.weight": torch.ones(hidden_size),
            p + "post_attention_layernorm.weight": torch.ones(hidden_size),
        }
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder
