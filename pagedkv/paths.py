"""Where pagedkv keeps files it makes: ``$PAGEDKV_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedkv``,
else ``~/.cache/pagedkv``.

A top-level module, not part of ``models/``: the models' converters and the ops' native build
both cache here, and ``ops`` must not import ``models`` (models use the ops' kernels).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pagedkv import envs


def cache_root() -> Path:
    """The cache root directory (not created here)."""
    override = envs.CACHE_DIR.get()
    if override is not None:
        return override
    xdg = envs.XDG_CACHE_HOME.get()
    base = xdg if xdg is not None else Path.home() / ".cache"
    return base / "pagedkv"


def file_key(path: Path, version: str) -> str:
    """A cache key for a file from (resolved path, size, mtime) and a converter ``version``."""
    st = path.stat()
    raw = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{version}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]
