"""A PEFT LoRA folder -> ``LoRAWeights``: the low-rank pairs of each linear layer of the base model.

PEFT's layout (``save_pretrained`` of a ``LoraConfig`` model)::

    adapter_config.json          r, lora_alpha, use_rslora, target_modules, rank_pattern, ...
    adapter_model.safetensors    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight  [r, in]
                                 base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight  [out, r]

A targeted layer computes ``W x + scale * B (A x)`` with ``scale = lora_alpha / r`` (``/ sqrt(r)``
with ``use_rslora``; ``alpha_pattern`` / ``rank_pattern`` per module). The checkpoint module names
go through the base model's own name map (``models/weights.py: map_name``), so an adapter of
``q_proj`` lands on the q rows of the fused ``qkv_proj``, one of Phi-3's fused ``qkv_proj`` on all
of them. The scale is folded into B here, once.

Refused at load, naming the field: DoRA (``use_dora``), ``modules_to_save``, trained biases
(``bias``, ``lora_bias``), ``fan_in_fan_out``, embedding or LM-head targets, a rank above
``max_lora_rank``, and any tensor whose module or shape the base model does not have.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedkv.lora.request import LoRAError
from pagedkv.models.config import ModelConfig
from pagedkv.models.weights import map_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_TENSOR = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
# our module suffix -> the layer kinds it fuses, in row order (what a slot's columns hold)
FUSED_PARTS = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}


@dataclass(slots=True)
class LoRAPart:
    """One checkpoint layer's pair on rows ``row_start .. row_end-1`` of a (fused) module."""

    row_start: int
    row_end: int
    a: torch.Tensor  # [r, in] float32
    b: torch.Tensor  # [row_end - row_start, r] float32, the scale folded in


@dataclass(slots=True)
class LoRAWeights:
    """An adapter read and checked against one base model; what a slot is filled from.

    ``key`` is its identity in the prefix cache: the name plus a digest of the config and the
    weights, so a reload of changed weights under the same name never meets the old blocks."""

    name: str
    int_id: int
    path: str
    digest: str
    rank: int
    modules: dict[str, list[LoRAPart]] = field(default_factory=dict)  # "layers.3.self_attn.qkv_proj" -> parts
    stamp: tuple[float, int] = (0.0, 0)  # the weights file's (mtime, size) when read

    @property
    def key(self) -> str:
        return f"{self.name}@{self.digest[:24]}"

    @property
    def targets(self) -> list[str]:
        """The kinds of module it adapts (``q_proj``, ``down_proj``, ...), for listings."""
        return sorted({name.rsplit(".", 1)[-1] for name in self.modules})


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) features of each adaptable module of one layer, by its suffix."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return {"self_attn.qkv_proj": (q + 2 * kv, h), "self_attn.o_proj": (h, q),
            "mlp.gate_up_proj": (2 * inter, h), "mlp.down_proj": (h, inter)}


def read_adapter_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise LoRAError(f"{folder} is not a PEFT adapter folder: it has no {CONFIG_FILE}")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{path}: unreadable JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{path}: expected a JSON object")
    return cfg


def check_adapter_config(cfg: dict[str, Any], where: str) -> None:
    """LoRAError naming the first field pagedkv cannot apply."""
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"{where}: peft_type {cfg.get('peft_type')!r} is not supported (LORA only)")
    refused = [("use_dora", "DoRA adapters are not supported"),
               ("modules_to_save", "fully trained modules (modules_to_save) are not supported"),
               ("lora_bias", "trained LoRA biases (lora_bias) are not supported"),
               ("fan_in_fan_out", "fan_in_fan_out (Conv1D layouts) is not supported"),
               ("layer_replication", "layer_replication is not supported"),
               ("trainable_token_indices", "trained token embeddings (trainable_token_indices) are not supported")]
    for key, why in refused:
        if cfg.get(key):
            raise LoRAError(f"{where}: {key} = {cfg[key]!r}: {why}")
    if cfg.get("bias", "none") not in ("none", None):
        raise LoRAError(f"{where}: bias = {cfg['bias']!r}: trained base-model biases are not supported "
                        "(bias must be 'none')")
    for key in ("r", "lora_alpha"):
        value = cfg.get(key, 8)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise LoRAError(f"{where}: {key} must be a number > 0, got {value!r}")
    targets = cfg.get("target_modules") or []
    names = [targets] if isinstance(targets, str) else list(targets)
    for t in names:
        if any(bad in str(t) for bad in ("embed_tokens", "lm_head", "wte", "embed_out")):
            raise LoRAError(f"{where}: target_modules includes {t!r}: embedding and LM-head adapters are not supported")


def _pattern_value(pattern: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the first key naming ``module``'s tail
    (or, starting with ``^``, matching its whole name)."""
    for key, value in (pattern or {}).items():
        if (re.match(key, module) if key.startswith("^") else re.match(rf"(.*\.)?{key}$", module)):
            return value
    return default


def digest_files(folder: Path) -> str:
    """SHA-256 over the config and the weights file: the adapter's identity (with its name)."""
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        h.update(name.encode() + b"\x00")
        with open(folder / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def weights_stamp(path: str) -> tuple[float, int]:
    """(mtime, size) of an adapter folder's weights file ((0, 0) if absent): a changed folder is re-read."""
    try:
        st = (Path(path).expanduser() / WEIGHTS_FILE).stat()
    except OSError:
        return (0.0, 0)
    return (st.st_mtime, st.st_size)


def load_adapter(name: str, int_id: int, path: str, config: ModelConfig, *, max_rank: int) -> LoRAWeights:
    """Read and check a PEFT adapter folder for the base model ``config``; raises LoRAError."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise LoRAError(f"adapter {name!r}: lora_path {path!r} is not a folder")
    cfg = read_adapter_config(folder)
    where = f"adapter {name!r} ({folder / CONFIG_FILE})"
    if config.num_experts:
        raise LoRAError(f"adapter {name!r}: adapters on mixture-of-experts models are not supported yet")
    check_adapter_config(cfg, where)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        found = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
        raise LoRAError(f"adapter {name!r}: {folder} has no {WEIGHTS_FILE} (found: {found}); save the adapter "
                        f"with safe_serialization=True")
    from safetensors.torch import load_file

    stamp = weights_stamp(str(folder))
    try:
        tensors = load_file(str(weights_path))
    except Exception as exc:  # noqa: BLE001 - a damaged file: say which
        raise LoRAError(f"adapter {name!r}: {weights_path} is unreadable: {exc}") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for tname, tensor in tensors.items():
        if "lora_embedding" in tname or "lora_magnitude" in tname:
            raise LoRAError(f"adapter {name!r}: tensor {tname!r}: embedding adapters and DoRA are not supported")
        m = _TENSOR.match(tname)
        if m is None:
            raise LoRAError(f"adapter {name!r}: tensor {tname!r} is no LoRA A/B weight (modules_to_save or "
                            f"biases are not supported)")
        pairs.setdefault(m.group("module"), {})[m.group("ab")] = tensor
    shapes = linear_shapes(config)
    alpha_default = cfg.get("lora_alpha", 8)  # the rank is the tensors' own (rank_pattern built them)
    rslora = bool(cfg.get("use_rslora", False))
    out = LoRAWeights(name, int_id, str(folder), digest_files(folder), 0, stamp=stamp)
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: module {module!r} has lora_{''.join(ab)} without its pair")
        plain = module.removeprefix(_PREFIX)
        if any(x in plain for x in ("embed_tokens", "lm_head")):
            raise LoRAError(f"adapter {name!r}: target_modules includes {plain!r}: embedding and LM-head "
                            f"adapters are not supported")
        target = map_name(config, plain + ".weight")
        suffix = target.param.split(".", 2)[-1].removesuffix(".weight") if target else ""
        if target is None or suffix not in shapes:
            raise LoRAError(f"adapter {name!r}: target module {plain!r} does not exist in the base model "
                            f"(model_type {config.model_type}, {config.num_hidden_layers} layers)")
        a, b = ab["A"].float(), ab["B"].float()
        rank = a.shape[0]
        rows, cols = shapes[suffix]
        start, end = (target.row_start, target.row_end) if target.row_end is not None else (0, rows)
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != cols or b.shape != (end - start, rank):
            raise LoRAError(f"adapter {name!r}: {plain} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                            f"the base model needs [r, {cols}] and [{end - start}, r]: the adapter was trained "
                            f"for another model")
        if rank > max_rank:
            raise LoRAError(f"adapter {name!r}: rank {rank} ({plain}) is above max_lora_rank {max_rank}; "
                            f"start the engine with a larger max_lora_rank")
        alpha = _pattern_value(cfg.get("alpha_pattern") or {}, plain, alpha_default)
        scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        module_name = target.param.removesuffix(".weight")
        out.modules.setdefault(module_name, []).append(LoRAPart(start, end, a.contiguous(), (b * scale).contiguous()))
        out.rank = max(out.rank, rank)
    if not out.modules:
        raise LoRAError(f"adapter {name!r}: {weights_path} holds no LoRA weights")
    return out
