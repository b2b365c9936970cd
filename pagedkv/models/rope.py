"""Rotary position embedding: inverse frequencies (default, linear, llama3, longrope, yarn scaling)
and cos/sin tables.

Tables are computed once (float32, grown lazily by powers of two) and gathered once per step for all
layers; ``apply_rope`` uses the Hugging Face "rotate half" layout (GGUF q/k rows are un-permuted to it)
over the first ``rotary_dim`` dims of each head (all of them unless ``partial_rotary_factor`` < 1).

LongRoPE (Phi-3) has two sets of frequency divisors: ``short_factor`` for contexts up to the
original training length and ``long_factor`` beyond it, and scales cos/sin by an attention factor.
transformers picks the set per forward call (by the longest position in it), which would give K
rows already cached a different rotation than later ones; pagedkv, like llama.cpp, picks it once
per engine by the context it serves (``max_model_len``): long factors if that exceeds the original
length (a model used outside an engine keeps the short ones). Within the original length, with
``max_model_len`` at most that length, the results equal transformers'; a prompt beyond it computed
in one step equals transformers' too (both use the long factors for every position).
"""

from __future__ import annotations

import math

import torch

from pagedkv.models.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int, max_position_embeddings: int,
                    long_context: bool = False) -> torch.Tensor:
    """Per-pair inverse frequencies, ``[rotary_dim // 2]`` float32, after the configured scaling
    (``head_dim`` here is the rotated dims; ``long_context`` picks longrope's long factors)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)  # [head_dim // 2]
    if rope.rope_type == "longrope":
        factors = rope.long_factor if long_context else rope.short_factor
        ext = torch.tensor(factors, dtype=torch.float32, device="cpu")
        if ext.numel() != inv_freq.numel():
            raise ValueError(f"longrope factors have {ext.numel()} entries, expected {inv_freq.numel()}")
        inv_freq = 1.0 / (ext * rope.theta ** exponents)
    elif rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope, max_position_embeddings)
    elif rope.rope_type == "yarn":
        inv_freq = _yarn_scale(inv_freq, rope, head_dim)
    if rope.freq_factors is not None:
        freq_factors = torch.tensor(rope.freq_factors, dtype=torch.float32, device="cpu")
        if freq_factors.numel() != inv_freq.numel():
            raise ValueError(f"rope freq_factors has {freq_factors.numel()} entries, expected {inv_freq.numel()}")
        inv_freq = inv_freq / freq_factors
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig, max_pos: int) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    old_len = rope.original_max_position_embeddings or max_pos
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn_scale(inv_freq: torch.Tensor, rope: RopeConfig, dim: int) -> torch.Tensor:
    # YaRN (DeepSeek-V2/V3): frequencies below the ramp [low, high] are interpolated by `factor`,
    # those above kept, the ramp blended (transformers' _compute_yarn_parameters, same rounding).
    orig = rope.original_max_position_embeddings or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original (extrapolated) frequency
    return inv_freq / rope.factor * (1 - keep) + inv_freq * keep


def yarn_attention_factor(rope: RopeConfig) -> float:
    """YaRN's scale of cos and sin: ``attention_factor``, else mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) (DeepSeek: 1.0 with equal mscales), else mscale(factor)."""
    if rope.attention_factor is not None:
        return rope.attention_factor

    def mscale(m: float) -> float:
        return 1.0 if rope.factor <= 1 else 0.1 * m * math.log(rope.factor) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return mscale(rope.mscale) / mscale(rope.mscale_all_dim)
    return mscale(1.0)


class RotaryEmbedding:
    """Holds cos/sin tables ``[max_len, head_dim]`` and gathers them for a step's positions.

    A plain object, not a module: the tables are derived data, never part of a state dict.
    """

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> None:
        self.rope = rope
        self.max_position_embeddings = max_position_embeddings
        self.rotary_dim = int(head_dim * rope.partial_rotary_factor)
        self.scale = 1.0
        # longrope: short factors until told the context is longer (the engine says, by max_model_len)
        self.set_context_length(rope.original_max_position_embeddings or max_position_embeddings)

    def set_context_length(self, context: int) -> None:
        """The longest context served; longrope picks its factors by it (see the module docstring)."""
        rope = self.rope
        long_context = rope.rope_type == "longrope" and context > (rope.original_max_position_embeddings or context)
        self.inv_freq = inv_frequencies(rope, self.rotary_dim, self.max_position_embeddings, long_context)
        if rope.rope_type == "yarn":
            self.scale = yarn_attention_factor(rope)
        if rope.rope_type == "longrope":
            factor = rope.factor
            orig = rope.original_max_position_embeddings or self.max_position_embeddings
            self.scale = (rope.attention_factor if rope.attention_factor is not None
                          else 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig)))
        self._cos = torch.empty(0, self.rotary_dim, device="cpu")
        self._sin = torch.empty(0, self.rotary_dim, device="cpu")
        self._grow(min(4096, self.max_position_embeddings))

    def _grow(self, length: int) -> None:
        positions = torch.arange(length, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, self.inv_freq.float())  # [length, rotary_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [length, rotary_dim]
        self._cos, self._sin = emb.cos() * self.scale, emb.sin() * self.scale

    def cos_sin(self, positions: torch.Tensor, max_position: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, head_dim]`` for ``positions`` ``[T]`` (``max_position`` = their max)."""
        if max_position >= self._cos.shape[0]:
            if max_position >= self.max_position_embeddings:
                raise ValueError(
                    f"position {max_position} exceeds max_position_embeddings "
                    f"({self.max_position_embeddings})"
                )
            self._grow(min(self.max_position_embeddings, 1 << max_position.bit_length()))
        cos = self._cos.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self._sin.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for ``x`` ``[T, heads, head_dim]``, over the first
    ``cos.shape[-1]`` dims of each head (partial rotary: the rest pass through).

    Written as one multiply and two in-place ``addcmul_`` on the halves: no ``cat``/negation
    temporaries (10x faster than the textbook form for a 2k-token prefill).
    """
    rd = cos.shape[-1]
    if rd != x.shape[-1]:
        out = x.clone()
        out[..., :rd] = apply_rope(x[..., :rd], cos, sin)
        return out
    half = rd // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1.0)  # -x2 * sin
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])  # +x1 * sin
    return out
