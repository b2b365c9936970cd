"""``dtype="auto"``: the checkpoint's dtype where this machine computes in it natively, else float32.

Native means hardware arithmetic, not emulation: bfloat16 with AVX512-BF16 or AMX-BF16 (or on a
GPU), float16 with AVX512-FP16 or AMX-FP16 (or on a GPU). Elsewhere a 16-bit checkpoint runs in
float32, which on such CPUs is also the fastest, and a warning says so. GGUF files are
dequantized to float32, so "auto" is float32 for them.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

_FLAGS_FOR = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


@lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def native_dtypes() -> frozenset[str]:
    """The float dtypes this machine computes in natively (float32 always)."""
    flags = _cpu_flags()
    native = {"float32"} | {d for d, needs in _FLAGS_FOR.items() if flags & set(needs)}
    try:
        import torch
        if torch.cuda.is_available():
            native |= {"bfloat16", "float16"}
    except ImportError:
        pass
    return frozenset(native)


def checkpoint_dtype(path: Path) -> str | None:
    """The dtype a Hugging Face folder's config.json names (``torch_dtype`` or ``dtype``), else None."""
    config = path / "config.json"
    if not path.is_dir() or not config.is_file():
        return None
    try:
        d = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    text = d.get("torch_dtype") or d.get("dtype") or (d.get("text_config") or {}).get("torch_dtype")
    return str(text).removeprefix("torch.") if text else None


def resolve_dtype(requested: str, path: Path) -> str:
    """The dtype to run in: ``requested`` unless it is "auto" (see the module docstring)."""
    if requested != "auto":
        return requested
    wanted = checkpoint_dtype(path)
    if wanted is None or wanted == "float32":
        return "float32"
    if wanted in native_dtypes():
        return wanted
    if wanted in _FLAGS_FOR:
        logger.warning("the checkpoint is %s, which this CPU does not compute in natively (no %s); "
                       "running in float32 (give --dtype %s to force it)", wanted,
                       " / ".join(_FLAGS_FOR[wanted]).upper(), wanted)
    return "float32"
