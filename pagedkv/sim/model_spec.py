"""The model dimensions that decide KV memory, read from a HF ``config.json`` or a GGUF file.

Only shapes are read, never weights: the sizing tool runs without torch or a model download.
Parameter counts follow the Llama-family layout (Llama, Mistral, Qwen2 with q/k/v bias), Mixtral-style
MoE and DeepSeek-V2's MLA attention with routed + shared experts. A GGUF file gives its exact tensor
element count and byte size instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Transformer dimensions. MLA models set ``kv_lora_rank`` and ``qk_rope_head_dim``: their KV
    cache holds one latent of ``kv_lora_rank + qk_rope_head_dim`` values per token per layer instead
    of K and V per KV head. ``num_params``/``weight_bytes`` override the computed figures."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    q_lora_rank: int | None = None
    num_experts: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense: int = 0
    num_params: int | None = None
    weight_bytes: int | None = None

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    def param_count(self) -> int:
        """Parameters (the given ``num_params``, else computed from the dimensions)."""
        if self.num_params is not None:
            return self.num_params
        h, V = self.hidden_size, self.vocab_size
        embed = V * h * (1 if self.tie_word_embeddings else 2) + h  # + final norm
        per_layer_norms = 2 * h
        if self.is_mla:
            H = self.num_heads
            rope, nope = self.qk_rope_head_dim or 0, self.qk_nope_head_dim or 0
            v_dim, rank = self.v_head_dim or self.head_dim, self.kv_lora_rank or 0
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * H * (nope + rope)
            else:
                q = h * H * (nope + rope)
            attn = q + h * (rank + rope) + rank + rank * H * (nope + v_dim) + H * v_dim * h
        else:
            q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            attn = h * q_out + 2 * h * kv_out + q_out * h
            if self.qkv_bias:
                attn += q_out + 2 * kv_out
        dense_mlp = 3 * h * self.intermediate_size
        if self.num_experts:
            expert = 3 * h * self.moe_intermediate_size
            moe_mlp = (self.num_experts + self.num_shared_experts) * expert + self.num_experts * h
            moe_layers = self.num_layers - self.first_k_dense
            mlp = self.first_k_dense * dense_mlp + moe_layers * moe_mlp
        else:
            mlp = self.num_layers * dense_mlp
        return embed + self.num_layers * (attn + per_layer_norms) + mlp


def load_model_spec(source: str) -> ModelSpec:
    """A preset name, a ``config.json`` (or a folder holding one), or a ``.gguf`` file.

    Raises ``ValueError`` naming the argument when none of these matches.
    """
    from pagedkv.sim.presets import PRESETS, find_preset

    preset = find_preset(source)
    if preset is not None:
        return preset
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".gguf" and path.is_file():
        return spec_from_gguf(path)
    if path.is_file():
        return spec_from_hf_config(path)
    raise ValueError(f"MODEL: {source!r} is neither a preset ({', '.join(PRESETS)}), "
                     f"a config.json (or its folder) nor a .gguf file")


def spec_from_hf_config(path: str | Path) -> ModelSpec:
    """Read a Hugging Face ``config.json`` (nested ``text_config`` is followed)."""
    with open(path) as handle:
        cfg: dict[str, Any] = json.load(handle)
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
    except KeyError as exc:
        raise ValueError(f"MODEL: {path} lacks {exc.args[0]!r}; not a transformer config") from None
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    moe_inter = int(cfg.get("moe_intermediate_size") or (cfg["intermediate_size"] if experts else 0))
    return ModelSpec(
        name=str(cfg.get("_name_or_path") or Path(path).parent.name or "config"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        hidden_size=hidden,
        intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden),
        vocab_size=int(cfg.get("vocab_size") or 32000),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
        kv_lora_rank=cfg.get("kv_lora_rank"),
        qk_rope_head_dim=cfg.get("qk_rope_head_dim"),
        qk_nope_head_dim=cfg.get("qk_nope_head_dim"),
        v_head_dim=cfg.get("v_head_dim"),
        q_lora_rank=cfg.get("q_lora_rank"),
        num_experts=experts,
        num_shared_experts=int(cfg.get("n_shared_experts") or 0),
        moe_intermediate_size=moe_inter,
        first_k_dense=int(cfg.get("first_k_dense_replace") or 0),
    )


def spec_from_gguf(path: str | Path) -> ModelSpec:
    """Read a GGUF file's metadata with the ``gguf`` package (imported here, not at start-up).

    The parameter count and weight bytes are the file's own tensor sizes (quantized as stored).
    """
    import gguf  # lazy: pulls numpy, needed only for GGUF files

    reader = gguf.GGUFReader(str(path))

    def get(key: str, default: Any = None) -> Any:
        field = reader.fields.get(key)
        if field is None:
            return default
        value = field.contents()
        return max(value) if isinstance(value, list) and value else value

    arch = get("general.architecture")
    if arch is None:
        raise ValueError(f"MODEL: {path} has no general.architecture; not a model GGUF")
    heads = int(get(f"{arch}.attention.head_count"))
    hidden = int(get(f"{arch}.embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = get(f"{arch}.vocab_size") or (len(tokens.data) if tokens is not None else 0)
    kv_lora = get(f"{arch}.attention.kv_lora_rank")
    return ModelSpec(
        name=str(get("general.name", Path(path).stem)),
        num_layers=int(get(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(get(f"{arch}.attention.key_length", hidden // heads)),
        hidden_size=hidden,
        intermediate_size=int(get(f"{arch}.feed_forward_length", 4 * hidden)),
        vocab_size=int(vocab),
        max_position_embeddings=int(get(f"{arch}.context_length", 4096)),
        kv_lora_rank=int(kv_lora) if kv_lora is not None else None,
        qk_rope_head_dim=int(get(f"{arch}.rope.dimension_count")) if kv_lora is not None else None,
        num_params=sum(int(t.n_elements) for t in reader.tensors),
        weight_bytes=sum(int(t.n_bytes) for t in reader.tensors),
    )
