"""Byte sizes on the command line: parsing ``80GiB`` / ``71GB`` and printing them back.

Decimal suffixes (``KB MB GB TB`` and the bare letters ``K M G T``) are powers of 1000, binary ones
(``KiB MiB GiB TiB``) powers of 1024. A plain number is bytes. Case does not matter; spaces and
``_`` separators are ignored. Pure Python: the engine's ``kv_cache_memory``, ``pagedkv size`` and
``pagedkv simulate`` all read sizes here.
"""

from __future__ import annotations

import re

_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
    "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
}
_PATTERN = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, flag: str) -> int:
    """``"80GiB"`` -> 85899345920. Raises ``ValueError`` naming ``flag`` on a bad value."""
    match = _PATTERN.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{flag}: expected a size like 80GiB, 71GB or 1048576 (units "
                         f"B, KB/MB/GB/TB or K/M/G/T = 1000^n, KiB/MiB/GiB/TiB = 1024^n), got {text!r}")
    return int(float(match.group(1).replace("_", "")) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """``8388608`` -> ``"8.00 MiB"`` (binary units, three significant figures or more)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:,.0f} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:,.2f} TiB"
