"""What identifies a model's weights and tokenizer, for the disk tier's fingerprint.

KV blocks on disk are only valid for the weights and tokenizer that computed them. Hashing every
byte of a multi-gigabyte checkpoint at each start would be slow, so a file's identity is its name,
its size and a BLAKE2b of its first and last MiB (a GGUF or safetensors header, which names
every tensor, its shape and offset, is at the start; a fine-tune that changes weights but no
shapes changes bytes all through the file, the last MiB with them). A GGUF file carries its
tokenizer, so its file identity is the tokenizer's too.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_EDGE = 1 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json")


def file_identity(path: Path, digest: hashlib.blake2b) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as f:
        digest.update(f.read(_EDGE))
        if size > 2 * _EDGE:
            f.seek(size - _EDGE)
            digest.update(f.read(_EDGE))
        elif size > _EDGE:
            digest.update(f.read())


def _identity(files: list[Path]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(files):
        file_identity(path, digest)
    return digest.hexdigest()


def model_identity(path: str | os.PathLike) -> dict[str, str]:
    """``{"weights": ..., "tokenizer": ...}`` for a model folder or a GGUF file (hex digests)."""
    path = Path(path)
    if path.is_file():
        whole = _identity([path])
        return {"weights": whole, "tokenizer": whole}
    files = [p for p in path.iterdir() if p.is_file()]
    weights = [p for p in files if p.suffix in WEIGHT_SUFFIXES or p.name == "config.json"]
    tokenizer = [p for p in files if p.name in TOKENIZER_FILES]
    return {"weights": _identity(weights), "tokenizer": _identity(tokenizer)}
