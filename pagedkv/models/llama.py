"""The Llama-family decoder (llama, mistral, qwen2, qwen3, phi3, gemma3, SmolLM) on flattened tokens.

The model is pure: it knows nothing about blocks or caches. Each layer hands its rotated q, k, v to
an ``AttentionFn`` supplied by the caller (the runner's paged attention, or a plain causal one in
tests). All linear layers run on ``[total_tokens, hidden]``; q/k/v and gate/up are fused into one
matmul each (the loader concatenates the checkpoint's weights into them).

Gemma 3 is the same decoder with a few switches (``ModelConfig.is_gemma``): embeddings scaled by
sqrt(hidden), GeGLU, a norm after each sublayer as well as before (``GemmaDecoderLayer``), RMSNorm
weights used as ``1 + w`` (the loader stores them so), its own attention scale, sliding-window
layers with their own RoPE, and an optional tanh cap on the final logits.

Under tensor parallelism (``tp``, a :class:`~pagedkv.distributed.group.TPGroup` of several ranks)
the model is one rank's shard (``models/sharding.py``): built from the full config, it holds its
query and KV heads, its share of every intermediate size and of the vocabulary; the attention's
and the MLP's outputs are summed over the ranks (one ``all_reduce`` each), the embedding is a
masked lookup of the rank's rows summed likewise, and the logits of every rank's vocabulary rows
are gathered, so ``forward`` returns the whole vocabulary's logits on every rank. Every rank must
run every forward pass (the collectives pair them up).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.distributed.group import TPGroup
from pagedkv.models.config import ModelConfig
from pagedkv.models.mla import MLAAttention
from pagedkv.models.moe import MoEMLP
from pagedkv.models.native_layer import NativeLayer, op_available
from pagedkv.models.rope import RotaryEmbedding, apply_rope
from pagedkv.models.sharding import local_config, local_vocab, multi_rank
from pagedkv.ops.fused import add_rms_norm, rope_qk, silu_mul


class AttentionFn(Protocol):
    """Attention for one layer: q ``[T, heads, d]``, k/v ``[T, kv_heads, d]`` -> ``[T, heads, d]``.

    An attention function may also offer ``native_layer_args(layer_idx) -> tuple | None``: what the
    native decoder layer (``models/native_layer.py``) needs of the layer's cache and the step, where
    this step can run a layer in one native call; the model passes the tuple on unread."""

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.native = False  # set by the runner where torch.ops.pagedkv.rms_norm is loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous():
            out = torch.empty_like(x)
            torch.ops.pagedkv.rms_norm(out, x, self.weight, self.eps)
            return out
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = multi_rank(tp)  # a rank's shard (config is then rank-local): o_proj's output summed
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        qkv_out = config.q_size + 2 * config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_out, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.o_proj_bias)
        # qwen3: RMSNorm over each head of q and of k, before RoPE
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.native = False  # set by the runner where the native kernels are loaded: fused RoPE

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn
                ) -> torch.Tensor:
        t = x.shape[0]
        h, kvh = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(t, h + 2 * kvh, self.head_dim)  # [T, H + 2*KVH, d]
        if self.q_norm is not None:  # k_norm is set with q_norm (qk_norm): not tested again on the hot path
            qkv = torch.cat((self.q_norm(qkv[:, :h]), self.k_norm(qkv[:, h:h + kvh]),  # type: ignore[misc]
                             qkv[:, h + kvh:]), dim=1)
        if self.native:  # one pass (ops/fused.py): q out contiguous, k rotated in place in qkv
            q, k = rope_qk(qkv, cos, sin, h, kvh, True)
        else:
            qk = apply_rope(qkv[:, : h + kvh], cos, sin)  # q and k rotated in one op
            q, k = qk[:, :h], qk[:, h:]
        v = qkv[:, h + kvh:]
        out = attention(self.layer_idx, q, k, v)  # [T, H, d]
        out = self.o_proj(out.reshape(t, h * self.head_dim))
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = multi_rank(tp)  # a rank's shard: down_proj's output summed over the ranks
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"  # GeGLU (gemma) instead of SwiGLU
        self.native = False  # set by the runner where the native kernels are loaded: fused SiLU x up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * I]
        if self.native and not self.gelu:  # one pass, no [T, I] temporary (ops/fused.py)
            out = self.down_proj(silu_mul(gate_up, True))
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
            out = self.down_proj(act.mul_(up))  # in place: no second [T, I] temporary
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # DeepSeek's latent attention (models/mla.py) takes the same AttentionFn
        attention: type[nn.Module] = MLAAttention if config.is_mla else LlamaAttention
        self.self_attn = attention(config, layer_idx, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # a mixture-of-experts layer (models/moe.py) has the same [T, hidden] -> [T, hidden] contract
        self.mlp: nn.Module = MoEMLP(config, tp) if config.is_moe_layer(layer_idx) else LlamaMLP(config, tp)

    def native_layer(self) -> NativeLayer | None:
        """This layer's weights packed for the native decoder layer (``models/native_layer.py``), or
        None where it is not a plain one on the fused ops: latent attention, experts, a
        tensor-parallel shard, a linear the op does not know (a LoRA wrapper)."""
        return _native_layer(self.self_attn, self.mlp, (self.input_layernorm, self.post_attention_layernorm))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn
                ) -> torch.Tensor:
        # the sublayers return fresh tensors, so adding the residual in place into them is safe
        h = self.self_attn(self.input_layernorm(x), cos, sin, attention)
        norm = self.post_attention_layernorm
        if norm.native:  # the residual add and the norm after it in one pass (ops/fused.py)
            h, x = add_rms_norm(h, x, norm.weight, norm.eps, True)
        else:
            x = h.add_(x)
            h = norm(x)
        return self.mlp(h).add_(x)


class GemmaDecoderLayer(nn.Module):
    """Gemma's layer: each sublayer's output is normed too before it joins the residual."""

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = LlamaAttention(config, layer_idx, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = LlamaMLP(config, tp)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def native_layer(self) -> NativeLayer | None:
        """This layer packed for the native decoder layer (Gemma's form), or None (as Llama's)."""
        return _native_layer(self.self_attn, self.mlp, (self.input_layernorm, self.post_attention_layernorm),
                             (self.pre_feedforward_layernorm, self.post_feedforward_layernorm))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn
                ) -> torch.Tensor:
        x = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, attention)).add_(x)
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))).add_(x)


def _native_layer(attn: nn.Module, mlp: nn.Module, norms: tuple[RMSNorm, RMSNorm],
                  ff_norms: tuple[RMSNorm, RMSNorm] | None = None) -> NativeLayer | None:
    """A layer's weights for the native decoder layer: Llama's form, or Gemma's with ``ff_norms``
    (its MLP then GeGLU); None where the op would not compute what the modules do."""
    if type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP:
        return None
    qk = (attn.q_norm, attn.k_norm) if attn.q_norm is not None and attn.k_norm is not None else None
    all_norms = (*norms, *(qk or ()), *(ff_norms or ()))
    if (attn.tp is not None or mlp.tp is not None or mlp.gelu != (ff_norms is not None)
            or not (attn.native and mlp.native) or not all(n.native for n in (*norms, *(ff_norms or ())))
            or (attn.q_norm is not None and qk is None) or len({n.eps for n in all_norms}) != 1):
        return None
    return NativeLayer.pack((norms[0].weight, norms[1].weight),
                            (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj),
                            norms[0].eps, attn.num_heads, attn.num_kv_heads,
                            (qk[0].weight, qk[1].weight) if qk is not None else None,
                            (ff_norms[0].weight, ff_norms[1].weight) if ff_norms is not None else None)


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. ``forward`` takes flattened tokens of many sequences at once.

    Built from the whole model's ``config``; with ``tp`` of several ranks it is this rank's shard:
    ``config`` is then the rank-local one (``models/sharding.local_config``: what the KV cache is
    sized by) and ``full_config`` the whole model's."""

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.full_config = config
        self.tp = multi_rank(tp)
        config = local_config(config, self.tp) if self.tp is not None else config
        self.config = config
        vocab = local_vocab(config, self.tp)  # the rank's rows (padded): all of them on one rank
        self.vocab_start = vocab * self.tp.rank if self.tp is not None else 0
        # _weight skips nn.Embedding's random init (slow on the meta device the loader builds on)
        self.embed_tokens = nn.Embedding(vocab, config.hidden_size, _weight=torch.empty(vocab, config.hidden_size))
        layer = GemmaDecoderLayer if config.is_gemma else LlamaDecoderLayer
        self.layers = nn.ModuleList(layer(config, i, self.tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Module | None = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, vocab, bias=False)
        )
        # Not submodules: their tables are derived data, never part of the state dict. One per
        # distinct RoPE (gemma3's sliding layers have their own); layer i uses ropes[rope_of[i]].
        ropes = list(dict.fromkeys(config.layer_rope(i) for i in range(config.num_hidden_layers)))
        self.rope_of = [ropes.index(config.layer_rope(i)) for i in range(config.num_hidden_layers)]
        rope_head = config.rotary_dim if config.is_mla else config.head_dim  # MLA: the decoupled RoPE dims
        self.rotaries = [RotaryEmbedding(r, rope_head, config.max_position_embeddings) for r in ropes]
        self.embed_scale = config.hidden_size ** 0.5 if config.is_gemma else None
        # per layer, its native one-call form where enable_native_layers packed it (None: modules)
        self.native_layers: list[NativeLayer | None] = [None] * config.num_hidden_layers

    def enable_native_layers(self, on: bool = True) -> int:
        """Run each layer that can in one native call (``models/native_layer.py``) on the steps whose
        attention offers it; call after every module swap (layouts, LoRA). Returns how many layers
        took it (0 with ``on`` False, or where the op is unavailable)."""
        ok = on and op_available()
        self.native_layers = [layer.native_layer() if ok and isinstance(layer, (LlamaDecoderLayer, GemmaDecoderLayer))
                              else None for layer in self.layers]
        return sum(p is not None for p in self.native_layers)

    def set_context_length(self, context: int) -> None:
        """The longest context served (longrope picks its factors by it; see ``models/rope.py``)."""
        for rotary in self.rotaries:
            rotary.set_context_length(context)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attention: AttentionFn,
        logits_indices: torch.Tensor | None = None,  # [N] rows of T whose logits are wanted
        max_position: int | None = None,
    ) -> torch.Tensor:
        """Logits ``[N, vocab]`` (``N = T`` when ``logits_indices`` is None), in the model's dtype."""
        x = self.embed_tokens(input_ids) if self.tp is None else self._embed_shard(input_ids)  # [T, hidden]
        if self.embed_scale is not None:  # rounded to the model dtype first, as transformers does
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        top = int(positions.max()) if max_position is None else max_position
        # [T, 1, d] each, shared by all layers of one RoPE
        tables = [rotary.cos_sin(positions, top, x.dtype) for rotary in self.rotaries]
        native_args = getattr(attention, "native_layer_args", None) if x.dtype == torch.float32 else None
        for i, (layer, rope, fused) in enumerate(zip(self.layers, self.rope_of, self.native_layers)):
            args = native_args(i) if fused is not None and native_args is not None else None
            if args is None or fused is None:
                x = layer(x, *tables[rope], attention)
            else:
                x = fused(x, *tables[rope], args)
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)  # [N, hidden]: only the rows we sample from
        x = self.norm(x)
        if self.lm_head is None:  # tied: the embedding matrix is the head
            logits = F.linear(x, self.embed_tokens.weight)  # [N, vocab]
        else:
            logits = self.lm_head(x)  # [N, vocab]
        if self.tp is not None:  # every rank's rows, in rank order; the padding rows dropped
            logits = self.tp.all_gather(logits, dim=-1)[:, :self.config.vocab_size].contiguous()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _embed_shard(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The vocabulary-parallel lookup: this rank's rows (zeros for ids of other ranks), summed
        over the ranks; exact, as each id's row comes from one rank."""
        assert self.tp is not None
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        x = self.embed_tokens(torch.where(inside, local, 0))
        return self.tp.all_reduce(x.masked_fill_(~inside.unsqueeze(-1), 0))
