"""Tensor-parallel shards of a model: the rank-local config and where each parameter is split.

Megatron's split (``distributed/group.py`` has the rules for heads and the vocabulary):

- column-parallel (each rank holds some output rows): ``qkv_proj`` (its q, k and v parts split
  apart: q by query heads, k and v by KV heads, a replicated KV head where there are fewer than
  ranks), ``gate_up_proj`` (gate and up apart), a mixture-of-experts layer's ``gate_up`` per
  expert and its shared expert's ``gate_up_proj`` (each expert's intermediate rows split, so every
  rank runs every expert on its share: no load imbalance whatever the routing), MLA's ``q_proj`` /
  ``q_b_proj`` and ``kv_b`` by query head;
- row-parallel (each rank holds some input columns; the layer's output is summed by one
  ``all_reduce``): ``o_proj``, ``down_proj``, the experts' ``down`` and the shared expert's
  ``down_proj``; their biases are added once (rank 0 holds them, the others zeros);
- the vocabulary by rows (``embed_tokens``, ``lm_head``; a tied head is the embedding's shard),
  padded to a multiple of the ranks;
- everything else (norms, the router, MLA's latent projections ``q_a_proj`` /
  ``kv_a_proj_with_mqa`` and their norms) replicated.

:func:`param_split` answers per parameter; the loader reads only those rows or columns of each
checkpoint tensor (``models/weights.py``), and the LoRA slots split an adapter's pairs the same way
(``lora/layers.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from pagedkv.distributed.group import (
    TPGroup,
    check_shardable,
    kv_head_range,
    padded_vocab,
    shard_range,
    vocab_range,
)
from pagedkv.models.config import ModelConfig

# module suffixes (inside ``layers.N.``) by how they split
_COLUMN = ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.shared.gate_up_proj", "self_attn.q_proj",
           "self_attn.q_b_proj", "self_attn.kv_b", "mlp.gate_up")
_ROW = ("self_attn.o_proj", "mlp.down_proj", "mlp.shared.down_proj", "mlp.down")
# a quantized module's buffers split as its weight does (models/quant_linear.py)
_WEIGHT_LIKE = ("weight", "qweight", "planes", "scales", "offsets")


@dataclass(frozen=True, slots=True)
class Segment:
    """A run ``[start, end)`` of a split dimension in the full model; the rank holds ``[rank_start,
    rank_end)`` of it, at ``local`` in its own tensor (runs are packed in order: local rows of a
    fused q/k/v are the rank's q rows, then its k rows, then its v rows)."""

    start: int
    end: int
    rank_start: int
    rank_end: int
    local: int


@dataclass(frozen=True, slots=True)
class Split:
    """How one parameter is split: along ``dim`` (of one expert's matrix for the 3-D expert
    parameters) in ``segments``; ``rank0_only``: replicated in shape but rank 0 alone holds the
    values (a row-parallel bias, added once after the sum)."""

    dim: int = 0
    segments: tuple[Segment, ...] = ()
    rank0_only: bool = False

    @property
    def local_size(self) -> int:
        return sum(s.rank_end - s.rank_start for s in self.segments)


def check_tp(config: ModelConfig, size: int) -> None:
    """Raise ShardingError (naming the dimension and the sizes that would work) when ``config``
    cannot be split over ``size`` ranks."""
    moe = config.moe
    check_shardable(size, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                    intermediate=config.intermediate_size,
                    moe_intermediate=moe.intermediate_size if moe is not None else 0,
                    shared_intermediate=moe.shared_intermediate_size if moe is not None else 0,
                    is_mla=config.is_mla, what=f"this {config.model_type} model")


def local_config(config: ModelConfig, tp: TPGroup) -> ModelConfig:
    """The rank's own config: its query heads, its KV heads (one replicated head where there are
    fewer than ranks; MLA's latent, one head, on every rank), its share of every intermediate size.
    ``vocab_size`` stays the whole vocabulary (the model gathers full logits). The identity for one
    rank. Raises ShardingError for a shape that does not split."""
    if tp.size == 1:
        return config
    check_tp(config, tp.size)
    kv0, kv1 = kv_head_range(config.num_key_value_heads, tp.rank, tp.size)
    moe = config.moe
    if moe is not None:
        moe = replace(moe, intermediate_size=moe.intermediate_size // tp.size,
                      shared_intermediate_size=moe.shared_intermediate_size // tp.size)
    return replace(config, num_attention_heads=config.num_attention_heads // tp.size,
                   num_key_value_heads=config.num_key_value_heads if config.is_mla else kv1 - kv0,
                   intermediate_size=config.intermediate_size // tp.size,
                   moe_intermediate_size=config.moe_intermediate_size // tp.size, moe=moe)


def local_vocab(config: ModelConfig, tp: TPGroup | None) -> int:
    """Rows of the rank's embedding and LM head (the padded vocabulary's share)."""
    return config.vocab_size if tp is None or tp.size == 1 else padded_vocab(config.vocab_size, tp.size) // tp.size


def _even(start: int, end: int, tp: TPGroup, local: int) -> Segment:
    a, b = shard_range(end - start, tp.rank, tp.size)
    return Segment(start, end, start + a, start + b, local)


def _packed(runs: list[tuple[int, int, int, int]]) -> tuple[Segment, ...]:
    """Segments of (start, end, rank_start, rank_end) runs, packed in order."""
    out, local = [], 0
    for start, end, a, b in runs:
        out.append(Segment(start, end, a, b, local))
        local += b - a
    return tuple(out)


def _column_runs(config: ModelConfig, module: str, tp: TPGroup) -> tuple[Segment, ...]:
    """The output-row runs of a column-parallel ``module`` (its suffix inside a layer)."""
    heads = config.num_attention_heads
    if module == "self_attn.qkv_proj":
        d, kvh = config.head_dim, config.num_key_value_heads
        q = config.q_size
        h0, h1 = shard_range(heads, tp.rank, tp.size)
        k0, k1 = kv_head_range(kvh, tp.rank, tp.size)
        kv = kvh * d
        return _packed([(0, q, h0 * d, h1 * d), (q, q + kv, q + k0 * d, q + k1 * d),
                        (q + kv, q + 2 * kv, q + kv + k0 * d, q + kv + k1 * d)])
    if module in ("self_attn.q_proj", "self_attn.q_b_proj", "self_attn.kv_b"):  # MLA: whole heads
        per = (config.qk_nope_head_dim or 0) + (config.qk_rope_head_dim or 0)
        if module == "self_attn.kv_b":
            per = (config.qk_nope_head_dim or 0) + (config.v_head_dim or 0)
        return (_even(0, heads * per, tp, 0),)
    inter = _intermediate(config, module)
    first = _even(0, inter, tp, 0)
    second = _even(inter, 2 * inter, tp, first.rank_end - first.rank_start)
    return (first, second)


def _intermediate(config: ModelConfig, module: str) -> int:
    moe = config.moe
    if module in ("mlp.gate_up", "mlp.down"):
        return moe.intermediate_size if moe is not None else 0
    if module in ("mlp.shared.gate_up_proj", "mlp.shared.down_proj"):
        return moe.shared_intermediate_size if moe is not None else 0
    return config.intermediate_size


def _row_width(config: ModelConfig, module: str) -> int:
    """The full input width of a row-parallel ``module``."""
    if module == "self_attn.o_proj":
        return config.num_attention_heads * (config.v_head_dim or 0) if config.is_mla else config.q_size
    return _intermediate(config, module)


def param_split(config: ModelConfig, param: str, tp: TPGroup | None) -> Split | None:
    """How the module parameter ``param`` (``layers.3.self_attn.qkv_proj.weight``,
    ``embed_tokens.qweight``, ``layers.1.mlp.gate_up``) of the FULL model ``config`` splits over
    ``tp``; None: replicated (or no tensor parallelism). ``dim`` counts within one expert's matrix
    for the 3-D expert parameters ``mlp.gate_up`` / ``mlp.down``."""
    if tp is None or tp.size == 1:
        return None
    module, _, leaf = param.rpartition(".")
    if module in ("embed_tokens", "lm_head") and leaf in _WEIGHT_LIKE:
        a, b = vocab_range(config.vocab_size, tp.rank, tp.size)
        return Split(0, (Segment(0, config.vocab_size, a, b, 0),))
    parts = param.split(".", 2)
    if len(parts) < 3 or parts[0] != "layers":
        return None
    if parts[2] in ("mlp.gate_up", "mlp.down", "self_attn.kv_b"):  # bare Parameters (MoE's 3-D, MLA's)
        suffix, leaf = parts[2], "weight"
    else:
        suffix, _, leaf = parts[2].rpartition(".")
    if suffix in _COLUMN and (leaf in _WEIGHT_LIKE or leaf == "bias"):
        if suffix in ("self_attn.q_proj", "self_attn.q_b_proj", "self_attn.kv_b") and not config.is_mla:
            return None
        return Split(0, _column_runs(config, suffix, tp))
    if suffix in _ROW:
        if leaf == "bias":
            return Split(rank0_only=True)
        if leaf in _WEIGHT_LIKE:
            return Split(1, (_even(0, _row_width(config, suffix), tp, 0),))
    return None


def row_parallel(module: str) -> bool:
    """Whether the module suffix ``module`` (inside a layer) is row-parallel (sums over ranks)."""
    return module in _ROW


def multi_rank(tp: TPGroup | None) -> TPGroup | None:
    """``tp`` when it has several ranks, else None (one rank: no collective anywhere)."""
    return tp if tp is not None and tp.size > 1 else None


Index = tuple[slice, ...]


class LazyTensor(Protocol):
    """A checkpoint tensor not read yet (``models/hf_loader.py``: a safetensors entry): its
    ``shape``, and ``read(index)``, which reads only the rows/columns ``index`` names (all of it
    for None)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def read(self, index: Index | None = None, out: torch.Tensor | None = None) -> torch.Tensor: ...


def read(src: torch.Tensor | LazyTensor, index: Index | None = None, out: torch.Tensor | None = None
         ) -> torch.Tensor:
    """``src[index]`` (all of ``src`` for None), read from the file only now for a LazyTensor;
    with ``out`` (of the same shape) into it, returned, else a tensor of the part's own shape
    (the caller checks the shape)."""
    if isinstance(src, torch.Tensor):
        part = src if index is None else src[index]
        return out.copy_(part) if out is not None and out.shape == part.shape else part
    return src.read(index, out)


def column_bounds(split: Split, cols: int) -> tuple[int, int] | None:
    """The rank's columns of a row-parallel tensor of ``cols`` columns (a quantized buffer packs
    several weights per column, or one scale per 16/32: its columns scale with the weight's), or
    None where the rank's first or last weight column falls inside a block of 32 (a quantized
    tensor whose blocks do not divide over the ranks)."""
    seg = split.segments[0]
    full = seg.end - seg.start
    if cols == full:
        return seg.rank_start, seg.rank_end
    if seg.rank_start % 32 or seg.rank_end % 32 or (seg.rank_start * cols) % full or (seg.rank_end * cols) % full:
        return None
    return seg.rank_start * cols // full, seg.rank_end * cols // full


def shard_copies(split: Split, dest: torch.Tensor, shape: tuple[int, ...], row_start: int,
                 row_end: int | None, lead: int) -> list[tuple[Index, torch.Tensor]]:
    """(index into the checkpoint tensor of ``shape``, the rank's destination view) pairs that
    load the rank's shard of one tensor. ``dest`` is the rank's parameter (one expert's matrix, or
    all experts with ``lead`` = 1 leading dims the split's ``dim`` does not count); the tensor
    fills the full model's rows ``row_start .. row_end`` of it (a part of a fused q/k/v or gate/up).
    Raises ValueError for a column split inside a quantization block (see :func:`column_bounds`)."""
    pre: Index = (slice(None),) * lead
    rows = shape[lead]
    if split.dim == 0:
        out = []
        for seg in split.segments:
            a, b = max(seg.rank_start, row_start), min(seg.rank_end, row_start + rows)
            if a < b:
                local = seg.local + a - seg.rank_start
                out.append((pre + (slice(a - row_start, b - row_start),), dest[pre + (slice(local, local + b - a),)]))
        return out
    bounds = column_bounds(split, shape[lead + 1])
    if bounds is None:
        raise ValueError("a row-parallel split inside a quantization block")
    if row_end is not None or row_start:
        dest = dest[pre + (slice(row_start, row_end),)]
    return [(pre + (slice(None), slice(*bounds)), dest)]
