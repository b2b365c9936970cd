"""Built-in model shapes for ``pagedkv size`` (from each model's published ``config.json``)."""

from __future__ import annotations

from pagedkv.model_shape import FULL_ATTENTION, SLIDING_ATTENTION, ModelShape


def _llama(name: str, model_type: str, layers: int, hidden: int, heads: int, kv_heads: int, inter: int,
           vocab: int, max_len: int, *, tie_word_embeddings: bool = False, attention_bias: bool = False
           ) -> ModelShape:
    return ModelShape(name=name, model_type=model_type, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=hidden // heads, hidden_size=hidden,
                      intermediate_size=inter, vocab_size=vocab, max_position_embeddings=max_len,
                      tie_word_embeddings=tie_word_embeddings, attention_bias=attention_bias)


def _gemma3(name: str, layers: int, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int,
            window: int, max_len: int) -> ModelShape:
    # five sliding-window layers to one global layer: the KV cache keeps them in groups
    types = tuple(SLIDING_ATTENTION if (i + 1) % 6 else FULL_ATTENTION for i in range(layers))
    return ModelShape(name=name, model_type="gemma3", num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=head_dim, hidden_size=hidden,
                      intermediate_size=inter, vocab_size=262144, max_position_embeddings=max_len,
                      tie_word_embeddings=True, qk_norm=True, sliding_window=window, layer_types=types)


PRESETS: dict[str, ModelShape] = {
    "llama-2-7b": _llama("Llama-2-7B", "llama", 32, 4096, 32, 32, 11008, 32000, 4096),
    "llama-2-13b": _llama("Llama-2-13B", "llama", 40, 5120, 40, 40, 13824, 32000, 4096),
    "llama-2-70b": _llama("Llama-2-70B", "llama", 80, 8192, 64, 8, 28672, 32000, 4096),
    "llama-3-8b": _llama("Llama-3-8B", "llama", 32, 4096, 32, 8, 14336, 128256, 8192),
    "llama-3-70b": _llama("Llama-3-70B", "llama", 80, 8192, 64, 8, 28672, 128256, 8192),
    "mistral-7b": _llama("Mistral-7B-v0.1", "mistral", 32, 4096, 32, 8, 14336, 32000, 32768),
    "qwen2.5-7b": _llama("Qwen2.5-7B", "qwen2", 28, 3584, 28, 4, 18944, 152064, 32768,
                         attention_bias=True),
    "smollm2-135m": _llama("SmolLM2-135M", "llama", 30, 576, 9, 3, 1536, 49152, 8192,
                           tie_word_embeddings=True),
    "gemma-3-1b": _gemma3("Gemma-3-1B", 26, 1152, 4, 1, 256, 6912, 512, 32768),
    "gemma-3-4b": _gemma3("Gemma-3-4B", 34, 2560, 8, 4, 256, 10240, 1024, 131072),
    "gemma-3-12b": _gemma3("Gemma-3-12B", 48, 3840, 16, 8, 256, 15360, 1024, 131072),
    "gemma-3-27b": _gemma3("Gemma-3-27B", 62, 5376, 32, 16, 128, 21504, 1024, 131072),
    # MLA: the cache holds a 512-value latent + a 64-value RoPE key per token per layer.
    "deepseek-v2-lite": ModelShape(
        name="DeepSeek-V2-Lite", model_type="deepseek_v2", num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, head_dim=192, hidden_size=2048, intermediate_size=10944,
        vocab_size=102400, max_position_embeddings=163840, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None, num_experts=64,
        num_shared_experts=2, moe_intermediate_size=1408, first_k_dense=1),
}


def find_preset(name: str) -> ModelShape | None:
    """The preset called ``name`` (case-insensitive; ``_`` and spaces read as ``-``), or None."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    return PRESETS.get(key)
