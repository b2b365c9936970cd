"""Convert a GGUF file into a cached Hugging Face-style folder, then load that folder.

Conversion (first load only) reads the metadata into a config.json, dequantizes every tensor to
float32 with ``gguf.quants.dequantize``, renames llama.cpp tensors to Hugging Face names, undoes
llama.cpp's q/k row permutation (llama architecture) and writes::

    <cache>/gguf/<key>/  config.json  model.safetensors  tokenizer.json  tokenizer_config.json

``key`` hashes (path, size, mtime, converter version), so an edited file converts again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from pagedkv.model_shape import shape_from_gguf
from pagedkv.models.cache_dir import cache_root, file_key
from pagedkv.models.config import ModelConfig, RopeConfig
from pagedkv.models.errors import ModelLoadError, UnsupportedModelError
from pagedkv.models.gguf_tokenizer import build_gguf_tokenizer

CONVERTER_VERSION = "2"
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3")  # mistral GGUFs use the llama architecture
_DONE = ".complete"

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
}
_GGUF_TO_HF_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face checkpoint name of a llama.cpp tensor name (None if it has none)."""
    if gguf_name in _GGUF_TO_HF_TOP:
        return _GGUF_TO_HF_TOP[gguf_name]
    m = _BLK.match(gguf_name)
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
    rope_type = {"none": "default", "linear": "linear"}.get(scaling)
    if rope_type is None:
        raise UnsupportedModelError(f"GGUF rope scaling type {scaling!r} is not supported")
    orig = key("rope.scaling.original_context_length")
    shape = shape_from_gguf(reader)
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
    config = ModelConfig.from_shape(shape, rope=rope,
                                    rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)))
    extra: dict[str, Any] = {}
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = {int(v) for k in ("eos_token_id", "eot_token_id", "eom_token_id")
           if (v := _field(reader, f"tokenizer.ggml.{k}")) is not None}
    if bos is not None:
        extra["bos_token_id"] = int(bos)
    if eos:
        extra["eos_token_id"] = sorted(eos)
    return config, extra


def _tensor_values(reader: Any, name: str) -> tuple[float, ...] | None:
    t = next((t for t in reader.tensors if t.name == name), None)
    if t is None:
        return None
    return tuple(float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1))


def _iter_tensors(reader: Any, config: ModelConfig, arch: str) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize

    for t in tqdm(reader.tensors, desc="pagedkv: dequantizing GGUF", unit="tensor", leave=False):
        name = hf_name(t.name, arch)
        if name is None:
            continue
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise UnsupportedModelError(f"GGUF tensor {t.name}: {e}") from e
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGML lists dims innermost first
        arr = np.asarray(arr, dtype=np.float32).reshape(shape)
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = unpermute_rows(arr, config.num_attention_heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = unpermute_rows(arr, config.num_key_value_heads)
        yield name, torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))


def convert_gguf(path: Path, out_dir: Path) -> None:
    """Write the HF-style folder for GGUF ``path`` into ``out_dir`` (created)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    names = {t.name for t in reader.tensors}
    config, extra = gguf_config(reader)
    if "rope_freqs.weight" in names:  # llama3-style scaling baked into per-frequency factors
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        factors = np.asarray(t.data, dtype=np.float32).reshape(-1)
        config = _with_freq_factors(config, tuple(float(x) for x in factors))
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = dict(_iter_tensors(reader, config, arch))
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


def converted_folder(path: Path) -> Path:
    """The cached HF-style folder for GGUF ``path``, converting it on first use (atomically)."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    folder = cache_root() / "gguf" / f"{path.stem}-{file_key(path, CONVERTER_VERSION)}"
    if (folder / _DONE).exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
    try:
        convert_gguf(path, tmp)
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


__all__ = ["converted_folder", "convert_gguf", "gguf_config", "hf_name", "unpermute_rows"]
