"""Where pagedkv keeps converted models: ``$PAGEDKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedkv``,
else ``~/.cache/pagedkv``."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    """The cache root directory (not created here)."""
    override = os.environ.get("PAGEDKV_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pagedkv"


def file_key(path: Path, version: str) -> str:
    """A cache key for a file from (resolved path, size, mtime) and a converter ``version``."""
    st = path.stat()
    raw = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{version}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]
