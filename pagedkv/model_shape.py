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

    (A hybrid model, with full and sliding-window layers, groups them, ``kv_groups``: a block then
    holds ``layers`` = the group size, and a sequence has one block table per group.)
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
    "gemma3": {"vocab_size": 262208, "intermediate_size": 9216, "max_position_embeddings": 131072,
               "sliding_window": 4096, "head_dim": 256},
    "gemma2": {"vocab_size": 256000, "intermediate_size": 9216, "max_position_embeddings": 8192,
               "sliding_window": 4096, "head_dim": 256},
    "mixtral": {"vocab_size": 32000, "intermediate_size": 14336, "max_position_embeddings": 131072},
    "deepseek_v2": {"vocab_size": 102400, "intermediate_size": 11008, "max_position_embeddings": 2048},
    "qwen2_moe": {"vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768},
    "qwen3_moe": {"vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768,
                  "head_dim": 128},
}
_HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                     "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3",
                     "Gemma3ForCausalLM": "gemma3", "Gemma3ForConditionalGeneration": "gemma3",
                     "Gemma2ForCausalLM": "gemma2",
                     "MixtralForCausalLM": "mixtral",
                     "DeepseekV2ForCausalLM": "deepseek_v2",
                     "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe"}
_GGUF_MODEL_TYPES = {"deepseek2": "deepseek_v2", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}  # llama.cpp -> HF
_MODEL_TYPE_ALIASES = {"gemma3_text": "gemma3"}  # config.json model_type -> ours
# Attention kinds of a layer (config.json "layer_types"): every earlier token visible, or only the
# last ``sliding_window`` of them.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
_SLIDING_PATTERN = {"gemma3": 6, "gemma2": 2}  # older configs: every n-th layer global, the others sliding
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
    # Per layer, FULL_ATTENTION or SLIDING_ATTENTION (the window is ``sliding_window``); empty: every
    # layer is alike, windowed when ``sliding_window`` is set (mistral, phi3).
    layer_types: tuple[str, ...] = ()
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (qwen3, gemma3)
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
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_hidden_layers} layers")
            bad = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
            if bad:
                raise ValueError(f"unknown layer type {bad[0]!r} (known: {FULL_ATTENTION}, {SLIDING_ATTENTION})")
            if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
                raise ValueError("sliding_attention layers need a sliding_window")

    def layer_window(self, layer: int) -> int | None:
        """The attention window of ``layer`` (None: it sees every earlier token)."""
        if self.layer_types and self.layer_types[layer] == FULL_ATTENTION:
            return None
        return self.sliding_window

    @property
    def is_hybrid(self) -> bool:
        """Layers of both kinds, full and sliding-window attention (Gemma 2/3): the KV cache keeps
        them in separate groups (:func:`kv_groups`)."""
        return len(set(self.layer_types)) > 1

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


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers whose KV share block tables: a block of the pool holds one block of tokens for each
    of them (``layers``; a group with fewer layers than the pool's slots leaves the rest unused).
    ``window``: the group's layers see only the last ``window`` tokens, so its blocks that fall
    out of every query's window are released as decoding goes on (None: all are kept)."""

    window: int | None
    layers: tuple[int, ...]


def kv_groups(shape: ModelShape) -> tuple[KVGroup, ...]:
    """How the KV cache groups the layers; one group of every layer unless the model is hybrid.

    A hybrid model (full and sliding-window layers, Gemma 2/3) gets groups of at most ``size``
    layers of one kind each, full groups first: every group has its own block tables over the one
    pool, and a block holds ``size`` layers (:func:`kv_layer_slots`). ``size`` is chosen to keep
    padding slots and the number of groups (block tables per sequence) both low: Gemma 3 27B (62
    layers, 10 full) gets 1 full + 6 sliding groups of 10 slots. Model-wide windows (mistral) stay
    one group: its window is applied as a mask and its blocks are kept."""
    layers = range(shape.num_hidden_layers)
    if not shape.is_hybrid:
        return (KVGroup(None, tuple(layers)),)
    full = [i for i in layers if shape.layer_window(i) is None]
    sliding = [i for i in layers if shape.layer_window(i) is not None]

    def groups_of(size: int) -> int:
        return -(-len(full) // size) + -(-len(sliding) // size)

    size = min(range(1, min(len(full), len(sliding)) + 1),
               key=lambda n: (n * groups_of(n) + groups_of(n), -n))  # slots + tables, then bigger
    out = [KVGroup(None, tuple(full[i:i + size])) for i in range(0, len(full), size)]
    out += [KVGroup(shape.sliding_window, tuple(sliding[i:i + size])) for i in range(0, len(sliding), size)]
    return tuple(out)


def kv_layer_slots(shape: ModelShape) -> int:
    """Layers one KV block holds: every layer, or a hybrid model's group size (:func:`kv_groups`)."""
    return max(len(g.layers) for g in kv_groups(shape))


def kv_blocks_per_sequence(shape: ModelShape, num_tokens: int, block_size: int) -> int:
    """Blocks a sequence of ``num_tokens`` holds while it decodes: every group's blocks of all its
    tokens, except a sliding group's, which holds the blocks that its next query can still see
    (the window, plus the partly filled block at each end)."""
    check_block_size(block_size)
    total = 0
    for group in kv_groups(shape):
        blocks = -(-num_tokens // block_size)
        if group.window is not None and num_tokens > group.window:
            first_visible = (num_tokens - group.window + 1) // block_size  # for the next query
            blocks -= first_visible
        total += blocks
    return total


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


KV_QUANT_PARTS = ("kv", "v")  # kv_quant_parts: K and V 8-bit, or V 8-bit with K at the model dtype


def check_kv_quant_parts(parts: object, kv_dtype: str, name: str = "kv_quant_parts") -> str:
    """``parts`` if it is one of :data:`KV_QUANT_PARTS` that fits ``kv_dtype``: "kv" (K and V in
    ``kv_dtype``) always, "v" (V 8-bit, K at the model dtype) only with an 8-bit ``kv_dtype``, since
    it says which part the 8 bits hold. ValueError naming ``name`` and the accepted values otherwise
    ("k", K 8-bit with V at full precision, is not offered: K's error dominates, measured in
    docs/kv_quantization.md)."""
    if parts not in KV_QUANT_PARTS:
        raise ValueError(f"{name} must be one of {', '.join(KV_QUANT_PARTS)} (kv: K and V 8-bit; v: V 8-bit, K at "
                         f"the model dtype), got {parts!r}")
    if parts == "v" and KV_DTYPE_ALIASES.get(kv_dtype, kv_dtype) not in SCALED_KV_DTYPES:
        raise ValueError(f"{name} 'v' keeps K at the model dtype and stores V 8-bit: it needs an 8-bit kv cache "
                         f"dtype ({', '.join(sorted(SCALED_KV_DTYPES))}), got {kv_dtype!r}")
    return str(parts)


def kv_bytes_per_token(shape: ModelShape, kv_dtype: str, tp: int = 1, k_dtype: str | None = None) -> int:
    """KV bytes one token takes in one block on one rank, K and V of every layer the block holds
    (all of them, or a hybrid model's group size: :func:`kv_layer_slots`; see the module diagram).
    ``k_dtype``: K's kind where it differs from V's (``kv_quant_parts`` "v": K at the model dtype)."""
    if shape.is_mla:
        per_layer = ((shape.kv_lora_rank or 0) + (shape.qk_rope_head_dim or 0)) * kv_dtype_bytes(kv_dtype)
    else:
        part = kv_heads_per_rank(shape, tp) * shape.head_dim
        per_layer = part * (kv_dtype_bytes(k_dtype or kv_dtype) + kv_dtype_bytes(kv_dtype))
    return kv_layer_slots(shape) * per_layer


def scale_bytes_per_block(shape: ModelShape, kv_dtype: str, tp: int = 1, k_dtype: str | None = None) -> int:
    """Per-block scale bytes: the 8-bit kinds keep one fp32 scale per layer, K/V and KV head (MLA:
    per layer); the float kinds none (nor K at a float ``k_dtype``)."""
    if kv_dtype_name(kv_dtype) not in SCALED_KV_DTYPES:
        return 0
    parts = 1 if k_dtype is not None and kv_dtype_name(k_dtype) not in SCALED_KV_DTYPES else 2
    per_layer = 1 if shape.is_mla else parts * kv_heads_per_rank(shape, tp)
    return kv_layer_slots(shape) * per_layer * SCALE_BYTES


def kv_bytes_per_block(shape: ModelShape, block_size: int, kv_dtype: str, tp: int = 1,
                       k_dtype: str | None = None) -> int:
    """Bytes one KV block takes on one rank: ``block_size`` tokens plus the scale bytes (``k_dtype``:
    K's kind where it differs from V's, see :func:`kv_bytes_per_token`)."""
    check_block_size(block_size)
    return (block_size * kv_bytes_per_token(shape, kv_dtype, tp, k_dtype)
            + scale_bytes_per_block(shape, kv_dtype, tp, k_dtype))


def full_block_fraction(sink_blocks: int, max_model_len: int, block_size: int) -> float:
    """The share of a mixed pool's blocks kept at full precision for ``sink_blocks`` sink blocks per
    sequence (``kv_sink_blocks``): twice what sequences of ``max_model_len`` tokens need (shorter
    ones need a larger share, and full-precision requests draw on it too), at most half. Sinks
    beyond it stay 8-bit (``memory/block_pool.py``: the other format is taken when one runs out),
    so a wrong guess costs a little quality or a little room, never a failed allocation."""
    if sink_blocks <= 0:
        return 0.0
    per_seq = max(1, -(-max_model_len // block_size))
    return min(0.5, 2.0 * sink_blocks / per_seq)


def mixed_block_split(budget: int, full_block_bytes: int, quant_block_bytes: int, fraction: float) -> tuple[int, int]:
    """(full-precision blocks, 8-bit blocks) of a mixed pool in ``budget`` bytes: a ``fraction``
    share of the blocks (at least 1) full precision, the rest of the bytes 8-bit (may be 0)."""
    total = int(budget / (fraction * full_block_bytes + (1 - fraction) * quant_block_bytes))
    num_full = max(1, round(total * fraction))
    return num_full, max(0, budget - num_full * full_block_bytes) // quant_block_bytes


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
    model_type = _MODEL_TYPE_ALIASES.get(model_type, model_type)
    defaults = _HF_DEFAULTS.get(model_type, _HF_DEFAULTS["llama"])

    def get(key: str) -> Any:
        value = d.get(key)
        return defaults.get(key) if value is None else value

    hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    if model_type in ("qwen2", "qwen2_moe"):  # q/k/v bias always; a window only with use_sliding_window
        qkv_bias, o_bias = True, False
        window = d.get("sliding_window") if d.get("use_sliding_window") else None
    elif model_type in ("qwen3", "qwen3_moe"):  # attention_bias: q/k/v and o_proj; a window with use_sliding_window
        qkv_bias = o_bias = bool(d.get("attention_bias", False))
        window = d.get("sliding_window") if d.get("use_sliding_window") else None
    elif model_type == "phi3":  # no biases; Phi-3 mini 4k has a 2047-token window
        qkv_bias = o_bias = False
        window = d.get("sliding_window")
    else:  # llama's (and gemma3's) attention_bias covers o_proj too; mistral has none
        qkv_bias = o_bias = model_type != "mistral" and bool(d.get("attention_bias", False))
        window = d.get("sliding_window", defaults.get("sliding_window"))
    layer_types: tuple[str, ...] = ()
    if model_type in _SLIDING_PATTERN:  # per-layer kinds: listed, or every n-th layer global
        n, every = int(d["num_hidden_layers"]), int(d.get("sliding_window_pattern") or _SLIDING_PATTERN[model_type])
        layer_types = tuple(d.get("layer_types") or (
            SLIDING_ATTENTION if (i + 1) % every else FULL_ATTENTION for i in range(n)))
    experts = int(d.get("n_routed_experts") or d.get("num_local_experts") or d.get("num_experts") or 0)
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
        tie_word_embeddings=bool(d.get("tie_word_embeddings", model_type in ("gemma2", "gemma3"))),
        attention_bias=qkv_bias,
        o_proj_bias=o_bias,
        mlp_bias=bool(d.get("mlp_bias", False)),
        sliding_window=int(window) if window else None,
        layer_types=layer_types,
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3"),
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

    def key(suffix: str, default: Any = None) -> Any:
        return get(f"{arch}.{suffix}", default)

    names = {t.name for t in reader.tensors}
    if model_type == "deepseek_v2" and any(n.endswith("exp_probs_b.bias") for n in names):
        model_type = "deepseek_v3"  # V3's routing: a correction bias per expert
    elif model_type == "llama" and int(key("expert_count", 0) or 0):
        model_type = "mixtral"  # llama.cpp writes Mixtral as llama with ffn_*_exps
    defaults = _HF_DEFAULTS.get(model_type, _HF_DEFAULTS["llama"])
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    kv_lora, rope_dim = _opt_int(key("attention.kv_lora_rank")), _opt_int(key("rope.dimension_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    experts = int(key("expert_count", 0) or 0)
    layers = int(key("block_count"))
    windowed = model_type == "phi3" or model_type in _SLIDING_PATTERN
    window = _opt_int(key("attention.sliding_window")) or None if windowed else None
    return ModelShape(
        model_type=model_type,
        vocab_size=int(key("vocab_size") or (len(tokens.data) if tokens is not None else 0)
                       or defaults["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length", defaults["intermediate_size"])),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(key("context_length", defaults["max_position_embeddings"])),
        tie_word_embeddings="output.weight" not in names,
        attention_bias=model_type == "qwen2" or "blk.0.attn_q.bias" in names,
        o_proj_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        sliding_window=window,
        layer_types=_gguf_layer_types(reader, f"{arch}.attention.sliding_window_pattern", model_type, layers, window),
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=rope_dim if kv_lora is not None else None,
        # llama.cpp's files since the MLA split: key_length = the latent's, key_length_mla = q/k's
        qk_nope_head_dim=int(key("attention.key_length_mla", head_dim)) - (rope_dim or 0)
        if kv_lora is not None else None,
        v_head_dim=_opt_int(key("attention.value_length_mla", key("attention.value_length")))
        if kv_lora is not None else None,
        q_lora_rank=_opt_int(key("attention.q_lora_rank")),
        num_experts=experts,
        num_shared_experts=int(key("expert_shared_count", 0) or 0),
        moe_intermediate_size=int(key("expert_feed_forward_length", 0)
                                  or (key("feed_forward_length", 0) if experts else 0) or 0),
        first_k_dense=int(key("leading_dense_block_count", 0) or 0),
        name=str(get("general.name", name)),
        num_params=sum(int(t.n_elements) for t in reader.tensors),
        weight_bytes=sum(int(t.n_bytes) for t in reader.tensors),
    )


def _gguf_layer_types(reader: Any, pattern_key: str, model_type: str, layers: int,
                      window: int | None) -> tuple[str, ...]:
    """Per-layer attention kinds of a GGUF, as llama.cpp reads them (gemma3): every layer full without a
    window; else ``pattern_key``, a period n (every n-th layer full, as in config.json's
    ``sliding_window_pattern``; 0: none) or one flag per layer (true: sliding), the type's period if absent."""
    if model_type not in _SLIDING_PATTERN:
        return ()
    if not window:
        return (FULL_ATTENTION,) * layers
    field_ = reader.fields.get(pattern_key)
    pattern = _SLIDING_PATTERN[model_type] if field_ is None else field_.contents()
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"{pattern_key} has {len(pattern)} entries for {layers} layers")
        return tuple(SLIDING_ATTENTION if flag else FULL_ATTENTION for flag in pattern)
    n = int(pattern)
    return tuple(SLIDING_ATTENTION if n == 0 or (i + 1) % n else FULL_ATTENTION for i in range(layers))


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)
