"""KV block formats: how a KV kind is stored, and its plain-PyTorch quantization.

The names and bytes of every kind come from :mod:`pagedkv.model_shape` (the one KV-bytes formula);
this module maps them to torch storage dtypes. The 8-bit kinds keep one float32 scale per
(block, layer, K/V, KV head) beside the block (``KVCache.scales``): value = stored * scale, with
``scale = absmax / qmax`` of what the block holds for that head. The native kernels
(``csrc/paged_attention.cpp``) write and read them; :func:`quantize` / :func:`dequantize` are the
plain-PyTorch statement of the same rounding, used by the reference attention and the tests.

How a block's scale follows appended tokens: a block is opened by the tokens written at its
offset 0 (scale from them alone); a later write whose absmax exceeds the scale grows it and
requantizes the block's filled slots to the new scale. So a scale is always the absmax of the
block's contents at its last growth, and a value is rounded at most once per growth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.model_shape import KV_CACHE_DTYPES, SCALED_KV_DTYPES, kv_dtype_name
from pagedkv.model_shape import full_block_fraction as full_block_fraction  # (a mixed pool's split, re-exported)

_STORAGE: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8,
    "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}
_QMAX = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
# Kinds whose K/V the runner stores in a Hadamard basis (all 8-bit ones): the few outlier channels
# of K then spread over all channels, so a block's absmax scale wastes less of the 8 bits. On the
# default model it took int8 top-1 agreement from 95.8% to 98.0% and fp8_e4m3 from 91.1% to 94.0%.
ROTATED_KV_DTYPES = SCALED_KV_DTYPES

# Relative RMS error of the rows a layer writes above which the engine warns (per kind). Measured
# on the default model with bench/kv_quant.py: see docs/kv_quantization.md.
ERROR_WARN_THRESHOLD = {"int8": 0.03, "fp8_e4m3": 0.08, "fp8_e5m2": 0.15}


@dataclass(frozen=True, slots=True)
class KVFormat:
    name: str  # canonical kind: float32 bfloat16 float16 int8 fp8_e4m3 fp8_e5m2
    storage: torch.dtype  # dtype of the cache tensors
    scaled: bool  # one float32 scale per (block, layer, K/V, KV head)
    qmax: float | None  # largest stored magnitude (8-bit kinds)
    rotated: bool = False  # K and V stored in a Hadamard basis (8-bit kinds; see the runner)

    @property
    def warn_threshold(self) -> float | None:
        return ERROR_WARN_THRESHOLD.get(self.name)


def kv_format(kind: str | torch.dtype | None, model_dtype: torch.dtype = torch.float32) -> KVFormat:
    """The format of a KV kind: ``auto``/None (the model dtype), a name ``model_shape`` accepts
    (``int8``, ``fp8``, ``fp8_e4m3``, ``fp8_e5m2``, ``float16``, ``bf16``, ...) or a torch dtype.
    Raises ValueError naming the accepted kinds."""
    if kind is None or kind == "auto":
        kind = model_dtype
    if isinstance(kind, torch.dtype):
        kind = str(kind).removeprefix("torch.")
    try:
        name = kv_dtype_name(kind)
    except ValueError:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kind!r}") from None
    return KVFormat(name, _STORAGE[name], name in SCALED_KV_DTYPES, _QMAX.get(name), name in ROTATED_KV_DTYPES)


def hadamard(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """The orthonormal Sylvester-Hadamard matrix of size ``n`` (symmetric, ``H @ H = I``), or None
    when ``n`` is not a power of two."""
    if n < 1 or n & (n - 1):
        return None
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n ** 0.5).to(dtype)


def quantize(x: torch.Tensor, fmt: KVFormat, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` rounded to ``fmt``'s storage (saturating); ``scale`` broadcasts against ``x``
    (0 stores zeros)."""
    assert fmt.scaled and fmt.qmax is not None
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    y = (x.float() * inv).clamp(-fmt.qmax, fmt.qmax)
    if fmt.storage == torch.int8:
        y = torch.round(y)
    return y.to(fmt.storage)


def dequantize(q: torch.Tensor, fmt: KVFormat, scale: torch.Tensor | None) -> torch.Tensor:
    """Stored values -> float32 (``q * scale`` for the 8-bit kinds)."""
    # the 8-bit kinds always come with their scales; not tested again per layer
    return q.float() * scale if fmt.scaled else q.float()  # type: ignore[operator]
