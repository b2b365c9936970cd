"""Load a Hugging Face model folder: config.json, safetensors (single or sharded), tokenizer.json."""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any, BinaryIO

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


# The LM head's and the embedding's tensors are read first (from whichever file holds them): the
# loader packs the head as soon as it is in (``build_model(cpu_layout=)``), while little else is.
_HEAD_FIRST = re.compile(r"(^|\.)(lm_head|embed_tokens)\.weight$")


def _head_first(names: Iterable[str], first: bool) -> list[str]:
    """The names of one pass: the head's and embedding's (``first``) or all the others."""
    return [n for n in names if n != "__metadata__" and bool(_HEAD_FIRST.search(n)) == first]


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for first in (True, False):
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in _head_first(f.keys(), first):
                    yield name, f.get_tensor(name)


# safetensors dtype names -> torch dtypes (read by SafetensorsEntry without the safetensors library)
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


_READ_BLOCK = 4 << 20  # bytes read at once when a rank's columns are picked out of whole rows


class SafetensorsEntry:
    """One tensor of a safetensors file, not read yet (a ``models/sharding.LazyTensor``): a
    tensor-parallel rank reads only its rows or columns of it, with plain reads into its own
    tensor (its rows: one read; its columns: whole rows 16 MiB at a time, the columns copied out).
    Not through a memory map: file pages a process touches count in its resident memory while
    mapped, and a rank would hold them beside its copy at its peak."""

    def __init__(self, file: BinaryIO, base: int, name: str, info: dict[str, Any]) -> None:
        self.file, self.name = file, name
        self.dtype = _ST_DTYPES[info["dtype"]]
        self.shape = tuple(int(n) for n in info["shape"])
        self.start = base + int(info["data_offsets"][0])

    def _bytes(self, offset: int, nbytes: int, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8) if out is None else out
        self.file.seek(self.start + offset)
        # the file object is typed as IO[bytes], which has no readinto; the raw file has it
        if nbytes and self.file.readinto(out.numpy()) != nbytes:  # type: ignore[attr-defined]
            raise ModelLoadError(f"{self.name}: the safetensors file ends inside the tensor")
        return out

    def read(self, index: tuple[slice, ...] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor's ``index`` (all of it for None); into ``out`` (returned) when it is given,
        contiguous, of the same dtype and shape: no second copy of the rank's part."""
        shape, esize = self.shape, torch.empty((), dtype=self.dtype).element_size()
        ranges = [slice(None).indices(n) for n in shape]
        for d, sl in enumerate(index or ()):
            ranges[d] = sl.indices(shape[d])
        if any(step != 1 for _, _, step in ranges):
            raise ValueError(f"{self.name}: strided reads are not supported")
        # the last sliced dim k: every dim after it whole, every dim before it whole too (else per row)
        sliced = [d for d, (a, b, _) in enumerate(ranges) if (a, b) != (0, shape[d])]
        k = sliced[-1] if sliced else 0
        out_shape = tuple(b - a for a, b, _ in ranges)
        inner = math.prod(shape[k + 1:])
        lo, hi = ranges[k][0] * inner * esize, ranges[k][1] * inner * esize
        rows, row_bytes = math.prod(shape[:k]), shape[k] * inner * esize
        direct = out is not None and out.dtype == self.dtype and out.is_contiguous() and out.shape == out_shape
        raw = out.view(-1).view(torch.uint8) if direct and out is not None and out.numel() else None
        if any(d < k for d in sliced):  # several sliced dims: rare, read whole and slice
            whole = self._bytes(0, math.prod(shape) * esize).view(self.dtype).view(shape)
            got = whole[tuple(slice(a, b) for a, b, _ in ranges)]
            direct = False
        elif rows == 1 or (lo, hi) == (0, row_bytes):  # one contiguous run
            got = self._bytes(lo, (hi - lo) * rows, raw).view(self.dtype).view(out_shape)
        else:
            buf = raw.view(rows, hi - lo) if raw is not None else torch.empty(rows, hi - lo, dtype=torch.uint8)
            per = max(1, _READ_BLOCK // row_bytes)
            for r in range(0, rows, per):
                n = min(per, rows - r)
                buf[r:r + n] = self._bytes(r * row_bytes, n * row_bytes).view(n, row_bytes)[:, lo:hi]
            got = buf.view(self.dtype).view(out_shape)
        if out is not None and not direct:
            return out.copy_(got) if out.shape == got.shape else got
        return out if out is not None else got


def iter_safetensors_entries(files: list[Path]) -> Iterator[tuple[str, SafetensorsEntry | torch.Tensor]]:
    """Every tensor of ``files`` as a :class:`SafetensorsEntry` (valid while the iteration runs; a
    dtype it does not know is read whole by the safetensors library). The head's and the embedding's
    come first."""
    for first in (True, False):
        for path in files:
            with open(path, "rb") as f:
                size = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(size))
                for name in _head_first(header, first):
                    info = header[name]
                    if info.get("dtype") in _ST_DTYPES:
                        yield name, SafetensorsEntry(f, 8 + size, name, info)
                    else:
                        with safe_open(str(path), framework="pt") as st:
                            yield name, st.get_tensor(name)


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


def load_hf_folder(folder: Path, dtype: torch.dtype = torch.float32, tp: TPGroup | None = None,
                   cpu_layout: bool = False) -> tuple[LlamaForCausalLM, ModelConfig, Tokenizer | None]:
    """Model, config and tokenizer (None when the folder has no tokenizer.json) of an HF folder.
    Weights the folder holds in Q8_0 (a GGUF converted with quantization "q8_0") load as Q8_0
    modules (``models/quant_linear.py``). With ``tp`` of several ranks the model is this rank's
    shard, read tensor by tensor as slices (``models/sharding.py``); the config returned is the
    whole model's (the shard's own is ``model.config``). ``cpu_layout``: see :func:`build_model`."""
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
        model = build_model(config, tensors, dtype=dtype, quantized=quantized_modules(config, names), tp=tp,
                            cpu_layout=cpu_layout)
    tokenizer = load_hf_tokenizer(folder, config_json) if (folder / "tokenizer.json").exists() else None
    return model, config, tokenizer
