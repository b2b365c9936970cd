"""Which model ``pagedkv size`` and ``pagedkv simulate --model`` size: a preset, a HF
``config.json`` or a GGUF file, as a :class:`~pagedkv.model_shape.ModelShape`.

This module only finds and opens the file: the readers of config.json and GGUF metadata, their
defaults and the parameter count live in :mod:`pagedkv.model_shape`, shared with the model loaders.
Only shapes are read, never weights: the sizing tool runs without torch or a model download.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedkv.model_shape import ModelShape, shape_from_gguf, shape_from_hf_dict
from pagedkv.sim.presets import PRESETS, find_preset


def load_model_spec(source: str) -> ModelShape:
    """A preset name, a ``config.json`` (or a folder holding one), or a ``.gguf`` file.

    Raises ``ValueError`` naming the argument when none of these matches.
    """
    preset = find_preset(source)
    if preset is not None:
        return preset
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".gguf" and path.is_file():
        return spec_from_gguf(path)
    if path.is_file():
        return spec_from_hf_config(path)
    raise ValueError(f"MODEL: {source!r} is neither a preset ({', '.join(PRESETS)}), "
                     f"a config.json (or its folder) nor a .gguf file")


def spec_from_hf_config(path: str | Path) -> ModelShape:
    """Read a Hugging Face ``config.json`` (nested ``text_config`` is followed)."""
    with open(path) as handle:
        cfg: dict[str, Any] = json.load(handle)
    try:
        return shape_from_hf_dict(cfg, name=Path(path).parent.name or "config")
    except ValueError as exc:
        raise ValueError(f"MODEL: {path}: {exc}; not a transformer config") from None


def spec_from_gguf(path: str | Path) -> ModelShape:
    """Read a GGUF file's metadata with the ``gguf`` package (imported here, not at start-up).

    The parameter count and weight bytes are the file's own tensor sizes (quantized as stored).
    """
    import gguf  # lazy: pulls numpy, needed only for GGUF files

    try:
        return shape_from_gguf(gguf.GGUFReader(str(path)), name=Path(path).stem)
    except ValueError as exc:
        raise ValueError(f"MODEL: {path}: {exc}") from None
