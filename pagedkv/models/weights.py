"""Checkpoint -> module weight mapping: an explicit name map plus the q/k/v and gate/up fusion.

Checkpoint names are Hugging Face's (``model.layers.3.self_attn.q_proj.weight``); the GGUF loader
renames llama.cpp tensors to them first, so this is the single place that knows the module layout.
A weight kept in Q8_0 (``models/quant_linear.py``) is two or three checkpoint tensors,
``<name>.weight_q8_0`` (int8), ``<name>.weight_q8_0_scales`` (float32) and, where its values have an
offset per 32, ``<name>.weight_q8_0_offsets`` (float32), filling the module's ``qweight``, ``scales``
and ``offsets`` rows exactly as ``<name>.weight`` fills ``weight``. A fused module (q/k/v, gate/up)
gets offsets when any of its parts has them; the rows of parts without stay 0. A weight in a
low-bit layout (``weight_quant.LOWBIT_FORMATS``) is ``<name>.weight_lb_<fmt>`` (uint8 nibbles),
``_lb_<fmt>_planes``, ``_lb_<fmt>_scales`` and ``_lb_<fmt>_offsets``, filling ``qweight``,
``planes``, ``scales`` and ``offsets`` the same way; the name says the format.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch
from torch import nn

from pagedkv.distributed.group import TPGroup
from pagedkv.models.config import ModelConfig
from pagedkv.models.errors import MissingTensorError, ModelLoadError
from pagedkv.models.llama import LlamaForCausalLM
from pagedkv.models.packed_linear import input_major, pack_lm_head
from pagedkv.models.quant_linear import QuantEmbedding, QuantExperts, QuantLinear, tie_quantized_head
from pagedkv.models.sharding import LazyTensor, Split, column_bounds, param_split, read, shard_copies
from pagedkv.weight_quant import LOWBIT_FORMATS

logger = logging.getLogger(__name__)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_WIDE = re.compile(r"^layers\.(\d+)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight$")  # input-major on CPU
# checkpoint suffix inside a layer -> (module suffix, shard name or None)
_LAYER_MAP: dict[str, tuple[str, str | None]] = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "post_attention_layernorm.weight": ("post_attention_layernorm.weight", None),
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", "q"),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", "k"),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", "v"),
    "self_attn.q_proj.bias": ("self_attn.qkv_proj.bias", "q"),
    "self_attn.k_proj.bias": ("self_attn.qkv_proj.bias", "k"),
    "self_attn.v_proj.bias": ("self_attn.qkv_proj.bias", "v"),
    "self_attn.o_proj.weight": ("self_attn.o_proj.weight", None),
    "self_attn.o_proj.bias": ("self_attn.o_proj.bias", None),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", "gate"),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", "up"),
    "mlp.gate_proj.bias": ("mlp.gate_up_proj.bias", "gate"),
    "mlp.up_proj.bias": ("mlp.gate_up_proj.bias", "up"),
    "mlp.down_proj.weight": ("mlp.down_proj.weight", None),
    # qwen3's per-head q/k norms; phi3's checkpoints hold q/k/v and gate/up already fused
    "self_attn.q_norm.weight": ("self_attn.q_norm.weight", None),
    "self_attn.k_norm.weight": ("self_attn.k_norm.weight", None),
    "self_attn.qkv_proj.weight": ("self_attn.qkv_proj.weight", None),
    "mlp.gate_up_proj.weight": ("mlp.gate_up_proj.weight", None),
    "mlp.down_proj.bias": ("mlp.down_proj.bias", None),
    # gemma's norms after the attention and around the MLP (its post_attention_layernorm follows
    # the attention; llama's comes before the MLP: the layer class says which)
    "pre_feedforward_layernorm.weight": ("pre_feedforward_layernorm.weight", None),
    "post_feedforward_layernorm.weight": ("post_feedforward_layernorm.weight", None),
}
_TOP_MAP: dict[str, str] = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.masked_bias|\.attn\.bias)$")
# Q8_0 checkpoint suffix -> the QuantLinear / QuantEmbedding buffer it fills
_Q8_0_SUFFIXES = {".weight_q8_0": "qweight", ".weight_q8_0_scales": "scales", ".weight_q8_0_offsets": "offsets"}
# low-bit checkpoint suffix -> (format, buffer)
_LOWBIT_SUFFIXES = {f".weight_lb_{fmt}{tail}": (fmt, buffer) for fmt in LOWBIT_FORMATS
                    for tail, buffer in (("", "qweight"), ("_planes", "planes"), ("_scales", "scales"),
                                         ("_offsets", "offsets"))}
# Multimodal checkpoints (Gemma3ForConditionalGeneration) keep the language model under a prefix,
# old and new layouts; their vision tower and projector are not used.
_LANGUAGE_MODEL = re.compile(r"^(?:language_model\.model\.|model\.language_model\.)")
_VISION = re.compile(r"^(?:model\.)?(?:vision_tower|multi_modal_projector)\.")


# Mixture-of-experts layers (models/moe.py): one expert's matrix per checkpoint tensor (HF's
# per-expert names; Mixtral's w1/w3/w2 are gate/up/down), or all experts at once (transformers 5's
# fused 3-D ``experts.gate_up_proj`` / ``experts.down_proj``).
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_MOE_MAP: dict[str, str] = {
    "mlp.gate.weight": "mlp.router", "block_sparse_moe.gate.weight": "mlp.router",
    "mlp.gate.e_score_correction_bias": "mlp.e_score_correction_bias",
    "mlp.experts.gate_up_proj": "mlp.gate_up", "mlp.experts.down_proj": "mlp.down",
    "mlp.shared_expert_gate.weight": "mlp.shared_gate.weight",
    # quantized experts (a GGUF's ffn_*_exps kept 8-bit or low-bit): ``experts.gate_up_proj.weight_q8_0``
    # and the rest fill QuantExperts' buffers (``mlp.gate_up.qweight``, ...) through map_name's quantized branch
    "mlp.experts.gate_up_proj.weight": "mlp.gate_up.weight", "mlp.experts.down_proj.weight": "mlp.down.weight",
}
_SHARED = re.compile(r"^mlp\.shared_experts?\.(gate_proj|up_proj|down_proj)\.weight$")


class Target(NamedTuple):
    """Where one checkpoint tensor goes: a module parameter, the expert inside it (a 3-D expert
    parameter's first index; None: not one) and the row range inside that."""

    param: str
    row_start: int
    row_end: int | None  # None: the whole parameter (or expert)
    expert: int | None = None


def _shard_rows(config: ModelConfig, shard: str) -> tuple[int, int]:
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    return {
        "q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv),
        "gate": (0, inter), "up": (inter, 2 * inter),
    }[shard]


def _quant_split(name: str) -> tuple[str, str, str] | None:
    """(the float weight's checkpoint name, buffer, format) of a Q8_0 or low-bit checkpoint name,
    else None."""
    if ".weight_" not in name:
        return None
    for suffix, buffer in _Q8_0_SUFFIXES.items():
        if name.endswith(suffix):
            return name.removesuffix(suffix) + ".weight", buffer, "q8_0"
    for suffix, (fmt, buffer) in _LOWBIT_SUFFIXES.items():
        if name.endswith(suffix):
            return name.removesuffix(suffix) + ".weight", buffer, fmt
    return None


def _q8_0_split(name: str) -> tuple[str, str] | None:
    """(the float weight's checkpoint name, buffer) of a quantized checkpoint name, else None."""
    split = _quant_split(name)
    return None if split is None else (split[0], split[1])


def map_name(config: ModelConfig, name: str) -> Target | None:
    """The module target of checkpoint tensor ``name``; None for names the model does not use."""
    if (q8 := _q8_0_split(name)) is not None:  # a Q8_0 pair fills the rows its float weight would
        target = map_name(config, q8[0])
        return None if target is None else target._replace(param=target.param.removesuffix("weight") + q8[1])
    name = _LANGUAGE_MODEL.sub("model.", name)
    if name == "language_model.lm_head.weight":
        name = "lm_head.weight"
    if name in _TOP_MAP:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            return None
        return Target(_TOP_MAP[name], 0, None)
    m = _LAYER.match(name)
    if m and config.is_mla and m.group(2).startswith("self_attn.") and int(m.group(1)) < config.num_hidden_layers:
        return _map_mla(int(m.group(1)), m.group(2))
    if m and config.is_moe_layer(int(m.group(1))):
        return _map_moe(config, int(m.group(1)), m.group(2))
    if m and m.group(2) in _LAYER_MAP:
        layer = int(m.group(1))
        if layer >= config.num_hidden_layers:
            return None
        suffix, shard = _LAYER_MAP[m.group(2)]
        param = f"layers.{layer}.{suffix}"
        if shard is None:
            return Target(param, 0, None)
        start, end = _shard_rows(config, shard)
        return Target(param, start, end)
    return None


# MLA layers (models/mla.py): the checkpoint's own module names, kv_b_proj's weight a bare Parameter
_MLA_NAMES = frozenset(f"self_attn.{m}.{p}" for m in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                      "o_proj", "q_a_layernorm", "kv_a_layernorm")
                       for p in ("weight", "bias"))


def _map_mla(layer: int, suffix: str) -> Target | None:
    """The target of an MLA layer's attention tensor ``suffix`` (``self_attn.*``)."""
    if suffix == "self_attn.kv_b_proj.weight":
        return Target(f"layers.{layer}.self_attn.kv_b", 0, None)
    return Target(f"layers.{layer}.{suffix}", 0, None) if suffix in _MLA_NAMES else None


def _map_moe(config: ModelConfig, layer: int, suffix: str) -> Target | None:
    """The target of a MoE layer's checkpoint tensor ``suffix`` (attention and norms as in dense layers)."""
    prefix = f"layers.{layer}."
    inter = config.moe.intermediate_size if config.moe is not None else 0
    if suffix in _MOE_MAP:
        return Target(prefix + _MOE_MAP[suffix], 0, None)
    if (m := _EXPERT.match(suffix)) is not None:
        part = _EXPERT_PART[m.group(2)]
        rows = {"gate": (0, inter), "up": (inter, 2 * inter), "down": (0, None)}[part]
        return Target(prefix + ("mlp.down" if part == "down" else "mlp.gate_up"), *rows, expert=int(m.group(1)))
    if (m := _SHARED.match(suffix)) is not None:
        shared = config.moe.shared_intermediate_size if config.moe is not None else 0
        if m.group(1) == "down_proj":
            return Target(prefix + "mlp.shared.down_proj.weight", 0, None)
        start = 0 if m.group(1) == "gate_proj" else shared
        return Target(prefix + "mlp.shared.gate_up_proj.weight", start, start + shared)
    if suffix in _LAYER_MAP and not suffix.startswith("mlp."):
        module, shard = _LAYER_MAP[suffix]
        if shard is None:
            return Target(prefix + module, 0, None)
        return Target(prefix + module, *_shard_rows(config, shard))
    return None


class QuantSpec(NamedTuple):
    """How a module's weight is held: ``fmt`` ("q8_0" or a low-bit format) and whether it has offsets."""

    fmt: str
    offsets: bool


def quantized_modules(config: ModelConfig, names: Iterable[str]) -> dict[str, QuantSpec]:
    """The modules (``layers.3.self_attn.qkv_proj``, ``embed_tokens``, ``lm_head``) whose weight the
    checkpoint tensor ``names`` hold quantized, each with its format and whether it has offsets (any
    part has). Raises ModelLoadError for a module whose parts name different formats."""
    found: dict[str, QuantSpec] = {}
    for name in names:
        if (split := _quant_split(name)) is not None and (target := map_name(config, name)) is not None:
            module, _, buffer = target.param.rpartition(".")
            old = found.get(module, QuantSpec(split[2], False))
            if old.fmt != split[2]:
                raise ModelLoadError(f"checkpoint holds {module}'s parts in two formats ({old.fmt}, {split[2]}); "
                                     "a fused module takes one: convert the file again")
            found[module] = QuantSpec(old.fmt, old.offsets or buffer == "offsets")
    return found


def _put_quantized(model: LlamaForCausalLM, module: str, dtype: torch.dtype, offsets: bool, fmt: str) -> None:
    parent_name, _, child_name = module.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, child_name)
    if isinstance(old, nn.Embedding):
        new: nn.Module = QuantEmbedding(old.num_embeddings, old.embedding_dim, dtype=dtype, offsets=offsets,
                                        fmt=fmt)
    elif isinstance(old, nn.Linear):
        new = QuantLinear(old.in_features, old.out_features, bias=old.bias is not None, bias_dtype=dtype,
                          offsets=offsets, fmt=fmt)
    elif isinstance(old, nn.Parameter) and old.dim() == 3:  # a MoE layer's experts [E, out, in]
        new = QuantExperts(old.shape[0], old.shape[2], old.shape[1], offsets=offsets, fmt=fmt)
        delattr(parent, child_name)
    else:
        raise ModelLoadError(f"checkpoint holds a quantized weight for {module}, which is no linear layer, "
                             "embedding or expert weight")
    setattr(parent, child_name, new)


def build_model(config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor | LazyTensor]],
                dtype: torch.dtype = torch.float32,
                quantized: Mapping[str, QuantSpec | bool] | None = None,
                tp: TPGroup | None = None, cpu_layout: bool = False) -> LlamaForCausalLM:
    """Build the model without random init and fill every parameter from ``tensors``.

    ``quantized`` maps the modules built quantized to their :class:`QuantSpec` (:func:`quantized_modules`
    of the checkpoint's names; a bool: Q8_0 with offsets or not); offsets no tensor fills stay 0. A
    tied model whose embedding is quantized gets a head over the same tensors. Raises
    MissingTensorError naming the first missing checkpoint tensors, ModelLoadError on a shape
    mismatch. Unknown checkpoint names are reported with a warning and skipped.

    With ``tp`` of several ranks the model is this rank's shard (``models/sharding.py``) and only its
    rows or columns of each tensor are read (give :class:`~pagedkv.models.sharding.LazyTensor` entries:
    a whole tensor read first would cost the memory sharding saves). A quantized tensor split inside
    a block of 32 (a row-parallel layer whose input does not divide into whole blocks per rank) is
    dequantized for this rank, with one log line; its module is float.

    ``cpu_layout``: each float32 weight the CPU runner lays out its own way is laid out so as soon as
    its last element is read, and its first tensor freed then: the LM head packed for oneDNN
    (:func:`~pagedkv.models.packed_linear.pack_lm_head`), each layer's fused q/k/v and gate/up stored
    input-major (:func:`~pagedkv.models.packed_linear.input_major`). Done later, once every weight is
    in, two copies of the largest such tensor would sit beside all of them for a moment: that moment
    was a tensor-parallel rank's peak. (Give the head's tensor first, as the safetensors readers
    do, and its moment comes when little else is loaded.)
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp)
    model = model.to_empty(device="cpu").to(dtype)
    tp = model.tp
    quantized = dict(quantized or {})
    dequantized = _split_inside_blocks(config, quantized, tp)
    for module, spec in sorted(quantized.items()):
        spec = spec if isinstance(spec, QuantSpec) else QuantSpec("q8_0", bool(spec))
        _put_quantized(model, module, dtype, spec.offsets, spec.fmt)
    params = dict(model.named_parameters())
    params.update((f"{name}.{b}", getattr(m, b)) for name, m in model.named_modules()
                  if isinstance(m, (QuantLinear, QuantEmbedding, QuantExperts))
                  for b in ("qweight", "planes", "scales", "offsets") if getattr(m, b) is not None)
    filled: dict[str, int] = {name: 0 for name in params}  # elements written per parameter
    if tp is not None:  # zeros, and no tensor's: the vocabulary's padding rows, ranks > 0's row-parallel biases
        # (only these are zeroed: the memory of the others becomes resident as they are read)
        for name in params:
            split = param_split(config, name, tp)
            if split is not None and split.dim == 0 and name.startswith(("embed_tokens.", "lm_head.")):
                # (no local may hold the head: it is freed when it is packed)
                filled[name] += params[name].data[split.local_size:].zero_().numel()
            elif split is not None and split.rank0_only and tp.rank > 0:
                params[name].data.zero_()  # (_fill_shard counts it as filled when its tensor comes)
    head = "lm_head.weight" if getattr(model, "lm_head", None) is not None else "embed_tokens.weight"

    def note(param: str, written: int) -> None:
        """``written`` more elements of ``param`` are in; laid out for the CPU once it is whole."""
        filled[param] += written
        if not cpu_layout or filled[param] < params[param].numel():
            return
        if param == head:
            done = pack_lm_head(model) and head == "lm_head.weight"  # a tied head keeps its embedding
        elif (m := _WIDE.match(param)) is not None:
            parent, _, child = m.group(2).rpartition(".")
            done = input_major(getattr(model.layers[int(m.group(1))], parent), child)
        else:
            return
        if done:  # nothing else may hold the first tensor (no local either): it is freed now
            del params[param], filled[param]
    stash: dict[str, dict[str, torch.Tensor]] = {}  # dequantized for sharding: float weight name -> buffers
    unknown: list[str] = []
    extra_layers: set[int] = set()  # layers past num_hidden_layers: DeepSeek-V3's multi-token prediction
    for name, tensor in tensors:
        target = map_name(config, name)
        if target is None and (m := _LAYER.match(_LANGUAGE_MODEL.sub("model.", name))) is not None \
                and int(m.group(1)) >= config.num_hidden_layers:
            extra_layers.add(int(m.group(1)))
            continue
        if target is None:
            if not _IGNORED.search(name) and not _VISION.match(name) and not name.endswith("lm_head.weight"):
                unknown.append(name)
            continue
        if tp is not None and (quant := _quant_split(name)) is not None \
                and target.param.rpartition(".")[0] in dequantized:
            stash.setdefault(quant[0], {})[quant[1]] = _covering_columns(config, target, tensor, tp)
            continue
        if target.param not in params:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in this config ({target.param})")
        split = param_split(config, target.param, tp)
        if split is not None and tp is not None:
            note(target.param, _fill_shard(name, target, tensor, params[target.param].data, split, tp))
            continue
        tensor = read(tensor)
        dest = params[target.param].data
        if target.expert is not None:
            if not 0 <= target.expert < dest.shape[0]:
                raise ModelLoadError(f"checkpoint tensor {name!r} names expert {target.expert}; the config "
                                     f"has {dest.shape[0]} experts")
            dest = dest[target.expert]
        if target.row_end is not None or target.row_start:
            dest = dest[target.row_start:target.row_end]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ModelLoadError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        if config.is_gemma and target.param.endswith("norm.weight"):
            tensor = tensor.float() + 1.0  # gemma scales by (1 + w): stored as one weight
        dest.copy_(tensor)
        note(target.param, dest.numel())
    for name, buffers in stash.items():
        target = map_name(config, name)
        assert target is not None and tp is not None  # stashed above by its quantized names
        param = target.param if target.param in params else target.param.removesuffix(".weight")  # 3-D experts
        filled[param] += _fill_dequantized(config, target, buffers, params[param].data, dequantized, tp)
    missing = [p for p, n in filled.items() if n < params[p].numel() and not p.endswith(".offsets")]
    if missing:
        raise MissingTensorError(
            f"checkpoint lacks tensors for {len(missing)} parameters, e.g. {', '.join(missing[:4])} "
            f"(checkpoint names: {', '.join(_checkpoint_names(p) for p in missing[:4])})"
        )
    if extra_layers:
        logger.info("skipped the checkpoint's layers %s past num_hidden_layers=%d (multi-token-prediction "
                    "layers, num_nextn_predict_layers: not used for decoding)",
                    ", ".join(map(str, sorted(extra_layers))), config.num_hidden_layers)
    if unknown:
        warnings.warn(f"ignored {len(unknown)} unknown checkpoint tensors, e.g. {unknown[:3]}", stacklevel=2)
    tie_quantized_head(model)
    model.eval()
    return model


def _checkpoint_names(param: str) -> str:
    for ckpt, mod in _TOP_MAP.items():
        if mod == param:
            return ckpt
    m = re.match(r"^layers\.(\d+)\.(.+)$", param)
    if m:
        names = [k for k, (suffix, _) in _LAYER_MAP.items() if suffix == m.group(2)]
        return "/".join(f"model.layers.{m.group(1)}.{n}" for n in names)
    return param


def _split_inside_blocks(config: ModelConfig, quantized: dict[str, QuantSpec | bool],
                         tp: TPGroup | None) -> dict[str, QuantSpec]:
    """Take out of ``quantized`` (and return) the modules whose rank's input columns start or end
    inside a block of 32: loaded float, dequantized from the rank's covering blocks."""
    out: dict[str, QuantSpec] = {}
    for module, spec in list(quantized.items()):
        split = param_split(config, f"{module}.weight", tp)
        if split is not None and split.dim == 1 and column_bounds(split, 1 << 30) is None:
            out[module] = spec if isinstance(spec, QuantSpec) else QuantSpec("q8_0", bool(spec))
            del quantized[module]
    if out and tp is not None:
        first = param_split(config, f"{next(iter(out))}.weight", tp)
        assert first is not None  # every layer in ``out`` was found split above
        seg = first.segments[0]
        logger.info("tensor parallel rank %d of %d: %d quantized row-parallel layers split inside a block of 32 "
                    "(e.g. %s: input columns %d..%d of %d) are dequantized for this rank's shard",
                    tp.rank, tp.size, len(out), next(iter(out)), seg.rank_start, seg.rank_end, seg.end)
    return out


def _fill_shard(name: str, target: Target, src: torch.Tensor | LazyTensor, param: torch.Tensor, split: Split,
                tp: TPGroup) -> int:
    """Read the rank's part of checkpoint tensor ``name`` into ``param`` (the rank's parameter);
    returns the elements written."""
    if split.rank0_only:  # a row-parallel bias: added once, by rank 0 (the others hold zeros)
        if tp.rank == 0:
            tensor = read(src)
            if tuple(tensor.shape) != tuple(param.shape):
                raise ModelLoadError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(param.shape)}")
            param.copy_(tensor)
        return param.numel()
    lead = 0
    if target.expert is not None:
        param = param[target.expert]
    elif param.dim() == 3:  # all experts at once (transformers 5's fused 3-D tensors)
        lead = 1
    written = 0
    shape = tuple(src.shape)
    for index, dest in shard_copies(split, param, shape, target.row_start, target.row_end, lead):
        tensor = read(src, index, dest)  # straight into the rank's parameter where it can
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ModelLoadError(f"checkpoint tensor {name!r} of shape {shape}: its tensor-parallel shard "
                                 f"{tuple(tensor.shape)} does not fit {tuple(dest.shape)} (a checkpoint for "
                                 "another config?)")
        written += dest.numel()
    return written


def _cover(split: Split) -> tuple[int, int]:
    """The rank's input columns widened to whole blocks of 32."""
    seg = split.segments[0]
    return seg.rank_start - seg.rank_start % 32, seg.rank_end + (-seg.rank_end) % 32


def _covering_columns(config: ModelConfig, target: Target, src: torch.Tensor | LazyTensor,
                      tp: TPGroup) -> torch.Tensor:
    """The blocks of a quantized buffer that cover the rank's input columns (all rows)."""
    split = param_split(config, target.param, tp)
    assert split is not None
    seg, (a, b) = split.segments[0], _cover(split)
    shape = tuple(src.shape)
    cols = shape[-1]
    return read(src, (slice(None),) * (len(shape) - 1) + (slice(a * cols // seg.end, b * cols // seg.end),))


def _fill_dequantized(config: ModelConfig, target: Target, buffers: dict[str, torch.Tensor], param: torch.Tensor,
                      dequantized: dict[str, QuantSpec], tp: TPGroup) -> int:
    """Dequantize the covering blocks of one quantized weight and copy the rank's columns of it."""
    from pagedkv.models.quant_linear import dequantize_lowbit, dequantize_q8_0

    module = target.param.rpartition(".")[0]
    spec = dequantized[module]
    split = param_split(config, f"{module}.weight", tp)
    assert split is not None
    q = buffers["qweight"]
    lead = q.shape[:-1]

    def flat(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.reshape(-1, t.shape[-1])

    qf, scales = flat(q), flat(buffers["scales"])
    assert qf is not None and scales is not None
    if spec.fmt == "q8_0":
        w = dequantize_q8_0(qf, scales, flat(buffers.get("offsets")))
    else:
        w = dequantize_lowbit(qf, flat(buffers.get("planes")), scales, flat(buffers.get("offsets")), spec.fmt)
    seg, (a, _) = split.segments[0], _cover(split)
    w = w.reshape(*lead, -1)[..., seg.rank_start - a:seg.rank_end - a]
    if target.expert is not None:
        param = param[target.expert]
    if target.row_end is not None or target.row_start:
        param = param[(slice(None),) * (param.dim() - 2) + (slice(target.row_start, target.row_end),)]
    if tuple(w.shape) != tuple(param.shape):
        raise ModelLoadError(f"{module}: its dequantized shard {tuple(w.shape)} does not fit {tuple(param.shape)}")
    param.copy_(w)
    return param.numel()
