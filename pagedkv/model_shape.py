"""ModelShape: the one description of a model's dimensions, and the KV bytes they imply.

Pure Python (no torch, no numpy): the runner, the engine, ``pagedkv size`` and ``pagedkv simulate``
all import it, and a test proves it imports nothing heavy. It owns

- the shape facts: model type, layers, heads, KV heads, head dim, hidden/intermediate/vocab sizes,
  context length, sliding window, biases, MLA ranks and MoE figures (enough to count parameters);
- the one reader of a Hugging Face ``config.json`` dict (:func:`shape_from_hf_dict`) and of GGUF
  metadata (:func:`shape_from_gguf`), with one set of defaults: transformers' own, by model type,
  for keys a config may leave out;
- KV bytes per token and per block for every KV dtype, tensor-parallel KV heads per rank, and the
  block-size bounds every layer validates with.

One KV block, per rank (the runner's pool ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``
holds exactly this for each block id)::

    layer 0: K [block_size, kv_heads_per_rank, head_dim]  V [same]
    ...                                                           = block_size * kv_bytes_per_token
    layer L-1: K ...                                      V ...
    + 8-bit kinds only: one fp32 scale per layer, K/V and KV head = scale_bytes_per_block

    kv_bytes_per_token = layers * 2 * kv_heads_per_rank * head_dim * dtype_bytes
    MLA:                 layers * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes  (one latent,
                         every rank holds all of it; one scale per layer for 8-bit kinds)

KV kinds (``--kv-cache-dtype`` of the engine, ``--kv-dtype`` of ``pagedkv size``/``simulate``):
``float32 bfloat16 float16`` (no scales) and ``int8 fp8_e4m3 fp8_e5m2`` (one scale per block,
layer, K/V and KV head, as the runner stores them); ``fp32 fp16 bf16`` and torch's dtype names are
aliases, and ``fp8`` means ``fp8_e4m3`` (vLLM's spelling).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Block sizes (token slots per KV block) every layer accepts: EngineConfig (the user-facing limit),
# the runner's KVCache and `pagedkv size`, which sizes only blocks the engine can run.
MIN_BLOCK_SIZE = 1
MAX_BLOCK_SIZE = 256

KV_DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "fp8_e4m3": 1,
                                  "fp8_e5m2": 1}
KV_DTYPE_ALIASES: dict[str, str] = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
                                    "fp8": "fp8_e4m3",  # vLLM's alias
                                    "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}  # torch's names
SCALED_KV_DTYPES = frozenset({"int8", "fp8_e4m3", "fp8_e5m2"})  # one fp32 scale per block, layer, K/V, head
# What the engine's kv_cache_dtype / --kv-cache-dtype accepts ("auto": the model dtype).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
SCALE_BYTES = 4

# transformers' defaults for keys a config.json may leave out, by model_type (LlamaConfig's for any
# other type). Both readers apply them, so a GGUF file and its config.json give the same shape.
# num_key_value_heads defaults to num_attention_heads (LlamaConfig, Qwen2Config, llama.cpp; not
# MistralConfig's 8) and head_dim to hidden_size // num_attention_heads.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "intermediate_size": 11008, "max_position_embeddings": 2048},
    "mistral": {"vocab_size": 32000, "intermediate_size": 14336, "max_position_embeddings": 131072,
                "sliding_window": 4096},
    "qwen2": {"vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768},
    "qwen3": {"vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768,
              "head_dim": 128},
    "phi3": {"vocab_size": 32064, "intermediate_size": 8192, "max_position_embeddings": 4096},
    "mixtral": {"vocab_size": 32000, "intermediate_size": 14336, "max_position_embeddings": 131072},
    "deepseek_v2": {"vocab_size": 102400, "intermediate_size": 11008, "max_position_embeddings": 2048},
}
_HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                     "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3",
                     "MixtralForCausalLM": "mixtral",
                     "DeepseekV2ForCausalLM": "deepseek_v2"}
_GGUF_MODEL_TYPES = {"deepseek2": "deepseek_v2"}  # llama.cpp architecture -> HF model_type
_REQUIRED = ("hidden_size", "num_attention_heads", "num_hidden_layers")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """Dimensions of a decoder-only transformer (names as in ``config.json``).

    MLA models set ``kv_lora_rank`` and ``qk_rope_head_dim``: their KV cache holds one latent per
    token per layer instead of K and V per KV head. ``attention_bias`` is the q/k/v bias (qwen2
    always; llama's ``attention_bias`` also puts one on o_proj: ``o_proj_bias``). ``name``,
    ``num_params`` and ``weight_bytes`` (a GGUF file's own tensor figures, which override the
    computed ones) say where the shape came from and are left out of equality.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (qwen3)
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    q_lora_rank: int | None = None
    num_experts: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense: int = 0
    name: str = field(default="", compare=False)
    num_params: int | None = field(default=None, compare=False)
    weight_bytes: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def param_count(self) -> int:
        """Parameters (the given ``num_params``, else computed from the dimensions): Llama-family
        layout, Mixtral-style MoE, DeepSeek-V2 MLA with routed + shared experts."""
        if self.num_params is not None:
            return self.num_params
        h, V, H = self.hidden_size, self.vocab_size, self.num_attention_heads
        embed = V * h * (1 if self.tie_word_embeddings else 2) + h  # + final norm
        if self.is_mla:
            rope, nope = self.qk_rope_head_dim or 0, self.qk_nope_head_dim or 0
            v_dim, rank = self.v_head_dim or self.head_dim, self.kv_lora_rank or 0
            if self.q_lora_rank:
                q = h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * H * (nope + rope)
            else:
                q = h * H * (nope + rope)
            attn = q + h * (rank + rope) + rank + rank * H * (nope + v_dim) + H * v_dim * h
        else:
            attn = 2 * h * self.q_size + 2 * h * self.kv_size  # q, k, v, o
            if self.attention_bias:
                attn += self.q_size + 2 * self.kv_size
            if self.o_proj_bias:
                attn += h
            if self.qk_norm:
                attn += 2 * self.head_dim
        dense_mlp = 3 * h * self.intermediate_size  # gate, up, down
        if self.mlp_bias:
            dense_mlp += 2 * self.intermediate_size + h
        if self.num_experts:
            expert = 3 * h * self.moe_intermediate_size
            moe_mlp = (self.num_experts + self.num_shared_experts) * expert + self.num_experts * h
            mlp = self.first_k_dense * dense_mlp + (self.num_hidden_layers - self.first_k_dense) * moe_mlp
        else:
            mlp = self.num_hidden_layers * dense_mlp
        return embed + self.num_hidden_layers * (attn + 2 * h) + mlp  # 2 norms per layer


def check_block_size(block_size: object, name: str = "block_size") -> int:
    """``block_size`` if it is an int in ``MIN_BLOCK_SIZE .. MAX_BLOCK_SIZE``; else ValueError
    naming ``name`` (the field or flag the caller reads it from) and the range."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) \
            or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"{name} must be an integer in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], "
                         f"got {block_size!r}")
    return block_size


def kv_dtype_name(kv_dtype: str) -> str:
    """The canonical name of a KV kind (``fp16`` -> ``float16``, ``fp8`` -> ``fp8_e4m3``); raises
    ValueError naming the accepted kinds."""
    kind = KV_DTYPE_ALIASES.get(kv_dtype, kv_dtype)
    if kind not in KV_DTYPE_BYTES:
        raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPE_BYTES)} (or "
                         f"{', '.join(KV_DTYPE_ALIASES)}), got {kv_dtype!r}")
    return kind


def kv_dtype_bytes(kv_dtype: str) -> int:
    """Bytes of one KV element of a KV kind (any accepted name, see :func:`kv_dtype_name`)."""
    return KV_DTYPE_BYTES[kv_dtype_name(kv_dtype)]


def kv_heads_per_rank(shape: ModelShape, tp: int = 1) -> int:
    """KV heads each tensor-parallel rank stores: ``num_key_value_heads / tp``, or 1 replicated head
    when ``tp`` is a multiple of the heads (MLA: 1, the latent is not split). Raises ValueError
    naming ``--tp`` when the heads do not split."""
    heads = shape.num_key_value_heads
    if shape.is_mla:
        return 1
    if tp <= heads:
        if heads % tp:
            raise ValueError(f"--tp: {tp} does not divide the {heads} KV heads of {shape.name}")
        return heads // tp
    if tp % heads:
        raise ValueError(f"--tp: {tp} is above the {heads} KV heads of {shape.name} and not a "
                         f"multiple of them (heads are replicated, at least 1 per rank)")
    return 1


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str, tp: int = 1) -> int:
    """KV bytes one token takes on one rank, K and V of every layer (see the module diagram)."""
    per_layer = ((shape.kv_lora_rank or 0) + (shape.qk_rope_head_dim or 0) if shape.is_mla
                 else 2 * kv_heads_per_rank(shape, tp) * shape.head_dim)
    return shape.num_hidden_layers * per_layer * kv_dtype_bytes(kv_dtype)


def scale_bytes_per_block(shape: ModelShape, kv_dtype: str, tp: int = 1) -> int:
    """Per-block scale bytes: the 8-bit kinds keep one fp32 scale per layer, K/V and KV head (MLA:
    per layer); the float kinds none."""
    if kv_dtype_name(kv_dtype) not in SCALED_KV_DTYPES:
        return 0
    per_layer = 1 if shape.is_mla else 2 * kv_heads_per_rank(shape, tp)
    return shape.num_hidden_layers * per_layer * SCALE_BYTES


def kv_bytes_per_block(shape: ModelShape, block_size: int, kv_dtype: str, tp: int = 1) -> int:
    """Bytes one KV block takes on one rank: ``block_size`` tokens plus the scale bytes."""
    check_block_size(block_size)
    return block_size * kv_bytes_per_token(shape, kv_dtype, tp) + scale_bytes_per_block(shape, kv_dtype, tp)


def hf_text_config(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` with its nested ``text_config`` merged in when the top level lacks the shape keys
    (multimodal configs keep the language model there)."""
    text = d.get("text_config")
    if isinstance(text, dict) and any(key not in d for key in _REQUIRED):
        return {**d, **text}
    return d


def shape_from_hf_dict(d: dict[str, Any], name: str = "") -> ModelShape:
    """Read a Hugging Face ``config.json`` dict. ``model_type`` comes from the ``model_type`` key
    (else the first known ``architectures`` entry); keys it leaves out take transformers' defaults
    for that type. Raises ValueError naming a missing ``hidden_size``, ``num_attention_heads`` or
    ``num_hidden_layers``."""
    d = hf_text_config(d)
    missing = [key for key in _REQUIRED if d.get(key) is None]
    if missing:
        raise ValueError(f"config.json lacks required key {missing[0]!r}")
    model_type = str(d.get("model_type") or next(
        (_HF_ARCHITECTURES[a] for a in d.get("architectures") or [] if a in _HF_ARCHITECTURES), ""))
    defaults = _HF_DEFAULTS.get(model_type, _HF_DEFAULTS["llama"])

    def get(key: str) -> Any:
        value = d.get(key)
        return defaults.get(key) if value is None else value

    hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    if model_type == "qwen2":  # q/k/v bias always; a window only with use_sliding_window
        qkv_bias, o_bias = True, False
        window = d.get("sliding_window") if d.get("use_sliding_window") else None
    elif model_type == "qwen3":  # attention_bias covers q/k/v and o_proj; a window only with use_sliding_window
        qkv_bias = o_bias = bool(d.get("attention_bias", False))
        window = d.get("sliding_window") if d.get("use_sliding_window") else None
    elif model_type == "phi3":  # no biases; Phi-3 mini 4k has a 2047-token window
        qkv_bias = o_bias = False
        window = d.get("sliding_window")
    else:  # llama's attention_bias covers o_proj too; mistral has none
        qkv_bias = o_bias = model_type != "mistral" and bool(d.get("attention_bias", False))
        window = d.get("sliding_window", defaults.get("sliding_window"))
    experts = int(d.get("n_routed_experts") or d.get("num_local_experts") or 0)
    return ModelShape(
        model_type=model_type,
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")),
        num_hidden_layers=int(d["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or defaults.get("head_dim") or hidden // heads),
        max_position_embeddings=int(get("max_position_embeddings")),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=qkv_bias,
        o_proj_bias=o_bias,
        mlp_bias=bool(d.get("mlp_bias", False)),
        sliding_window=int(window) if window else None,
        qk_norm=model_type == "qwen3",
        kv_lora_rank=_opt_int(d.get("kv_lora_rank")),
        qk_rope_head_dim=_opt_int(d.get("qk_rope_head_dim")),
        qk_nope_head_dim=_opt_int(d.get("qk_nope_head_dim")),
        v_head_dim=_opt_int(d.get("v_head_dim")),
        q_lora_rank=_opt_int(d.get("q_lora_rank")),
        num_experts=experts,
        num_shared_experts=int(d.get("n_shared_experts") or 0),
        moe_intermediate_size=int(d.get("moe_intermediate_size") or (get("intermediate_size") if experts else 0)),
        first_k_dense=int(d.get("first_k_dense_replace") or 0),
        name=str(d.get("_name_or_path") or name),
    )


def shape_from_gguf(reader: Any, name: str = "") -> ModelShape:
    """Read GGUF metadata and tensor names from a ``gguf.GGUFReader`` (its ``fields`` and
    ``tensors``; this module does not import gguf). Per-layer lists (some architectures store head
    counts per layer) read as their maximum. ``num_params`` and ``weight_bytes`` are the file's own
    tensor figures (quantized as stored). The output head is tied when there is no
    ``output.weight``; q/k/v carry a bias when ``blk.0.attn_q.bias`` exists (qwen2 always).
    Raises ValueError when the file names no architecture."""

    def get(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        if f is None:
            return default
        value = f.contents()
        return max(value) if isinstance(value, list) and value else value

    arch = get("general.architecture")
    if arch is None:
        raise ValueError("GGUF file has no general.architecture; not a model GGUF")
    model_type = _GGUF_MODEL_TYPES.get(str(arch), str(arch))
    defaults = _HF_DEFAULTS.get(model_type, _HF_DEFAULTS["llama"])

    def key(suffix: str, default: Any = None) -> Any:
        return get(f"{arch}.{suffix}", default)

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    kv_lora, rope_dim = _opt_int(key("attention.kv_lora_rank")), _opt_int(key("rope.dimension_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    experts = int(key("expert_count", 0) or 0)
    return ModelShape(
        model_type=model_type,
        vocab_size=int(key("vocab_size") or (len(tokens.data) if tokens is not None else 0)
                       or defaults["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length", defaults["intermediate_size"])),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(key("context_length", defaults["max_position_embeddings"])),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=model_type == "qwen2" or "blk.0.attn_q.bias" in names,
        o_proj_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        sliding_window=_opt_int(key("attention.sliding_window")) if model_type == "phi3" else None,
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope_dim if kv_lora is not None else None,
        qk_nope_head_dim=head_dim - (rope_dim or 0) if kv_lora is not None else None,
        v_head_dim=_opt_int(key("attention.value_length")) if kv_lora is not None else None,
        q_lora_rank=_opt_int(key("attention.q_lora_rank")),
        num_experts=experts,
        num_shared_experts=int(key("expert_shared_count", 0) or 0),
        moe_intermediate_size=int(key("expert_feed_forward_length", 0) or 0),
        first_k_dense=int(key("leading_dense_block_count", 0) or 0),
        name=str(get("general.name", name)),
        num_params=sum(int(t.n_elements) for t in reader.tensors),
        weight_bytes=sum(int(t.n_bytes) for t in reader.tensors),
    )


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)
