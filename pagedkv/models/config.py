"""ModelConfig: the one frozen, validated description of a Llama-family model the engine runs.

Its dimensions are a :class:`~pagedkv.model_shape.ModelShape` (the torch-free owner of shapes, of
the config.json and GGUF readers of them and of KV bytes); this module adds what only the model
code needs: RMSNorm epsilon and RoPE, read from both the older ``rope_theta`` + ``rope_scaling``
layout and the newer ``rope_parameters`` layout. Built once; nothing mutates it later.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
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
}
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
_MODEL_TYPE_ALIASES = {"gemma3_text": "gemma3"}
SUPPORTED_MODEL_TYPES = frozenset(SUPPORTED_ARCHITECTURES.values())
ROPE_TYPES = ("default", "linear", "llama3", "longrope")


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
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")


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

    def __post_init__(self) -> None:
        ModelShape.__post_init__(self)  # (slotted dataclasses break zero-argument super())
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
            )
        if self.is_mla or self.num_experts:
            raise UnsupportedModelError("MLA attention and mixture-of-experts layers are not supported")
        if self.model_type in ("qwen2", "qwen3") and self.sliding_window is not None:
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
        """Dims of each head that RoPE rotates (the first ones; ``head_dim`` unless partial)."""
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def is_gemma(self) -> bool:
        """Gemma's layout: embeddings scaled by sqrt(hidden), RMSNorm weights applied as
        ``1 + w`` (the loader adds the 1), norms before and after each sublayer ("sandwich")."""
        return self.model_type in ("gemma2", "gemma3")

    @property
    def attention_scale(self) -> float:
        """The factor q.k is multiplied by before softmax."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_rope(self, layer: int) -> RopeConfig:
        """The RoPE of ``layer``: sliding-window layers may have their own (``rope_local``)."""
        if self.rope_local is not None and self.layer_window(layer) is not None:
            return self.rope_local
        return self.rope

    @classmethod
    def from_shape(cls, shape: ModelShape, **model_fields: Any) -> ModelConfig:
        """``shape`` with the model code's own parameters added (``rms_norm_eps``, ``rope``, ...;
        validated as a runnable model)."""
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
        return cls.from_shape(shape, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope=_rope_from_hf(d), **extra)


def _model_type(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    model_type = d.get("model_type")
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
    )
