"""Mixture-of-experts MLP: a router picks ``top_k`` experts per token; each expert is a SwiGLU MLP.

One module covers the families ``ModelConfig.moe`` describes (:class:`~pagedkv.models.config.MoEConfig`):

- Mixtral, Qwen2-MoE, Qwen3-MoE: softmax over the router logits, top-k, renormalized when the
  config says so (Mixtral always; Qwen's ``norm_topk_prob``). Qwen2-MoE adds a shared expert whose
  output is scaled by ``sigmoid(shared_expert_gate(x))``.
- DeepSeek-V2: softmax scores; ``group_limited_greedy`` keeps the ``topk_group`` groups with the
  largest single score; the weights times ``routed_scaling_factor``; shared experts added ungated.
- DeepSeek-V3: sigmoid scores; the choice (not the weights) adds ``e_score_correction_bias``; groups
  ranked by the sum of their two best choice scores; weights renormalized, then scaled.

Experts run grouped: the ``[T * top_k]`` (token, expert) pairs are sorted by expert, and each
expert that got rows runs one gate/up matmul and one down matmul over all of them (never a loop
over tokens). The weighted rows are summed back into their tokens with one ``index_add_``.

Expert weights are 3-D parameters (``gate_up [E, 2I, hidden]``, ``down [E, hidden, I]``), the
layout transformers 5 and llama.cpp (``ffn_*_exps``) keep them in, or quantized
(:class:`~pagedkv.models.quant_linear.QuantExperts`, put there by ``quantize_model`` or by a GGUF's
quantized experts): each active expert's rows then go through the 8-bit (or low-bit) kernel over
that expert's slice of the weights, one call per active expert per step. The router weight is a
plain parameter, kept in float by ``quantize_model`` (a flipped top-k choice changes which expert
runs, a larger change than any rounding of the experts themselves).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.distributed.group import TPGroup
from pagedkv.models.config import ModelConfig, MoEConfig
from pagedkv.models.quant_linear import QuantExperts


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP beside the routed experts (DeepSeek's ``shared_experts``, Qwen2-MoE's
    ``shared_expert``), gate and up fused into one matmul like ``LlamaMLP``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


def route(moe: MoEConfig, logits: torch.Tensor, correction_bias: torch.Tensor | None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, top_k]`` float32, expert ids ``[T, top_k]``) from router ``logits [T, E]``."""
    logits = logits.float()
    scores = logits.sigmoid() if moe.scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if moe.n_group > 1 and moe.topk_group < moe.n_group:
        grouped = choice.view(-1, moe.n_group, moe.num_experts // moe.n_group)
        if moe.group_score == "top2_sum":  # DeepSeek-V3
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        else:  # DeepSeek-V2's group_limited_greedy: the best single score of each group
            group_scores = grouped.max(dim=-1).values
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(moe.topk_group, dim=-1, sorted=False)[1], True)
        mask = keep.unsqueeze(-1).expand_as(grouped).reshape_as(choice)
        # -inf (V3) or 0 (V2, whose scores are positive softmax values) for the dropped groups
        choice = choice.masked_fill(~mask, float("-inf") if moe.group_score == "top2_sum" else 0.0)
    ids = choice.topk(moe.top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob and moe.top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if moe.scoring == "sigmoid" else 0.0))
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return weights, ids


def _expert_linear(weight: nn.Parameter | QuantExperts, expert: int, x: torch.Tensor,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [n, in] @ weight[expert]^T`` in ``x``'s dtype (into ``out`` when given): a float 3-D
    parameter's slice, or the quantized kernel over a :class:`QuantExperts` expert (float32 rows)."""
    if not isinstance(weight, QuantExperts):
        return F.linear(x, weight[expert]) if out is None else torch.matmul(x, weight[expert].t(), out=out)
    if x.dtype == torch.float32 and (out is None or out.dtype == torch.float32):
        return weight.linear(expert, x.contiguous(), out)
    y = weight.linear(expert, x.float().contiguous())
    return y.to(x.dtype) if out is None else out.copy_(y)


class MoEMLP(nn.Module):
    """A sparse MLP layer: router, ``num_experts`` SwiGLU experts run grouped by expert, optional
    shared expert(s). Input and output ``[T, hidden]`` like ``LlamaMLP``."""

    EXPERT_WEIGHTS = ("gate_up", "down")  # the 3-D expert weights ``quantize_model`` swaps for QuantExperts

    def __init__(self, config: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        # a rank's shard (models/sharding.py): every expert's intermediate split, the sum over ranks at the end
        self.tp = tp if tp is not None and tp.size > 1 else None
        moe = config.moe
        if moe is None:
            raise ValueError("MoEMLP needs ModelConfig.moe")
        self.moe = moe
        hidden, e, inter = config.hidden_size, moe.num_experts, moe.intermediate_size
        self.router = nn.Parameter(torch.empty(e, hidden))  # [E, hidden]: a Parameter, so it stays float
        self.e_score_correction_bias = nn.Parameter(torch.empty(e)) if moe.correction_bias else None
        self.gate_up: nn.Parameter | QuantExperts = nn.Parameter(torch.empty(e, 2 * inter, hidden))  # [E, 2I, hidden]
        self.down: nn.Parameter | QuantExperts = nn.Parameter(torch.empty(e, hidden, inter))  # [E, hidden, I]
        self.shared = SharedExpert(hidden, moe.shared_intermediate_size) if moe.shared_intermediate_size else None
        self.shared_gate = nn.Linear(hidden, 1, bias=False) if moe.shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, inter = self.moe.top_k, self.moe.intermediate_size
        logits = F.linear(x.float(), self.router.float()) if self.moe.router_float32 else F.linear(x, self.router)
        weights, ids = route(self.moe, logits, self.e_score_correction_bias)
        flat = ids.flatten()  # [T * k]: pair p is token p // k
        order = flat.argsort(stable=True)  # pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        rows = order // k  # the token of each sorted pair
        xs = x.index_select(0, rows)  # [T * k, hidden]
        ys = torch.empty_like(xs)
        start = 0
        for expert, n in enumerate(counts):
            if not n:
                continue
            gate, up = _expert_linear(self.gate_up, expert, xs[start:start + n]).split(inter, dim=-1)
            _expert_linear(self.down, expert, F.silu(gate).mul_(up), out=ys[start:start + n])
            start += n
        ys.mul_(weights.flatten().index_select(0, order).unsqueeze(1).to(ys.dtype))
        out = torch.zeros_like(x).index_add_(0, rows, ys)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(x))
            out.add_(shared)
        return out if self.tp is None else self.tp.all_reduce(out)
