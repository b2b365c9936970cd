"""Convert a GGUF file into a cached Hugging Face-style folder, then load that folder.

Conversion (first load only) reads the metadata into a config.json, renames llama.cpp tensors to
Hugging Face names, undoes llama.cpp's q/k row permutation (llama architecture) and the 1 it adds to
every gemma3 norm weight (the model adds it back: ``models/weights.py``), and writes::

    <cache>/gguf/<stem>-<quantization>-<key>/  config.json  model.safetensors  tokenizer.json  tokenizer_config.json

With quantization "none" every tensor is dequantized to float32 (``gguf.quants.dequantize``). The
matrices (linear weights, LM head, embedding) can be written in pagedkv's 8-bit layout instead: int8
values, float32 scales and, for types with a minimum, float32 offsets per 32 values
(``models/weights.py`` names them). The types in ``gguf_quants.EXACT_TYPES`` (Q8_0, Q4_0, Q5_0, Q4_1,
Q5_1, Q4_K, Q5_K) go there bit for bit. "auto" keeps the 4-, 5- and 6-bit types (Q4_0, Q4_1, Q4_K,
IQ4_NL, Q5_0, Q5_1, Q5_K, Q6_K) at their own width instead (``gguf_quants.unpack_lowbit``; names
in ``models/weights.py``), Q8_0 in the 8-bit layout, and dequantizes every other matrix (Q2_K,
Q3_K, other IQ types, floats), so its values are the file's, as "none"'s; a fused module (q/k/v,
gate/up) takes one layout holding all its parts (:func:`module_layout`), else is dequantized.
"q8_0" writes every matrix in the 8-bit layout,
requantizing the others (absmax / 127 per 32, lossy). The rest is float32. ``key`` hashes (path,
size, mtime, converter version, quantization), so an edited file converts again and the choices
never share a folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from pagedkv.model_shape import ModelShape, shape_from_gguf
from pagedkv.models.config import ModelConfig, MoEConfig, RopeConfig
from pagedkv.models.errors import ModelLoadError, UnsupportedModelError
from pagedkv.models.gguf_file import check_model_metadata, open_gguf
from pagedkv.models.gguf_quants import EXACT_TYPES, LOWBIT_TYPES, as_unsigned, unpack, unpack_lowbit
from pagedkv.models.gguf_tokenizer import build_gguf_tokenizer
from pagedkv.models.quant_linear import quantize_q8_0
from pagedkv.models.weights import map_name
from pagedkv.paths import cache_root, file_key
from pagedkv.progress import phase
from pagedkv.weight_quant import Q8_0_GROUP, check_quantization

CONVERTER_VERSION = "6"
# mistral and Mixtral GGUFs use the llama architecture (Mixtral with ffn_*_exps)
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3", "qwen2moe", "qwen3moe", "deepseek2")
_DONE = ".complete"

# Parts llama.cpp stores apart that one checkpoint tensor holds (joined by _join_parts): the experts'
# gate and up ([E, I, hidden] each -> transformers 5's [E, 2I, hidden] gate_up_proj) and MLA's
# K and V up-projections (attn_k_b [H, rank, nope], attn_v_b [H, v, rank] -> kv_b_proj [H * (nope + v), rank]).
_EXPERTS_GATE, _EXPERTS_UP, _EXPERTS_DOWN = "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj"
_K_B, _V_B = "self_attn.k_b_proj", "self_attn.v_b_proj"
_GGUF_TO_HF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # mixture-of-experts layers (models/moe.py): the router, DeepSeek-V3's correction bias, shared
    # experts, Qwen2-MoE's shared-expert gate; the 3-D experts are joined by _join_parts
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_exps.weight": _EXPERTS_GATE,
    "ffn_up_exps.weight": _EXPERTS_UP,
    "ffn_down_exps.weight": _EXPERTS_DOWN,
    # MLA (deepseek2, models/mla.py): attn_k_b / attn_v_b (llama.cpp's split kv_b) are joined by _join_parts
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_k_b.weight": _K_B,
    "attn_v_b.weight": _V_B,
}
_GGUF_TO_HF_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Gemma's sandwich norms: its ffn_norm is the norm before the MLP, not the one after the attention.
_GGUF_TO_HF_GEMMA3_LAYER = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
# llama.cpp's hardcoded Gemma 3 values for what its GGUFs may leave out: the sliding layers' RoPE base,
# and the layer count of the 27B, whose attention scale is 1/sqrt(hidden / heads) instead of 1/sqrt(head_dim).
GEMMA3_LOCAL_ROPE_THETA = 10000.0
_GEMMA3_27B_LAYERS = 62


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face checkpoint name of a llama.cpp tensor name (None if it has none)."""
    if gguf_name in _GGUF_TO_HF_TOP:
        return _GGUF_TO_HF_TOP[gguf_name]
    m = _BLK.match(gguf_name)
    if m and arch == "gemma3" and m.group(2) in _GGUF_TO_HF_GEMMA3_LAYER:
        return f"model.layers.{m.group(1)}.{_GGUF_TO_HF_GEMMA3_LAYER[m.group(2)]}"
    if m and m.group(2) in _GGUF_TO_HF_LAYER:
        suffix = _GGUF_TO_HF_LAYER[m.group(2)]
        if arch == "phi3" and m.group(2) == "ffn_up.weight":  # phi3's ffn_up holds gate and up, fused
            suffix = "mlp.gate_up_proj.weight"
        return f"model.layers.{m.group(1)}.{suffix}"
    return None


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's ``reshape(n_head, 2, d//2, ...).swapaxes(1, 2)`` row permutation of q/k."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader: Any) -> tuple[ModelConfig, dict[str, Any]]:
    """ModelConfig plus extra config.json keys (token ids) from GGUF metadata: the shape through
    :func:`~pagedkv.model_shape.shape_from_gguf`, then RMSNorm epsilon and RoPE."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})"
        )

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    scaling = key("rope.scaling.type", "none")
    rope_type = {"none": "default", "linear": "linear", "yarn": "yarn"}.get(scaling)
    if rope_type is None:
        raise UnsupportedModelError(f"GGUF rope scaling type {scaling!r} is not supported")
    orig = key("rope.scaling.original_context_length")
    shape = shape_from_gguf(reader)
    if nextn := int(key("nextn_predict_layers", 0) or 0):  # multi-token-prediction layers at the end
        shape = replace(shape, num_hidden_layers=shape.num_hidden_layers - nextn)
    rope_dim = key("rope.dimension_count")
    long_factor, short_factor = _tensor_values(reader, "rope_factors_long.weight"), \
        _tensor_values(reader, "rope_factors_short.weight")
    attn_factor = key("rope.scaling.attn_factor")
    if long_factor is not None and short_factor is not None:  # phi3's LongRoPE
        rope_type = "longrope"
        orig = orig or shape.max_position_embeddings
    rope = RopeConfig(
        theta=float(key("rope.freq_base", 10000.0)),
        rope_type=rope_type,
        factor=(shape.max_position_embeddings / int(orig) if rope_type == "longrope"
                else float(key("rope.scaling.factor", 1.0) or 1.0) if rope_type != "default" else 1.0),
        original_max_position_embeddings=int(orig) if orig else None,
        short_factor=short_factor if rope_type == "longrope" else None,
        long_factor=long_factor if rope_type == "longrope" else None,
        attention_factor=float(attn_factor) if attn_factor is not None and rope_type == "longrope" else None,
        partial_rotary_factor=int(rope_dim) / shape.head_dim if rope_dim and arch == "phi3" else 1.0,
    )
    if rope_type == "yarn":
        rope = replace(rope, **_yarn_fields(key, deepseek=shape.is_mla))
    extra: dict[str, Any] = _gemma3_fields(shape, key) if arch == "gemma3" else {}
    if shape.num_experts:
        extra["moe"] = gguf_moe(reader, shape, key)
    if shape.is_mla:
        extra["rope_interleave"] = True  # llama.cpp's deepseek2 rotates adjacent pairs (its NORM RoPE)
    config = ModelConfig.from_shape(shape, rope=rope,
                                    rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)), **extra)
    return config, _special_token_ids(reader)


def _yarn_fields(key: Callable[..., Any], deepseek: bool) -> dict[str, Any]:
    """RopeConfig's YaRN fields from GGUF metadata. DeepSeek's mscale: llama.cpp stores
    ``yarn_log_multiplier`` = 0.1 * ``mscale_all_dim`` and not ``mscale``, which the released
    configs set equal to it (cos/sin then unscaled); other models' cos/sin factor is
    ``yarn_attn_factor`` when present, else YaRN's default."""
    fields: dict[str, Any] = {}
    for name, gguf_key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
        if (value := key(f"rope.scaling.{gguf_key}")) is not None:
            fields[name] = float(value)
    log_mul = key("rope.scaling.yarn_log_multiplier")
    if deepseek and log_mul:
        fields["mscale"] = fields["mscale_all_dim"] = float(log_mul) / 0.1
    elif (attn := key("rope.scaling.yarn_attn_factor")) is not None:
        fields["attention_factor"] = float(attn)
    return fields


# llama.cpp's expert_gating_func values (LLAMA_EXPERT_GATING_FUNC_TYPE_*) -> MoEConfig.scoring
_GATING = {1: "softmax", 2: "sigmoid"}


def gguf_moe(reader: Any, shape: ModelShape, key: Callable[..., Any]) -> MoEConfig:
    """The routing of a GGUF's mixture-of-experts layers, read as llama.cpp reads it.

    Sparse layers: those with a router (``blk.N.ffn_gate_inp``). Scoring: ``expert_gating_func``;
    absent, sigmoid when the file has DeepSeek-V3's correction bias (``exp_probs_b``), else softmax.
    Groups (``expert_group_count`` / ``expert_group_used_count``) ranked by the sum of their two best
    biased scores with a bias (V3), else by their best score (V2). Renormalized top-k weights:
    ``expert_weights_norm``; absent, llama.cpp's per-architecture choice (Mixtral and Qwen3-MoE yes,
    Qwen2-MoE and DeepSeek no). Shared experts: ``expert_shared_feed_forward_length`` (Qwen2-MoE,
    gated by ``ffn_gate_inp_shexp``) or ``expert_shared_count`` experts (DeepSeek)."""
    names = {t.name for t in reader.tensors}
    bias = any(n.endswith("exp_probs_b.bias") for n in names)
    gating = key("expert_gating_func")
    if gating is not None and int(gating) not in _GATING:
        raise UnsupportedModelError(f"GGUF {shape.model_type}: expert_gating_func {int(gating)} is not supported "
                                    f"(supported: {', '.join(f'{k} ({v})' for k, v in _GATING.items())})")
    scoring = _GATING[int(gating)] if gating is not None else "sigmoid" if bias else "softmax"
    norm = key("expert_weights_norm")
    n_group = int(key("expert_group_count", 1) or 1)
    shared = int(key("expert_shared_feed_forward_length", 0) or 0) \
        or shape.num_shared_experts * shape.moe_intermediate_size
    return MoEConfig(
        num_experts=shape.num_experts, top_k=int(key("expert_used_count", 2)),
        intermediate_size=shape.moe_intermediate_size,
        sparse_layers=frozenset(i for i in range(shape.num_hidden_layers) if f"blk.{i}.ffn_gate_inp.weight" in names),
        scoring=scoring,
        norm_topk_prob=bool(norm) if norm is not None else shape.model_type in ("mixtral", "qwen3_moe"),
        routed_scaling_factor=float(key("expert_weights_scale", 1.0) or 1.0),
        n_group=n_group, topk_group=int(key("expert_group_used_count", n_group) or n_group),
        group_score="top2_sum" if bias else "max", correction_bias=bias,
        shared_intermediate_size=shared, shared_gate=any(n.endswith("ffn_gate_inp_shexp.weight") for n in names),
        router_float32=shape.model_type in ("deepseek_v2", "deepseek_v3"),  # as transformers' DeepSeek
    )


def _special_token_ids(reader: Any) -> dict[str, Any]:
    """config.json's ``bos_token_id`` and ``eos_token_id`` (EOS, EOT and EOM) from GGUF metadata."""
    extra: dict[str, Any] = {}
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = {int(v) for k in ("eos_token_id", "eot_token_id", "eom_token_id")
           if (v := _field(reader, f"tokenizer.ggml.{k}")) is not None}
    if bos is not None:
        extra["bos_token_id"] = int(bos)
    if eos:
        extra["eos_token_id"] = sorted(eos)
    return extra


def _gemma3_fields(shape: ModelShape, key: Callable[..., Any]) -> dict[str, Any]:
    """Gemma 3's own ModelConfig fields, as llama.cpp reads them: the sliding layers' unscaled RoPE
    (``rope.freq_base_swa``, else llama.cpp's 10000), GELU (tanh), the attention scale llama.cpp derives
    (query_pre_attn_scalar is not stored: hidden / heads for the 27B, else head_dim) and the final
    logit soft-cap when the file has one."""
    softcap = key("final_logit_softcapping")
    scalar = (shape.hidden_size // shape.num_attention_heads if shape.num_hidden_layers == _GEMMA3_27B_LAYERS
              else shape.head_dim)
    return dict(rope_local=RopeConfig(theta=float(key("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA))),
                hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=float(scalar),
                final_logit_softcapping=float(softcap) if softcap else None)


def _tensor_values(reader: Any, name: str) -> tuple[float, ...] | None:
    t = next((t for t in reader.tensors if t.name == name), None)
    if t is None:
        return None
    return tuple(float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1))


def _is_matrix(name: str) -> bool:
    """Whether HF tensor ``name`` is a linear layer's weight, the LM head or the embedding."""
    return name.endswith("_proj.weight") or name in ("lm_head.weight", "model.embed_tokens.weight")


def _is_experts(name: str) -> bool:
    """Whether HF tensor ``name`` is a MoE layer's 3-D experts (``ffn_{gate,up,down}_exps``)."""
    return name.endswith((_EXPERTS_GATE, _EXPERTS_UP, _EXPERTS_DOWN))


def _float32(t: Any) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
    except NotImplementedError as e:
        raise UnsupportedModelError(f"GGUF tensor {t.name}: {e}") from e


def _q8_0(t: Any, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(int8 ``[rows, cols]``, float32 scales ``[rows, cols / 32]``, float32 offsets ``[rows, cols / 32]``
    or None) of GGUF tensor ``t``: its own blocks for an exact type, else requantized (no offsets)."""
    if t.tensor_type.name in EXACT_TYPES:
        q, scales, offsets = unpack(np.asarray(t.data), t.tensor_type.name)
        groups = (rows, cols // Q8_0_GROUP)
        return q.reshape(rows, cols), scales.reshape(groups), None if offsets is None else offsets.reshape(groups)
    qt, dt = quantize_q8_0(torch.from_numpy(np.require(_float32(t).reshape(rows, cols), requirements="W")))
    return qt.numpy(), dt.numpy(), None


def module_layout(types: list[str]) -> str | None:
    """The layout that holds a module whose parts have GGUF ``types`` exactly under "auto": the
    low-bit format of them all (Q4_0 beside Q4_1 / Q4_K is u4, Q5_0 beside Q5_1 / Q5_K u5: their
    zero becomes an offset), else "q8_0" where all are exact in the 8-bit layout, else None (float)."""
    if all(t in LOWBIT_TYPES for t in types):
        fmts = {LOWBIT_TYPES[t] for t in types}
        if len(fmts) == 1:
            return fmts.pop()
        for signed, unsigned in (("i4", "u4"), ("i5", "u5")):
            if fmts <= {signed, unsigned}:
                return unsigned
    if all(t in EXACT_TYPES for t in types):
        return "q8_0"
    return None


def _lowbit(t: Any, rows: int, fmt: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None]:
    """(nibbles ``[rows, cols / 2]``, planes or None, scales, offsets or None) of GGUF tensor ``t``
    in low-bit format ``fmt``, rows first."""
    lb = unpack_lowbit(np.asarray(t.data), t.tensor_type.name)
    if lb.format.name != fmt:
        lb = as_unsigned(lb)
    assert lb.format.name == fmt, (t.name, lb.format.name, fmt)  # module_layout chose a joinable format

    def rowwise(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a.reshape(rows, -1)
    nibbles, scales = rowwise(lb.nibbles), rowwise(lb.scales)
    assert nibbles is not None and scales is not None
    return nibbles, rowwise(lb.planes), scales, rowwise(lb.offsets)


def _kept_quantized(reader: Any, config: ModelConfig, arch: str, quantization: str) -> dict[str, str]:
    """GGUF name -> layout ("q8_0" or a low-bit format) of the matrices kept quantized (the module
    docstring): every one whose input is a multiple of 32 in "q8_0" for "q8_0"; for "auto" those
    of the modules (a fused q/k/v or gate/up counts as one) with a :func:`module_layout`; none for "none"."""
    if quantization == "none":
        return {}
    modules: dict[str, list[Any]] = {}
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        experts = name is not None and _is_experts(name)
        if name is None or not (experts or _is_matrix(name)) or len(t.shape) != (3 if experts else 2) \
                or int(t.shape[0]) % Q8_0_GROUP:
            continue  # GGML lists dims innermost first: shape[0] is the input
        if experts:  # gate and up experts are one module (joined by _join_parts), as q/k/v are
            modules.setdefault(name.replace(_EXPERTS_UP, _EXPERTS_GATE), []).append(t)
            continue
        target = map_name(config, name)
        if target is not None and not target.param.endswith(".weight"):
            continue  # a bare Parameter (MLA's kv_b): no quantized layout
        modules.setdefault(name if target is None else target.param, []).append(t)
    kept: dict[str, str] = {}
    for parts in modules.values():
        layout = "q8_0" if quantization == "q8_0" else module_layout([t.tensor_type.name for t in parts])
        if layout is not None:
            kept.update((t.name, layout) for t in parts)
    return kept


def _join_parts(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` with the parts llama.cpp stores apart joined into their checkpoint tensor: the
    experts' gate and up into ``mlp.experts.gate_up_proj`` (each quantized buffer of them too:
    ``gate_proj.weight_q8_0`` and ``up_proj.weight_q8_0`` into ``gate_up_proj.weight_q8_0``; an
    8-bit part without offsets beside one with gets zero offsets), MLA's attn_k_b (K transposed) and
    attn_v_b into ``kv_b_proj.weight``. Raises ModelLoadError for a part whose partner is missing."""
    pairs = ((_EXPERTS_GATE, _EXPERTS_UP, "mlp.experts.gate_up_proj"), (_K_B, _V_B, "self_attn.kv_b_proj.weight"))
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        base, sep, quant = name.partition(".weight_")  # a quantized part: its weight's name, then the buffer
        pair = next((p for p in pairs if base.endswith(p[:2])), None)
        if pair is None:
            yield name, tensor
            continue
        first, second, joined = pair
        layer, tail = base.removesuffix(first if base.endswith(first) else second), sep + quant
        pending[name] = tensor
        if layer + first + tail not in pending or layer + second + tail not in pending:
            continue
        a, b = pending.pop(layer + first + tail), pending.pop(layer + second + tail)
        if first == _K_B:  # [H, rank, nope] -> [H, nope, rank], then V's rows [H, v, rank] after each head's
            a = a.transpose(1, 2)
            yield layer + joined, torch.cat((a, b), dim=1).reshape(-1, a.shape[-1]).contiguous()
        else:
            yield layer + joined + tail, torch.cat((a, b), dim=1).contiguous()
    for name in [n for n in pending if n.endswith("_q8_0_offsets")]:  # the partner's rows: offsets 0
        base = name.partition(".weight_")[0]
        own = pending.pop(name)
        parts = (own, torch.zeros_like(own)) if base.endswith(_EXPERTS_GATE) else (torch.zeros_like(own), own)
        layer = base.removesuffix(_EXPERTS_GATE).removesuffix(_EXPERTS_UP)
        yield layer + "mlp.experts.gate_up_proj.weight_q8_0_offsets", torch.cat(parts, dim=1)
    if pending:
        raise ModelLoadError(f"GGUF tensor for {sorted(pending)[0]!r} has no partner (llama.cpp stores gate/up "
                             "experts and attn_k_b/attn_v_b in pairs): the file is incomplete; convert it again")


def _iter_tensors(reader: Any, config: ModelConfig, arch: str, quantization: str = "none"
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    return _join_parts(_iter_gguf_tensors(reader, config, arch, quantization))


def _iter_gguf_tensors(reader: Any, config: ModelConfig, arch: str, quantization: str = "none"
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    kept = _kept_quantized(reader, config, arch, quantization)
    for t in tqdm(reader.tensors, desc="pagedkv: converting GGUF", unit="tensor", leave=False):
        name = hf_name(t.name, arch)
        if name is None:
            continue
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGML lists dims innermost first
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            heads: int | None = config.num_attention_heads
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            heads = config.num_key_value_heads
        else:
            heads = None
        # experts [E, out, in] are quantized as E * out rows and named as a weight ("...down_proj.weight_q8_0")
        rows, lead, qname = int(np.prod(shape[:-1])), shape[:-1], name + ".weight" if _is_experts(name) else name
        if kept.get(t.name, "q8_0") != "q8_0":
            fmt = kept[t.name]
            for suffix, arr in zip(("", "_planes", "_scales", "_offsets"), _lowbit(t, rows, fmt)):
                if arr is not None:
                    arr = arr.reshape(*lead, -1) if heads is None else unpermute_rows(arr, heads)
                    yield f"{qname}_lb_{fmt}{suffix}", torch.from_numpy(np.ascontiguousarray(arr))
            continue
        if t.name in kept:
            for suffix, arr in zip(("_q8_0", "_q8_0_scales", "_q8_0_offsets"), _q8_0(t, rows, shape[-1])):
                if arr is not None:
                    arr = arr.reshape(*lead, -1) if heads is None else unpermute_rows(arr, heads)
                    yield qname + suffix, torch.from_numpy(np.ascontiguousarray(arr))
            continue
        arr = _float32(t).reshape(shape)
        if heads is not None:
            arr = unpermute_rows(arr, heads)
        yield name, torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))


def has_exact_quantized_matrices(path: Path) -> bool:
    """Whether GGUF ``path`` holds any matrix (linear weight, LM head, embedding) in a type the 8-bit
    layout keeps exactly (``gguf_quants.EXACT_TYPES``), i.e. whether "auto" keeps any quantized.

    Reading a GGUF's header takes seconds (its vocabulary), so the answer is remembered in the
    cache, keyed by the file's (path, size, mtime)."""
    stamp = cache_root() / "gguf" / f"{path.stem}-{file_key(path, 'matrix-types-3')}.json"
    try:
        return bool(json.loads(stamp.read_text())["exact_quantized"])
    except (OSError, ValueError, KeyError):
        pass
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    types = {t.tensor_type.name for t in reader.tensors if (name := hf_name(t.name, arch)) is not None
             and (_is_matrix(name) or _is_experts(name))}
    answer = bool(types & (EXACT_TYPES | set(LOWBIT_TYPES)))
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(json.dumps({"path": str(path), "matrix_types": sorted(types), "exact_quantized": answer}))
    except OSError:
        pass  # a read-only cache only costs a reread next time
    return answer


def convert_gguf(path: Path, out_dir: Path, quantization: str = "none", reader: Any = None) -> None:
    """Write the HF-style folder for GGUF ``path`` (or its opened ``reader``) into ``out_dir``
    (created); ``quantization`` is "none", "auto" or "q8_0" (the module docstring)."""
    reader = reader if reader is not None else open_gguf(path)
    arch = check_model_metadata(reader, path)
    names = {t.name for t in reader.tensors}
    config, extra = gguf_config(reader)
    if "rope_freqs.weight" in names:  # llama3-style scaling baked into per-frequency factors
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        factors = np.asarray(t.data, dtype=np.float32).reshape(-1)
        config = _with_freq_factors(config, tuple(float(x) for x in factors))
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = dict(_iter_tensors(reader, config, arch, quantization))
    if arch == "gemma3":  # llama.cpp stores gemma's (1 + w) norm weights as one weight
        tensors.update({name: t - 1.0 for name, t in tensors.items() if name.endswith("norm.weight")})
    save_file(tensors, str(out_dir / "model.safetensors"))
    config_json = {**config.to_hf_dict(), **extra}
    (out_dir / "config.json").write_text(json.dumps(config_json, indent=2))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if tokens:
        _write_tokenizer(reader, out_dir, tokens, extra)


def _with_freq_factors(config: ModelConfig, factors: tuple[float, ...]) -> ModelConfig:
    return replace(config, rope=replace(config.rope, freq_factors=factors))


def _write_tokenizer(reader: Any, out_dir: Path, tokens: list[str], extra: dict[str, Any]) -> None:
    """tokenizer.json and tokenizer_config.json of the GGUF vocabulary.

    A SentencePiece ('llama') vocabulary whose file does not say otherwise gets BOS, as llama.cpp and
    transformers both add it there; the saved tokenizer.json adds it (and EOS when asked) itself.
    """
    model = str(_field(reader, "tokenizer.ggml.model", "gpt2"))
    bos = extra.get("bos_token_id")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", model == "llama"))
    tok = build_gguf_tokenizer(
        model=model,
        pre=str(_field(reader, "tokenizer.ggml.pre", "default")),
        tokens=tokens,
        token_types=_field(reader, "tokenizer.ggml.token_type"),
        merges=_field(reader, "tokenizer.ggml.merges"),
        bos_token_id=bos,
        add_bos_token=add_bos,
        architecture=str(_field(reader, "general.architecture")),
        scores=_field(reader, "tokenizer.ggml.scores"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        unk_token_id=_field(reader, "tokenizer.ggml.unknown_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
        add_eos_token=bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
    )
    tok.save(str(out_dir / "tokenizer.json"))
    eos = extra.get("eos_token_id", [])
    tcfg: dict[str, Any] = {
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos[0]] if eos else None,
        "add_bos_token": add_bos,
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2))


def tokenizer_folder(path: Path) -> Path:
    """The cached folder holding only the tokenizer (tokenizer.json, tokenizer_config.json and the
    token ids in config.json) of GGUF ``path``, for ``--tokenizer FILE.gguf``: no tensor is read."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    folder = cache_root() / "gguf-tokenizer" / f"{path.stem}-{file_key(path, CONVERTER_VERSION)}"
    if (folder / _DONE).exists():
        return folder
    reader = open_gguf(path)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"GGUF file {path} holds no tokenizer (no tokenizer.ggml.tokens)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    try:
        extra = _special_token_ids(reader)
        _write_tokenizer(reader, tmp, tokens, extra)
        (tmp / "config.json").write_text(json.dumps(extra))
        (tmp / _DONE).write_text(str(path))
        shutil.rmtree(folder, ignore_errors=True)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished first
            pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def converted_folder(path: Path, quantization: str = "none") -> Path:
    """The cached HF-style folder for GGUF ``path`` with its matrices dequantized ("none"), in the
    8-bit layout where exact, else dequantized ("auto"), or all in the 8-bit layout ("q8_0"),
    converting it on first use (atomically). Raises ValueError for another ``quantization``."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    check_quantization(quantization)
    key = file_key(path, f"{CONVERTER_VERSION}|{quantization}")
    folder = cache_root() / "gguf" / f"{path.stem}-{quantization}-{key}"
    if (folder / _DONE).exists():
        return folder
    reader = open_gguf(path)  # a damaged file is refused before the conversion is announced
    check_model_metadata(reader, path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    try:
        with phase(f"converting {path.name} once into {folder} (later starts load the converted copy)",
                   done="converted", ticker=False):  # a bar of its own
            convert_gguf(path, tmp, quantization, reader)
        (tmp / _DONE).write_text(str(path))
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished first
            if not (folder / _DONE).exists():
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


__all__ = ["converted_folder", "convert_gguf", "gguf_config", "has_exact_quantized_matrices", "hf_name",
           "module_layout", "tokenizer_folder", "unpermute_rows"]
