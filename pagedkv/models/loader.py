"""``load_model``: the one public way to get a model, its config and its tokenizer."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedkv.models.config import ModelConfig
from pagedkv.models.default_model import DEFAULT_MODEL_NAME, default_model_path
from pagedkv.models.errors import ModelLoadError
from pagedkv.models.gguf_loader import converted_folder, has_exact_quantized_matrices, tokenizer_folder
from pagedkv.models.hf_loader import load_hf_folder, load_hf_tokenizer, read_generation_defaults, read_json
from pagedkv.models.llama import LlamaForCausalLM
from pagedkv.models.quant_linear import quantize_model
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.weight_quant import check_quantization


@dataclass(slots=True)
class LoadedModel:
    """A ready model: ``model`` (eval mode), its frozen ``config``, ``tokenizer``, a display ``name``,
    the resolved ``quantization`` of its weights (:func:`resolve_quantization`) and the sampling
    defaults of its generation_config.json (``generation_defaults``, vLLM's names: temperature,
    top_p, top_k, min_p, repetition_penalty, max_tokens; a GGUF file has none: {})."""

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    name: str
    path: Path
    quantization: str = "none"
    generation_defaults: dict[str, Any] = field(default_factory=dict)


def resolve_model_path(model: str | Path | None) -> tuple[Path, str]:
    """(path, display name): None -> bundled default GGUF; a folder -> HF (or its only ``*.gguf``
    when it has no config.json); ``*.gguf`` -> GGUF; ``org/name`` that is no local path -> that
    model's snapshot in the local Hugging Face cache (never downloaded). Raises ModelLoadError for
    anything else."""
    if model is None or str(model) in ("", "default", DEFAULT_MODEL_NAME):
        return default_model_path(), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if not path.exists() and _looks_like_repo_id(str(model)):
        cached = hf_cache_snapshot(str(model))
        if cached is None:
            raise ModelLoadError(
                f"{model!r} is neither a local path nor a Hugging Face model in the local cache "
                f"({hf_hub_cache()}); pagedkv never downloads models: fetch it first, e.g. "
                f"`huggingface-cli download {model}`, or give a folder or a .gguf file")
        path = cached
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:  # a folder holding one GGUF file
            return ggufs[0], ggufs[0].stem
        return path, str(model) if path != Path(model).expanduser() else path.name
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist")
        return path, path.stem
    raise ModelLoadError(
        f"cannot load model {str(model)!r}: expected a Hugging Face model folder (config.json + "
        f"*.safetensors), a .gguf file, or None for the bundled default ({DEFAULT_MODEL_NAME}); "
        f"pagedkv never downloads models"
    )


def _looks_like_repo_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(p and not p.startswith(".") for p in parts) and not text.endswith(".gguf")


def hf_hub_cache() -> Path:
    """Where Hugging Face keeps downloaded models: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hf_cache_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    """The snapshot folder of ``repo_id`` (``org/name``) in the local Hugging Face cache at
    ``revision`` (a branch or tag named in refs/, or a commit hash), or None. No network."""
    root = hf_hub_cache() / ("models--" + repo_id.replace("/", "--"))
    ref = root / "refs" / revision
    try:
        commit = ref.read_text().strip() if ref.is_file() else revision
    except OSError:
        return None
    snapshot = root / "snapshots" / commit
    if snapshot.is_dir():
        return snapshot
    snapshots = sorted((root / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    return snapshots[-1] if snapshots and not ref.is_file() and revision == "main" else None


def resolve_quantization(requested: str, path: Path) -> str:
    """``requested`` unless it is "auto", which stays "auto" for a GGUF file with matrices in a type
    the 8-bit layout holds exactly (those kept 8-bit, the others dequantized) and is "none"
    otherwise (``pagedkv/weight_quant.py``). Raises ValueError for an unknown value."""
    if check_quantization(requested) != "auto":
        return requested
    return "auto" if path.is_file() and has_exact_quantized_matrices(path) else "none"


def load_tokenizer(source: str | Path) -> Tokenizer:
    """The tokenizer of ``source`` alone (vLLM's ``--tokenizer``): a folder with tokenizer.json (its
    tokenizer_config.json, config.json and generation_config.json give BOS, EOS and the chat
    template), a GGUF file (its vocabulary, no tensor read), a folder holding one GGUF file, or a
    Hugging Face repo id in the local cache. Raises ModelLoadError saying what was looked for."""
    path, _ = resolve_model_path(source)
    if path.is_file():
        path = tokenizer_folder(path)
    if not (path / "tokenizer.json").exists():
        raise ModelLoadError(f"--tokenizer {str(source)!r}: no tokenizer.json in {path} (give a folder with "
                             "tokenizer.json, or a .gguf file)")
    config_json = read_json(path / "config.json") if (path / "config.json").exists() else {}
    return load_hf_tokenizer(path, config_json)


def load_model(model: str | Path | None = None, dtype: torch.dtype = torch.float32,
               quantization: str = "auto", tokenizer: str | Path | None = None) -> LoadedModel:
    """Load ``model`` (see :func:`resolve_model_path`) with weights in ``dtype``, the linear ones
    in Q8_0 where ``quantization`` (:func:`resolve_quantization`) says so.

    GGUF files are converted once (dequantized to float32, or to Q8_0 tensors) into the pagedkv cache
    directory and loaded from there afterwards; a float folder asked for "q8_0" is quantized as
    it loads. ``tokenizer`` replaces the model's own (:func:`load_tokenizer`). Raises ModelLoadError
    (or a subclass) with a clear message, ValueError for an unknown ``quantization``.
    """
    check_quantization(quantization)
    path, name = resolve_model_path(model)
    chosen = load_tokenizer(tokenizer) if tokenizer is not None else None  # a bad one fails before the weights
    quant = resolve_quantization(quantization, path)
    folder = converted_folder(path, quant) if path.is_file() else path
    with torch.inference_mode(False):
        net, config, own_tokenizer = load_hf_folder(folder, dtype=dtype)
        if quant == "q8_0":
            quantize_model(net)  # float linear layers left (an HF folder); none after a GGUF conversion
    if chosen is None:
        chosen = own_tokenizer
    elif chosen.vocab_size > config.vocab_size:
        raise ModelLoadError(f"--tokenizer: its vocabulary ({chosen.vocab_size} tokens) is larger than "
                             f"the model's ({config.vocab_size}): its ids past the model's would have no "
                             "embedding; give the model's own tokenizer or one of the same family")
    defaults = read_generation_defaults(path) if path.is_dir() else {}  # GGUF: no generation config
    return LoadedModel(model=net, config=config, tokenizer=chosen, name=name, path=path, quantization=quant,
                       generation_defaults=defaults)
