"""ModelConfig: the one frozen, validated description of a Llama-family model the engine runs.

Its dimensions are a :class:`~pagedkv.model_shape.ModelShape` (the torch-free owner of shapes, of
the config.json and GGUF readers of them and of KV bytes); this module adds what only the model
code needs: RMSNorm epsilon and RoPE, read from both the older ``rope_theta`` + ``rope_scaling``
layout and the newer ``rope_parameters`` layout. Built once; nothing mutates it later.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from pagedkv.model_shape import ModelShape, hf_text_config, shape_from_hf_dict
from pagedkv.models.errors import UnsupportedModelError

# config.json "architectures" / "model_type" values that map onto the one Llama implementation.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its language model; the vision tower is skipped
    "Gemma2ForCausalLM": "gemma2",
    # mixture-of-experts layers (models/moe.py)
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    # multi-head latent attention (models/mla.py) with mixture-of-experts layers
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
# Architectures refused by name: what they need that pagedkv lacks, and what to do instead.
REFUSED_ARCHITECTURES: dict[str, str] = {
    "DeepseekV32ForCausalLM": "DeepSeek-V3.2's sparse attention (the lightning indexer picking "
                              "index_topk tokens per query) is not implemented",
}
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
_MODEL_TYPE_ALIASES = {"gemma3_text": "gemma3"}
SUPPORTED_MODEL_TYPES = frozenset(SUPPORTED_ARCHITECTURES.values())
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters. ``freq_factors`` (GGUF ``rope_freqs``) divides the base frequencies."""

    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    freq_factors: tuple[float, ...] | None = None
    # longrope (Phi-3): per-pair divisors of the frequencies up to / beyond the original context,
    # and the factor cos and sin are scaled by (None: sqrt(1 + ln(factor) / ln(original)))
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    attention_factor: float | None = None
    partial_rotary_factor: float = 1.0  # the fraction of each head's dims that RoPE rotates
    # yarn (DeepSeek): the ramp between interpolated and original frequencies, and the mscale
    # terms of cos/sin (attention_factor None: mscale / mscale_all_dim) and of the attention scale
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {self.rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
            )
        if self.theta <= 0:
            raise ValueError(f"rope theta must be > 0, got {self.theta}")
        if self.factor <= 0:
            raise ValueError(f"rope factor must be > 0, got {self.factor}")
        if self.rope_type == "longrope" and (self.short_factor is None or self.long_factor is None
                                             or not self.original_max_position_embeddings):
            raise ValueError("longrope needs short_factor, long_factor and original_max_position_embeddings")
        if self.rope_type == "yarn" and not self.original_max_position_embeddings:
            raise ValueError("yarn RoPE needs original_max_position_embeddings")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")


MOE_SCORINGS = ("softmax", "sigmoid")
MOE_GROUP_SCORES = ("max", "top2_sum")


@dataclass(frozen=True, slots=True, kw_only=True)
class MoEConfig:
    """How a mixture-of-experts layer routes (``models/moe.py``), read from config.json.

    ``scoring``: softmax (Mixtral, Qwen, DeepSeek-V2) or sigmoid (DeepSeek-V3) of the router logits.
    Group-limited choice (``n_group`` > 1): only experts of the ``topk_group`` best groups are
    candidates, a group ranked by its best score (``group_score`` "max", DeepSeek-V2) or the sum of
    its two best bias-corrected scores ("top2_sum", DeepSeek-V3). ``correction_bias``: V3's
    ``e_score_correction_bias`` added to the scores for the choice only. ``shared_gate``: Qwen2-MoE
    scales its shared expert by a sigmoid gate. ``sparse_layers``: the layers that are MoE (the
    others are dense ``LlamaMLP`` layers of ``intermediate_size``)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    sparse_layers: frozenset[int]
    scoring: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "max"
    correction_bias: bool = False
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    router_float32: bool = False  # DeepSeek: router logits from float32 inputs and weight (Qwen, Mixtral: model dtype)

    def __post_init__(self) -> None:
        if self.num_experts < 1 or self.intermediate_size < 1:
            raise ValueError(f"a MoE layer needs num_experts >= 1 and moe_intermediate_size >= 1, got "
                             f"{self.num_experts} and {self.intermediate_size}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {self.num_experts}] (the experts), "
                             f"got {self.top_k}")
        if self.scoring not in MOE_SCORINGS:
            raise UnsupportedModelError(f"MoE scoring_func {self.scoring!r} is not supported "
                                        f"(supported: {', '.join(MOE_SCORINGS)})")
        if self.group_score not in MOE_GROUP_SCORES:
            raise ValueError(f"group_score must be one of {', '.join(MOE_GROUP_SCORES)}, got {self.group_score!r}")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must be >= 1 and divide n_routed_experts "
                             f"({self.num_experts})")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
        if self.n_group > 1 and self.topk_group < self.n_group \
                and self.topk_group * (self.num_experts // self.n_group) < self.top_k:
            raise ValueError(f"topk_group={self.topk_group} groups of {self.num_experts // self.n_group} "
                             f"experts hold fewer than num_experts_per_tok={self.top_k}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig(ModelShape):
    """A Llama-family decoder (llama, mistral, qwen2, SmolLM) this engine can run: its shape
    (:class:`~pagedkv.model_shape.ModelShape`, which owns the dimensions and the config.json/GGUF
    reading of them) plus what the model code alone needs, RMSNorm epsilon and RoPE."""

    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    # Gemma 2/3: the sliding layers' own RoPE (None: ``rope`` for every layer), the MLP
    # activation, the attention scale 1/sqrt(query_pre_attn_scalar) (None: 1/sqrt(head_dim)), and
    # tanh caps ``cap * tanh(x / cap)`` on the final logits and (Gemma 2) the attention scores.
    rope_local: RopeConfig | None = None
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    moe: MoEConfig | None = None  # mixture-of-experts routing (None: every layer dense)
    # MLA (DeepSeek): RoPE on interleaved pairs of dims (V2 always; V3's rope_interleave)
    rope_interleave: bool = False

    def __post_init__(self) -> None:
        ModelShape.__post_init__(self)  # (slotted dataclasses break zero-argument super())
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
            )
        if self.is_mla and (self.num_key_value_heads != 1 or self.head_dim != self.latent_dim):
            raise ValueError(f"an MLA model's cache head is its latent: num_key_value_heads 1 and head_dim "
                             f"kv_lora_rank + qk_rope_head_dim = {self.latent_dim}, got {self.num_key_value_heads} "
                             f"and {self.head_dim} (ModelConfig.from_hf_dict sets them)")
        if self.is_mla and not (self.qk_nope_head_dim and self.v_head_dim):
            raise ValueError("an MLA model needs qk_nope_head_dim and v_head_dim")
        if self.num_experts and self.moe is None:
            raise UnsupportedModelError(f"{self.model_type} has {self.num_experts} experts but no MoE routing "
                                        "this engine knows (supported: "
                                        "mixtral, qwen2_moe, qwen3_moe, deepseek_v2, deepseek_v3)")
        if self.moe is not None and max(self.moe.sparse_layers, default=-1) >= self.num_hidden_layers:
            raise ValueError(f"MoE sparse_layers name layer {max(self.moe.sparse_layers)} of "
                             f"{self.num_hidden_layers}")
        if self.model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and self.sliding_window is not None:
            raise UnsupportedModelError(f"{self.model_type} with use_sliding_window=true (per-layer windows) "
                                        "is not supported")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise UnsupportedModelError(f"hidden activation {self.hidden_act!r} is not supported "
                                        f"(supported: {', '.join(HIDDEN_ACTS)})")
        if self.rotary_dim % 2:
            raise ValueError(f"the rotated dims of a head must be even for RoPE, got {self.rotary_dim}")

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (the first ones; ``head_dim`` unless partial; MLA:
        the decoupled RoPE part, ``qk_rope_head_dim``)."""
        if self.is_mla:
            return int(self.qk_rope_head_dim or 0)
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def latent_dim(self) -> int:
        """MLA: what the cache holds per token and layer, the normalized latent and the RoPE key
        (``kv_lora_rank + qk_rope_head_dim``); 0 for other models."""
        return (self.kv_lora_rank or 0) + (self.qk_rope_head_dim or 0) if self.is_mla else 0

    @property
    def is_gemma(self) -> bool:
        """Gemma's layout: embeddings scaled by sqrt(hidden), RMSNorm weights applied as
        ``1 + w`` (the loader adds the 1), norms before and after each sublayer ("sandwich")."""
        return self.model_type in ("gemma2", "gemma3")

    @property
    def attention_scale(self) -> float:
        """The factor q.k is multiplied by before softmax (MLA: over the q/k head of
        ``qk_nope_head_dim + qk_rope_head_dim``, times YaRN's ``mscale(factor, mscale_all_dim)**2``)."""
        if self.is_mla:
            scale = ((self.qk_nope_head_dim or 0) + (self.qk_rope_head_dim or 0)) ** -0.5
            if self.rope.rope_type == "yarn" and self.rope.mscale_all_dim and self.rope.factor > 1:
                scale *= (0.1 * self.rope.mscale_all_dim * math.log(self.rope.factor) + 1.0) ** 2
            return scale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts (``models/moe.py``)."""
        return self.moe is not None and layer in self.moe.sparse_layers

    def layer_rope(self, layer: int) -> RopeConfig:
        """The RoPE of ``layer``: sliding-window layers may have their own (``rope_local``)."""
        if self.rope_local is not None and self.layer_window(layer) is not None:
            return self.rope_local
        return self.rope

    @classmethod
    def from_shape(cls, shape: ModelShape, **model_fields: Any) -> ModelConfig:
        """``shape`` with the model code's own parameters added (``rms_norm_eps``, ``rope``, ...;
        validated as a runnable model). An MLA shape's cache head becomes its latent (one KV head
        of ``kv_lora_rank + qk_rope_head_dim``: what ``models/mla.py`` attends over)."""
        if shape.is_mla:
            shape = replace(shape, num_key_value_heads=1,
                            head_dim=(shape.kv_lora_rank or 0) + (shape.qk_rope_head_dim or 0))
        return cls(**{f.name: getattr(shape, f.name) for f in fields(ModelShape)}, **model_fields)

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict (``rope_parameters`` layout) that :meth:`from_hf_dict` reads back."""
        # the text model's class (gemma3: Gemma3ForCausalLM, whose config.json says "gemma3_text")
        arch = next(k for k, v in SUPPORTED_ARCHITECTURES.items() if v == self.model_type)
        model_type = {v: k for k, v in _MODEL_TYPE_ALIASES.items()}.get(self.model_type, self.model_type)
        rope = asdict(self.rope)
        rope_parameters: dict[str, Any] = {"rope_type": rope.pop("rope_type"), "rope_theta": rope.pop("theta")}
        partial = rope.pop("partial_rotary_factor")
        if partial != 1.0:
            rope_parameters["partial_rotary_factor"] = partial
        if rope_parameters["rope_type"] != "default":
            rope_parameters.update({k: list(v) if isinstance(v, tuple) else v for k, v in rope.items()
                                    if k != "freq_factors" and v is not None})
        out: dict[str, Any] = {
            "architectures": [arch], "model_type": model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": rope_parameters, "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias and self.model_type in ("llama", "qwen3"),
            "mlp_bias": self.mlp_bias, "sliding_window": self.sliding_window,
        }
        if self.rope.freq_factors is not None:
            out["pagedkv_rope_freq_factors"] = list(self.rope.freq_factors)
        if self.layer_types:
            out["layer_types"] = list(self.layer_types)
        if self.is_gemma:
            scalar = self.query_pre_attn_scalar  # an int in transformers' configs
            out.update(hidden_activation=self.hidden_act,
                       query_pre_attn_scalar=int(scalar) if scalar is not None and scalar.is_integer() else scalar,
                       final_logit_softcapping=self.final_logit_softcapping, attention_bias=self.attention_bias,
                       attn_logit_softcapping=self.attn_logit_softcapping)
        if self.is_mla:
            out.update(kv_lora_rank=self.kv_lora_rank, q_lora_rank=self.q_lora_rank,
                       qk_rope_head_dim=self.qk_rope_head_dim, qk_nope_head_dim=self.qk_nope_head_dim,
                       v_head_dim=self.v_head_dim, rope_interleave=self.rope_interleave)
        if self.moe is not None:  # read back as is by moe_from_hf
            out["pagedkv_moe"] = {**asdict(self.moe), "sparse_layers": sorted(self.moe.sparse_layers)}
            out.update(num_local_experts=self.num_experts, moe_intermediate_size=self.moe_intermediate_size,
                       n_shared_experts=self.num_shared_experts, first_k_dense_replace=self.first_k_dense)
        if self.model_type == "gemma3":  # the sliding layers' own RoPE
            local = self.rope_local or self.rope
            out["rope_parameters"] = {"full_attention": rope_parameters,
                                      "sliding_attention": {"rope_type": "default", "rope_theta": local.theta}}
        return out

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face ``config.json`` dict: the shape through
        :func:`~pagedkv.model_shape.shape_from_hf_dict`, then RMSNorm epsilon and RoPE. Raises
        UnsupportedModelError for other architectures, ValueError for a missing shape key."""
        model_type = _model_type(d)
        quant = d.get("quantization_config")
        if isinstance(quant, dict) and quant:
            method = quant.get("quant_method") or quant.get("fmt") or "?"
            block = f", weight_block_size {quant['weight_block_size']}" if quant.get("weight_block_size") else ""
            raise UnsupportedModelError(
                f"config.json quantization_config (quant_method {method!r}{block}): pre-quantized checkpoints "
                "are not supported; give the model in bfloat16/float32 (for DeepSeek-V3/R1's FP8 weights, "
                "dequantized first, e.g. with DeepSeek's fp8_cast_bf16.py) or as a GGUF file")
        d = hf_text_config(d)
        shape = shape_from_hf_dict({**d, "model_type": model_type})
        extra: dict[str, Any] = {}
        if model_type in ("gemma2", "gemma3"):
            # gemma2 caps by default (transformers' Gemma2Config: 30 on the logits, 50 on the scores)
            caps = {"final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0} if model_type == "gemma2" else {}
            if d.get("use_bidirectional_attention"):
                raise UnsupportedModelError("gemma3 with use_bidirectional_attention is an encoder; not supported")
            extra = dict(rope_local=_local_rope_from_hf(d) if model_type == "gemma3" else None,
                         query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
                         hidden_act=str(d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"))
            for key in ("final_logit_softcapping", "attn_logit_softcapping"):
                cap = d.get(key, caps.get(key))
                extra[key] = float(cap) if cap is not None else None
        if shape.is_mla:
            extra["rope_interleave"] = bool(d.get("rope_interleave", True))
        if shape.num_experts:
            extra["moe"] = moe_from_hf(d, shape)
        return cls.from_shape(shape, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope=_rope_from_hf(d), **extra)


def moe_from_hf(d: dict[str, Any], shape: ModelShape) -> MoEConfig | None:
    """The routing of a MoE config.json, by family (transformers' defaults for absent keys); None
    for a family without MoE support here (``ModelConfig`` then refuses the experts by name).
    ``pagedkv_moe`` (what :meth:`ModelConfig.to_hf_dict` writes) is read as is."""
    saved = d.get("pagedkv_moe")
    if isinstance(saved, dict):
        return MoEConfig(**{**saved, "sparse_layers": frozenset(int(i) for i in saved["sparse_layers"])})
    layers, mt = shape.num_hidden_layers, shape.model_type
    top_k = int(d.get("num_experts_per_tok") or 2)
    if mt == "mixtral":  # every layer sparse, always renormalized, experts of intermediate_size
        return MoEConfig(num_experts=shape.num_experts, top_k=top_k, intermediate_size=shape.moe_intermediate_size,
                         sparse_layers=frozenset(range(layers)), norm_topk_prob=True)
    if mt in ("qwen2_moe", "qwen3_moe"):
        step = int(d.get("decoder_sparse_step") or 1)
        dense = {int(i) for i in d.get("mlp_only_layers") or ()}
        shared = int(d.get("shared_expert_intermediate_size") or 0) if mt == "qwen2_moe" else 0
        return MoEConfig(num_experts=shape.num_experts, top_k=top_k, intermediate_size=shape.moe_intermediate_size,
                         sparse_layers=frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
                         norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                         shared_intermediate_size=shared, shared_gate=shared > 0)
    if mt in ("deepseek_v2", "deepseek_v3"):
        # the original modeling code's rule: sparse from first_k_dense_replace on, every moe_layer_freq-th
        freq = int(d.get("moe_layer_freq") or 1)
        v3 = mt == "deepseek_v3"
        method = str(d.get("topk_method") or ("noaux_tc" if v3 else "greedy"))
        if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise UnsupportedModelError(f"topk_method {method!r} is not supported "
                                        "(supported: greedy, group_limited_greedy, noaux_tc)")
        grouped = method != "greedy"
        return MoEConfig(num_experts=shape.num_experts, top_k=top_k, intermediate_size=shape.moe_intermediate_size,
                         sparse_layers=frozenset(i for i in range(shape.first_k_dense, layers) if i % freq == 0),
                         scoring=str(d.get("scoring_func") or ("sigmoid" if v3 else "softmax")),
                         norm_topk_prob=bool(d.get("norm_topk_prob", v3)),
                         routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
                         n_group=int(d.get("n_group") or (8 if v3 else 1)) if grouped else 1,
                         topk_group=int(d.get("topk_group") or (4 if v3 else 1)) if grouped else 1,
                         group_score="top2_sum" if method == "noaux_tc" else "max",
                         correction_bias=method == "noaux_tc",
                         shared_intermediate_size=shape.num_shared_experts * shape.moe_intermediate_size,
                         router_float32=True)
    return None


def _model_type(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    for arch in archs:
        if arch in REFUSED_ARCHITECTURES:
            raise UnsupportedModelError(f"architecture {arch!r} is not supported: {REFUSED_ARCHITECTURES[arch]}")
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    model_type = d.get("model_type")
    if model_type == "deepseek_v32" or d.get("index_topk") is not None:
        raise UnsupportedModelError(f"architecture {archs[0] if archs else model_type!r} is not supported: "
                                    f"{REFUSED_ARCHITECTURES['DeepseekV32ForCausalLM']}")
    if isinstance(model_type, str):
        model_type = _MODEL_TYPE_ALIASES.get(model_type, model_type)
    if model_type in SUPPORTED_MODEL_TYPES and not archs:
        return str(model_type)
    name = archs[0] if archs else model_type
    raise UnsupportedModelError(
        f"architecture {name!r} is not supported; pagedkv runs "
        f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
    )


def _local_rope_from_hf(d: dict[str, Any]) -> RopeConfig:
    """Gemma 3's sliding layers' RoPE: ``rope_parameters["sliding_attention"]`` (new layout) or
    ``rope_local_base_freq`` (old), unscaled."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        return _rope_from_hf({"rope_parameters": params["sliding_attention"]})
    return RopeConfig(theta=float(d.get("rope_local_base_freq", 10000.0)))


def _rope_from_hf(d: dict[str, Any]) -> RopeConfig:
    """Both layouts: ``rope_parameters`` (new) or ``rope_theta`` + ``rope_scaling`` (old)."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type layout
        params = params["full_attention"]
    if d.get("model_type") in ("gemma3", "gemma3_text") and "rope_theta" not in (params or {}) \
            and "rope_theta" not in d:
        d = {**d, "rope_theta": 1_000_000.0}  # gemma3's global default
    scaling = dict(params) if isinstance(params, dict) else dict(d.get("rope_scaling") or {})
    theta = float(scaling.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "su":  # Phi-3's older name
        rope_type = "longrope"
    freq = d.get("pagedkv_rope_freq_factors")
    orig = scaling.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
    partial = scaling.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    factor = scaling.get("factor")
    if rope_type == "yarn" and not orig:  # transformers' default for yarn
        orig = d.get("max_position_embeddings")
    if rope_type == "longrope" and factor is None and orig:
        factor = float(d.get("max_position_embeddings") or orig) / float(orig)

    def floats(key: str) -> tuple[float, ...] | None:
        values = scaling.get(key)
        return tuple(float(x) for x in values) if values else None

    attention_factor = scaling.get("attention_factor")
    return RopeConfig(
        theta=theta,
        rope_type=str(rope_type),
        factor=float(factor if factor is not None else 1.0) if rope_type != "default" else 1.0,
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig else None,
        freq_factors=tuple(float(x) for x in freq) if freq else None,
        short_factor=floats("short_factor"),
        long_factor=floats("long_factor"),
        attention_factor=float(attention_factor) if attention_factor is not None else None,
        partial_rotary_factor=float(partial) if partial is not None else 1.0,
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        mscale=float(scaling["mscale"]) if scaling.get("mscale") else None,
        mscale_all_dim=float(scaling["mscale_all_dim"]) if scaling.get("mscale_all_dim") else None,
        truncate=bool(scaling.get("truncate", True)),
    )
