"""``load_model``: the one public way to get a model, its config and its tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedkv.distributed.group import TPGroup
from pagedkv.models.config import ModelConfig
from pagedkv.models.default_model import DEFAULT_MODEL_NAME, default_model_path
from pagedkv.models.errors import ModelLoadError
from pagedkv.models.gguf_loader import converted_folder, has_exact_quantized_matrices, tokenizer_folder
from pagedkv.models.hf_loader import load_hf_folder, load_hf_tokenizer, read_generation_defaults, read_json
from pagedkv.models.hub import looks_like_repo_id, model_snapshot
from pagedkv.models.llama import LlamaForCausalLM
from pagedkv.models.quant_linear import quantize_model
from pagedkv.models.tokenizer import Tokenizer
from pagedkv.weight_quant import check_quantization


@dataclass(slots=True)
class LoadedModel:
    """A ready model: ``model`` (eval mode), its frozen ``config``, ``tokenizer``, a display ``name``,
    the resolved ``quantization`` of its weights (:func:`resolve_quantization`) and the sampling
    defaults of its generation_config.json (``generation_defaults``, vLLM's names: temperature,
    top_p, top_k, min_p, repetition_penalty, max_tokens; a GGUF file has none: {}).

    Under tensor parallelism (``load_model(tp=)``) ``model`` is one rank's shard and ``config`` its
    rank-local config (its query and KV heads, its share of the intermediate sizes: what the
    rank's KV cache is sized by); ``full_config`` is the whole model's (``config`` itself on one
    rank)."""

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    name: str
    path: Path
    quantization: str = "none"
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    full_config: ModelConfig | None = None

    def __post_init__(self) -> None:
        if self.full_config is None:
            self.full_config = self.config


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim``): loading frees many
    small and mid-sized buffers (tensor names, the float modules the quantized ones replace, file
    reads) that glibc otherwise keeps resident: about 50 MiB of the bundled model's 400. A no-op
    where the C library has no such call."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def resolve_model_path(model: str | Path | None, revision: str | None = None,
                       download_dir: str | Path | None = None) -> tuple[Path, str]:
    """(path, display name): None -> bundled default GGUF; a folder -> HF (or its only ``*.gguf``
    when it has no config.json); ``*.gguf`` -> GGUF; ``org/name`` that is no local path -> that
    model's snapshot at ``revision`` in the Hugging Face cache (``download_dir``, else Hugging
    Face's own), downloaded from the Hub when absent (``models/hub.py``; never with
    ``HF_HUB_OFFLINE``). Raises ModelLoadError for anything else."""
    if model is None or str(model) in ("", "default", DEFAULT_MODEL_NAME):
        return default_model_path(), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if not path.exists() and looks_like_repo_id(str(model)):
        path = model_snapshot(str(model), revision, download_dir)
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
        f"*.safetensors), a .gguf file, a Hugging Face repo id (org/name), or None for the bundled "
        f"default ({DEFAULT_MODEL_NAME})"
    )


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
               quantization: str = "auto", tokenizer: str | Path | None = None, *,
               revision: str | None = None, download_dir: str | Path | None = None,
               tp: TPGroup | None = None, cpu_layout: bool = False) -> LoadedModel:
    """Load ``model`` (see :func:`resolve_model_path`) with weights in ``dtype``, the linear ones
    in Q8_0 where ``quantization`` (:func:`resolve_quantization`) says so.

    GGUF files are converted once (dequantized to float32, or to Q8_0 tensors) into the pagedkv cache
    directory and loaded from there afterwards; a float folder asked for "q8_0" is quantized as
    it loads. ``tokenizer`` replaces the model's own (:func:`load_tokenizer`). ``revision`` and
    ``download_dir`` apply to a Hugging Face repo id (:func:`resolve_model_path`). Raises ModelLoadError
    (or a subclass) with a clear message, ValueError for an unknown ``quantization``.

    ``tp`` (every rank of a tensor-parallel group calls this alike): this rank's shard, reading only
    its part of each tensor; a GGUF file is converted by rank 0 while the others wait. Logits are
    the whole vocabulary's on every rank. Raises ShardingError (``distributed/group.py``) for a
    model whose heads or intermediate sizes do not split over ``tp.size`` ranks, naming the sizes
    that would.

    ``cpu_layout``: the float32 weights the CPU runner lays out its own way (the LM head packed, the
    fused projections input-major) are laid out so as they are read (the runner would do it later,
    at a higher peak: see ``build_model``); not with quantization "q8_0", which quantizes them
    after loading.
    """
    check_quantization(quantization)
    path, name = resolve_model_path(model, revision, download_dir)
    chosen = load_tokenizer(tokenizer) if tokenizer is not None else None  # a bad one fails before the weights
    quant = resolve_quantization(quantization, path)
    if path.is_file() and tp is not None and tp.size > 1 and tp.rank > 0:
        tp.barrier()  # rank 0 converts the GGUF file once (below); the others then read its cache
    folder = converted_folder(path, quant) if path.is_file() else path
    if path.is_file() and tp is not None and tp.size > 1 and tp.rank == 0:
        tp.barrier()
    with torch.inference_mode(False):
        net, config, own_tokenizer = load_hf_folder(folder, dtype=dtype, tp=tp,
                                                     cpu_layout=cpu_layout and quant != "q8_0")
        if quant == "q8_0":
            quantize_model(net)  # float linear layers left (an HF folder); none after a GGUF conversion
    if chosen is None:
        chosen = own_tokenizer
    elif chosen.vocab_size > config.vocab_size:
        raise ModelLoadError(f"--tokenizer: its vocabulary ({chosen.vocab_size} tokens) is larger than "
                             f"the model's ({config.vocab_size}): its ids past the model's would have no "
                             "embedding; give the model's own tokenizer or one of the same family")
    defaults = read_generation_defaults(path) if path.is_dir() else {}  # GGUF: no generation config
    release_freed_memory()
    return LoadedModel(model=net, config=net.config, tokenizer=chosen, name=name, path=path, quantization=quant,
                       generation_defaults=defaults, full_config=config)
