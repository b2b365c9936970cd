"""Opening a GGUF file so that a damaged one is named and explained, not a numpy traceback.

``gguf.GGUFReader`` maps the file and slices every tensor out of it; on a file cut short (an
interrupted download or copy) the slices come back short and it fails with "cannot reshape array of
size N into shape (...)", on another file with "GGUF magic invalid", neither naming the file. Here:

- a file that does not start with ``GGUF`` is refused with the bytes it starts with;
- before any tensor is sliced, the end of the last tensor's data is compared with the file's size:
  a short file is refused with the expected and the actual size (and a header cut short likewise);
- :func:`check_model_metadata` names a metadata key a model needs that the file lacks.

Every error is a :class:`GGUFFileError` (a ``ModelLoadError``) whose message starts with the path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.models.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
# The metadata keys (after "<architecture>.") that ``model_shape.shape_from_gguf`` reads without a
# default: a model cannot be built without them.
REQUIRED_MODEL_KEYS = ("embedding_length", "block_count", "attention.head_count")
_AGAIN = "download or copy it again"


class GGUFFileError(ModelLoadError):
    """A GGUF file is not one, is cut short, is corrupt, or lacks metadata a model needs."""


class _Truncated(Exception):
    def __init__(self, needed: int, in_header: bool) -> None:
        super().__init__(needed)
        self.needed, self.in_header = needed, in_header


def open_gguf(path: str | Path) -> Any:
    """A ``gguf.GGUFReader`` of ``path``; raises :class:`GGUFFileError` (the path, what is wrong and
    what to do) for a missing or unreadable file, a bad magic, a truncated or corrupt file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError as e:
        raise GGUFFileError(f"{path}: cannot read the GGUF file ({e.strerror or e})") from e
    if head != GGUF_MAGIC:
        what = "it is empty" if not head else f"it starts with {head!r}"
        raise GGUFFileError(f"{path} is not a GGUF file: {what}, a GGUF file starts with {GGUF_MAGIC!r} "
                            f"(a different format, or an error page saved in its place? {_AGAIN})")
    try:
        return _checked_reader_class()(str(path))
    except _Truncated as t:
        if t.in_header:
            raise GGUFFileError(f"{path} is truncated inside its header: the file has {size:,} bytes and "
                                f"its metadata runs past them ({_AGAIN})") from None
        raise GGUFFileError(f"{path} is truncated: its tensors need {t.needed:,} bytes, the file has "
                            f"{size:,} ({t.needed - size:,} missing; an interrupted download? {_AGAIN})"
                            ) from None
    except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError, OverflowError) as e:
        raise GGUFFileError(f"{path} is a corrupt GGUF file ({type(e).__name__}: {e}); {_AGAIN}") from e


def check_model_metadata(reader: Any, path: str | Path) -> str:
    """The architecture of GGUF ``reader`` (read from ``path``) after checking that its metadata holds
    every key a model is built from; raises :class:`GGUFFileError` naming the first missing key."""
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise GGUFFileError(f"{path}: the GGUF metadata lacks 'general.architecture', so this is no model "
                            f"file (or an incomplete one; inspect it with gguf-dump)")
    arch = str(arch_field.contents())
    for suffix in REQUIRED_MODEL_KEYS:
        key = f"{arch}.{suffix}"
        if key not in reader.fields:
            raise GGUFFileError(f"{path}: the GGUF metadata lacks {key!r}, which a {arch} model needs; the file "
                                f"is incomplete or was written by a converter pagedkv does not know "
                                f"(inspect it with gguf-dump)")
    return arch


_READER_CLASS: type | None = None


def _checked_reader_class() -> type:
    """``gguf.GGUFReader`` with two checks added (the gguf import is deferred: it is not light)."""
    global _READER_CLASS
    if _READER_CLASS is not None:
        return _READER_CLASS
    from gguf import GGUFReader
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    class CheckedReader(GGUFReader):
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            end = int(offset) + int(np.empty([], dtype=dtype).itemsize) * int(count)
            if end > len(self.data):  # only the header is read through here before the check below
                raise _Truncated(end, in_header=True)
            return super()._get(offset, dtype, count, override_order)

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            needed = start_offs
            for field in fields:
                _, _, _, dims, raw_dtype, offset_tensor = field.parts
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
                n_bytes = int(np.prod(dims, dtype=np.int64)) * type_size // block
                needed = max(needed, start_offs + int(offset_tensor[0]) + n_bytes)
            if needed > len(self.data):
                raise _Truncated(needed, in_header=False)
            super()._build_tensors(start_offs, fields)

    _READER_CLASS = CheckedReader
    return CheckedReader


__all__ = ["GGUFFileError", "REQUIRED_MODEL_KEYS", "check_model_metadata", "open_gguf"]
