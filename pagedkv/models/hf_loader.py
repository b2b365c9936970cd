"""Load a Hugging Face model folder: config.json, safetensors (single or sharded), tokenizer.json."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer

from pagedkv.distributed.group import TPGroup
from pagedkv.models.config import ModelConfig
from pagedkv.models.errors import ModelLoadError
from pagedkv.models.llama import LlamaForCausalLM
from pagedkv.models.sharding import LazyTensor
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.models.weights import build_model, quantized_modules
from pagedkv.progress import interactive, phase, quiet
from pagedkv.sampling_params import GENERATION_DEFAULT_KEYS

INDEX_FILE = "model.safetensors.index.json"
LOUD_WEIGHT_BYTES = 1 << 30  # weights from this size on are announced while they load


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of ``folder``: from the shard index when present, else ``*.safetensors``."""
    index = folder / INDEX_FILE
    if index.exists():
        weight_map = read_json(index).get("weight_map", {})
        files = sorted({folder / f for f in weight_map.values()})
        absent = [str(f) for f in files if not f.exists()]
        if absent:
            raise ModelLoadError(f"{index} names shard files that do not exist: {', '.join(absent)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {folder}")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


class SafetensorsEntry:
    """One tensor of an open safetensors file, not read yet (a ``models/sharding.LazyTensor``):
    a tensor-parallel rank reads only its rows or columns of it (``get_slice``)."""

    def __init__(self, handle: Any, name: str) -> None:
        self.handle, self.name = handle, name
        self.shape = tuple(handle.get_slice(name).get_shape())

    def read(self, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        if index is None:
            return self.handle.get_tensor(self.name)
        return self.handle.get_slice(self.name)[index]


def iter_safetensors_entries(files: list[Path]) -> Iterator[tuple[str, SafetensorsEntry]]:
    """Every tensor of ``files`` as a :class:`SafetensorsEntry` (valid while the iteration runs)."""
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, SafetensorsEntry(f, name)


def safetensors_names(files: list[Path]) -> list[str]:
    """The tensor names of ``files`` (headers only, no data read)."""
    names: list[str] = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            names.extend(f.keys())
    return names


def _token_id(tok: HFTokenizer, value: Any) -> int | None:
    if isinstance(value, dict):
        value = value.get("content")
    if isinstance(value, str):
        return tok.token_to_id(value)
    return None


def _ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {int(v) for v in value if isinstance(v, int)}
    return set()


def load_hf_tokenizer(folder: Path, config_json: dict[str, Any] | None = None) -> Tokenizer:
    """tokenizer.json + tokenizer_config.json (bos/eos, chat_template, add_bos_token)."""
    path = folder / "tokenizer.json"
    if not path.exists():
        raise ModelLoadError(f"no tokenizer.json in {folder}")
    tok = HFTokenizer.from_file(str(path))
    tcfg = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").exists() else {}
    config_json = config_json or {}
    gen = read_json(folder / "generation_config.json") if (folder / "generation_config.json").exists() else {}
    bos = _token_id(tok, tcfg.get("bos_token"))
    if bos is None:
        bos_ids = _ids(config_json.get("bos_token_id"))
        bos = min(bos_ids) if bos_ids else None
    eos: set[int] = set()
    eos_from_tcfg = _token_id(tok, tcfg.get("eos_token"))
    if eos_from_tcfg is not None:
        eos.add(eos_from_tcfg)
    eos |= _ids(config_json.get("eos_token_id")) | _ids(gen.get("eos_token_id"))
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = folder / "chat_template.jinja"
    if template is None and jinja_file.exists():
        template = jinja_file.read_text(encoding="utf-8")
    return Tokenizer(tok, bos_token_id=bos, eos_token_ids=eos, chat_template=template,
                     add_bos_token=bool(tcfg.get("add_bos_token", False)))


def read_generation_defaults(folder: Path) -> dict[str, Any]:
    """The sampling defaults of ``folder/generation_config.json`` ({} without one), values as
    written (null skipped); the engine checks them (``engine/build.py``)."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    gen = read_json(path)
    return {name: gen[key] for key, name in GENERATION_DEFAULT_KEYS.items() if gen.get(key) is not None}


def load_hf_folder(folder: Path, dtype: torch.dtype = torch.float32, tp: TPGroup | None = None
                   ) -> tuple[LlamaForCausalLM, ModelConfig, Tokenizer | None]:
    """Model, config and tokenizer (None when the folder has no tokenizer.json) of an HF folder.
    Weights the folder holds in Q8_0 (a GGUF converted with quantization "q8_0") load as Q8_0
    modules (``models/quant_linear.py``). With ``tp`` of several ranks the model is this rank's
    shard, read tensor by tensor as slices (``models/sharding.py``); the config returned is the
    whole model's (the shard's own is ``model.config``)."""
    config_path = folder / "config.json"
    if not config_path.exists():
        raise ModelLoadError(f"{folder} is not a model folder: no config.json")
    config_json = read_json(config_path)
    config = ModelConfig.from_hf_dict(config_json)
    files = safetensors_files(folder)
    names = safetensors_names(files)
    sharded = tp is not None and tp.size > 1
    tensors: Iterator[tuple[str, torch.Tensor | LazyTensor]] = (
        iter_safetensors_entries(files) if sharded else iter_safetensors(files))
    if interactive() and not quiet():  # a bar for people; nothing in log files
        from tqdm import tqdm
        tensors = tqdm(tensors, total=len(names), desc="pagedkv: loading weights", unit="tensor", leave=False)
    size = sum(f.stat().st_size for f in files)
    # Seconds per GiB read: a log says so for large weights (a server listens only afterwards).
    loading = phase(f"loading {size / (1 << 30):.1f} GiB of weights from {folder}", done="loaded",
                    ticker=False) if size >= LOUD_WEIGHT_BYTES else nullcontext()
    with loading:
        model = build_model(config, tensors, dtype=dtype, quantized=quantized_modules(config, names), tp=tp)
    tokenizer = load_hf_tokenizer(folder, config_json) if (folder / "tokenizer.json").exists() else None
    return model, config, tokenizer
