"""Llama-family models and their loaders (Hugging Face folders, GGUF files, the bundled default)."""

from pagedkv.models.config import ModelConfig, RopeConfig
from pagedkv.models.errors import (
    DefaultModelMissingError,
    MissingTensorError,
    ModelLoadError,
    UnsupportedModelError,
)
from pagedkv.models.llama import LlamaForCausalLM
from pagedkv.models.loader import LoadedModel, load_model
from pagedkv.models.tokenizer import Tokenizer

__all__ = [
    "DefaultModelMissingError", "LlamaForCausalLM", "LoadedModel", "MissingTensorError",
    "ModelConfig", "ModelLoadError", "RopeConfig", "Tokenizer", "UnsupportedModelError", "load_model",
]
