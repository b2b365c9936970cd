"""``load_model``: the one public way to get a model, its config and its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pagedkv.models.config import ModelConfig
from pagedkv.models.default_model import DEFAULT_MODEL_NAME, default_model_path
from pagedkv.models.errors import ModelLoadError
from pagedkv.models.gguf_loader import converted_folder
from pagedkv.models.hf_loader import load_hf_folder
from pagedkv.models.llama import LlamaForCausalLM
from pagedkv.models.tokenizer import Tokenizer


@dataclass(slots=True)
class LoadedModel:
    """A ready model: ``model`` (eval mode), its frozen ``config``, ``tokenizer`` and a display ``name``."""

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    name: str
    path: Path


def resolve_model_path(model: str | Path | None) -> tuple[Path, str]:
    """(path, display name): None -> bundled default GGUF; a folder -> HF (or its only ``*.gguf``
    when it has no config.json); ``*.gguf`` -> GGUF. Raises ModelLoadError for anything else."""
    if model is None or str(model) in ("", "default", DEFAULT_MODEL_NAME):
        return default_model_path(), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:  # a folder holding one GGUF file
            return ggufs[0], ggufs[0].stem
        return path, path.name
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist")
        return path, path.stem
    raise ModelLoadError(
        f"cannot load model {str(model)!r}: expected a Hugging Face model folder (config.json + "
        f"*.safetensors), a .gguf file, or None for the bundled default ({DEFAULT_MODEL_NAME}); "
        f"pagedkv never downloads models"
    )


def load_model(model: str | Path | None = None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load ``model`` (see :func:`resolve_model_path`) with weights in ``dtype``.

    GGUF files are converted once (dequantized to float32) into the pagedkv cache directory and
    loaded from there afterwards. Raises ModelLoadError (or a subclass) with a clear message.
    """
    path, name = resolve_model_path(model)
    folder = converted_folder(path) if path.is_file() else path
    with torch.inference_mode(False):
        net, config, tokenizer = load_hf_folder(folder, dtype=dtype)
    return LoadedModel(model=net, config=config, tokenizer=tokenizer, name=name, path=path)
