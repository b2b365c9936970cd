"""ModelConfig: the one frozen, validated description of a Llama-family model.

Built once from a Hugging Face ``config.json`` dict (both the older ``rope_theta`` + ``rope_scaling``
layout and the newer ``rope_parameters`` layout) or from GGUF metadata; nothing mutates it later.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pagedkv.models.errors import UnsupportedModelError

# config.json "architectures" / "model_type" values that map onto the one Llama implementation.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_MODEL_TYPES = frozenset(SUPPORTED_ARCHITECTURES.values())
ROPE_TYPES = ("default", "linear", "llama3")


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

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type {self.rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
            )
        if self.theta <= 0:
            raise ValueError(f"rope theta must be > 0, got {self.theta}")
        if self.factor <= 0:
            raise ValueError(f"rope factor must be > 0, got {self.factor}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape and hyper-parameters of a Llama-family decoder (llama, mistral, qwen2, SmolLM)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (qwen2 always; llama when attention_bias)
    o_proj_bias: bool = False  # llama's attention_bias also puts a bias on o_proj
    mlp_bias: bool = False
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported "
                f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict (``rope_parameters`` layout) that :meth:`from_hf_dict` reads back."""
        arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.model_type]
        rope = asdict(self.rope)
        rope_parameters: dict[str, Any] = {"rope_type": rope.pop("rope_type"), "rope_theta": rope.pop("theta")}
        if rope_parameters["rope_type"] != "default":
            rope_parameters.update({k: v for k, v in rope.items() if k != "freq_factors" and v is not None})
        out: dict[str, Any] = {
            "architectures": [arch], "model_type": self.model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": rope_parameters, "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias and self.model_type == "llama",
            "mlp_bias": self.mlp_bias, "sliding_window": self.sliding_window,
        }
        if self.rope.freq_factors is not None:
            out["pagedkv_rope_freq_factors"] = list(self.rope.freq_factors)
        return out

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face ``config.json`` dict; raises UnsupportedModelError for other architectures."""
        model_type = _model_type(d)
        text = d.get("text_config")
        if isinstance(text, dict) and "hidden_size" not in d:
            d = {**d, **text}
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            layers = int(d["num_hidden_layers"])
            inter = int(d["intermediate_size"])
            vocab = int(d["vocab_size"])
        except KeyError as e:
            raise ValueError(f"config.json lacks required key {e.args[0]!r}") from None
        head_dim = d.get("head_dim") or hidden // heads
        is_qwen2 = model_type == "qwen2"
        llama_bias = bool(d.get("attention_bias", False)) and model_type == "llama"
        if is_qwen2 and d.get("use_sliding_window"):
            raise UnsupportedModelError("qwen2 with use_sliding_window=true (per-layer windows) is not supported")
        sliding = None if is_qwen2 else d.get("sliding_window")
        return cls(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            rope=_rope_from_hf(d),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or llama_bias,
            o_proj_bias=llama_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            sliding_window=int(sliding) if sliding else None,
        )


def _model_type(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    model_type = d.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES and not archs:
        return str(model_type)
    name = archs[0] if archs else model_type
    raise UnsupportedModelError(
        f"architecture {name!r} is not supported; pagedkv runs "
        f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
    )


def _rope_from_hf(d: dict[str, Any]) -> RopeConfig:
    """Both layouts: ``rope_parameters`` (new) or ``rope_theta`` + ``rope_scaling`` (old)."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type layout
        params = params["full_attention"]
    scaling = dict(params) if isinstance(params, dict) else dict(d.get("rope_scaling") or {})
    theta = float(scaling.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    freq = d.get("pagedkv_rope_freq_factors")
    orig = scaling.get("original_max_position_embeddings")
    return RopeConfig(
        theta=theta,
        rope_type=str(rope_type),
        factor=float(scaling.get("factor", 1.0)) if rope_type != "default" else 1.0,
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig else None,
        freq_factors=tuple(float(x) for x in freq) if freq else None,
    )
