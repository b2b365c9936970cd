"""Byte sizes on the command line: parsing ``80GiB`` / ``71GB`` and printing them back.

Decimal suffixes (``KB MB GB TB``, any case) are powers of 1000, binary ones (``KiB MiB GiB TiB``,
any case) powers of 1024. A bare letter means what it means to vLLM's flags (``human_readable_int``):
lowercase ``k m g t`` decimal, uppercase ``K M G T`` binary, so ``4G`` is 4 GiB and ``4g`` 4 GB.
A plain number is bytes. Spaces and ``_`` separators are ignored. Pure Python: the engine's
``kv_cache_memory``, ``pagedkv size`` and ``pagedkv simulate`` all read sizes here.
"""

from __future__ import annotations

import re

_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_LETTERS: dict[str, int] = {"k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
                            "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}  # vLLM's meaning
_PATTERN = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, flag: str) -> int:
    """``"80GiB"`` -> 85899345920. Raises ``ValueError`` naming ``flag`` on a bad value."""
    match = _PATTERN.match(str(text))
    suffix = match.group(2) if match else ""
    factor = _LETTERS.get(suffix) or _UNITS.get(suffix.lower())
    if match is None or factor is None:
        raise ValueError(f"{flag}: expected a size like 80GiB, 71GB or 1048576 (units B, KB/MB/GB/TB "
                         f"= 1000^n, KiB/MiB/GiB/TiB = 1024^n; as vLLM's, k/m/g/t = 1000^n and "
                         f"K/M/G/T = 1024^n), got {text!r}")
    return int(float(match.group(1).replace("_", "")) * factor)


def format_bytes(n: float) -> str:
    """``8388608`` -> ``"8.00 MiB"`` (binary units, three significant figures or more)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:,.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:,.2f} TiB"
