"""Multi-head latent attention (DeepSeek-V2, V2-Lite, V3): the KV cache holds one latent per token.

Per token, the layer computes a normalized latent ``c`` (``kv_lora_rank`` values) and a RoPE key
``k_pe`` (``qk_rope_head_dim``, shared by all heads). The checkpoint's ``kv_b_proj`` expands ``c``
into every head's no-RoPE key (``W_UK``, ``qk_nope_head_dim``) and value (``W_UV``, ``v_head_dim``).
Here it never is (the absorbed form, for prefill and decode alike)::

    q_nope . (W_UK c)  =  (W_UK^T q_nope) . c          (the K up-projection folded into the query)
    sum_j p_j W_UV c_j =  W_UV (sum_j p_j c_j)         (the V up-projection applied after attention)

so attention runs as multi-query attention with ONE "KV head" of ``kv_lora_rank + qk_rope_head_dim``
dims, ``[c, k_pe]``: the query is ``[W_UK^T q_nope, q_pe]`` per head, and the value is the same
latent row (the cache stores it once; ``ModelConfig.latent_dim``). The attention's output over the
first ``kv_lora_rank`` dims is ``sum_j p_j c_j``; its RoPE dims are dropped. The scale is the
original one (``ModelConfig.attention_scale``: 1/sqrt(qk_nope + qk_rope), YaRN's mscale squared).

RoPE: DeepSeek rotates interleaved pairs ``(x0, x1), (x2, x3) ...``; q_pe and k_pe are de-interleaved
(evens then odds) before the rotate-half RoPE of ``models/rope.py``: a dot product of two vectors
permuted alike is unchanged, and the permuted k_pe is what the cache stores.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedkv.distributed.group import TPGroup
from pagedkv.models.config import ModelConfig
from pagedkv.models.rope import apply_rope

# The latent norms' epsilon: DeepSeek's modeling code (and transformers') builds q_a_layernorm and
# kv_a_layernorm with the RMSNorm default, not rms_norm_eps (equal in the released configs; a tiny
# model with rms_norm_eps 1e-5 differs by ~1e-4 in its logits otherwise).
LATENT_NORM_EPS = 1e-6


class _Norm(nn.Module):
    """RMSNorm (the latent's and the query's; ``models/llama.RMSNorm`` lives above this module)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)


class MLAAttention(nn.Module):
    """DeepSeek's attention, absorbed: the ``AttentionFn`` sees q ``[T, H, latent]`` and one KV
    head ``[T, 1, latent]`` (K and V the same rows) and returns ``[T, H, latent]``."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        # a rank's shard (models/sharding.py): its query heads (config is rank-local), the latent
        # projections replicated, o_proj's output summed over the ranks
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.layer_idx = layer_idx
        h, heads = config.hidden_size, config.num_attention_heads
        self.num_heads = heads
        self.rank = int(config.kv_lora_rank or 0)
        self.nope = int(config.qk_nope_head_dim or 0)
        self.rope = int(config.qk_rope_head_dim or 0)
        self.v_dim = int(config.v_head_dim or 0)
        self.interleaved = config.rope_interleave
        qk = self.nope + self.rope
        bias = config.attention_bias
        if config.q_lora_rank:
            self.q_a_proj: nn.Linear | None = nn.Linear(h, config.q_lora_rank, bias=bias)
            self.q_a_layernorm: _Norm | None = _Norm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj: nn.Linear | None = nn.Linear(config.q_lora_rank, heads * qk, bias=False)
            self.q_proj: nn.Linear | None = None
        else:
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
            self.q_proj = nn.Linear(h, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = _Norm(self.rank, LATENT_NORM_EPS)
        # kv_b_proj's weight [H * (nope + v), rank], a Parameter (its two halves are used apart)
        self.kv_b = nn.Parameter(torch.empty(heads * (self.nope + self.v_dim), self.rank))
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=bias)

    def _rope_part(self, x: torch.Tensor) -> torch.Tensor:
        """The RoPE dims in rotate-half order (interleaved pairs: evens, then odds)."""
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if self.interleaved else x

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        t, heads = x.shape[0], self.num_heads
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, heads, self.nope + self.rope)
        kv = self.kv_a_proj_with_mqa(x)  # [T, rank + rope]
        latent = self.kv_a_layernorm(kv[:, :self.rank])
        # RoPE on the query's and the key's RoPE dims together: [T, H + 1, rope]
        pe = torch.cat((self._rope_part(q[..., self.nope:]), self._rope_part(kv[:, None, self.rank:])), dim=1)
        pe = apply_rope(pe, cos, sin)
        w = self.kv_b.view(heads, self.nope + self.v_dim, self.rank)
        # absorbed query: W_UK^T q_nope per head -> [T, H, rank]
        q_latent = torch.bmm(q[..., :self.nope].transpose(0, 1), w[:, :self.nope]).transpose(0, 1)
        query = torch.cat((q_latent, pe[:, :heads]), dim=-1)  # [T, H, rank + rope]
        key = torch.cat((latent, pe[:, heads]), dim=-1).unsqueeze(1)  # [T, 1, rank + rope]
        out = attention(self.layer_idx, query, key, key)  # [T, H, rank + rope]
        # W_UV after attention: [H, T, rank] x [H, rank, v] -> [T, H, v]
        values = torch.bmm(out[..., :self.rank].transpose(0, 1), w[:, self.nope:].transpose(1, 2)).transpose(0, 1)
        out = self.o_proj(values.reshape(t, heads * self.v_dim))
        return out if self.tp is None else self.tp.all_reduce(out)
