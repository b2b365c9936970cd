"""Weight quantization choices (pure Python: ``EngineConfig`` validates against them, the loader
resolves them; ``pagedkv/models/quant_linear.py`` holds the modules).

The 8-bit layout: int8 values with one float32 scale and, optionally, one float32 offset per 32
along the input (value = scale * q + offset; GGUF's Q8_0 with its fp16 scales widened, plus the
offset), 1.125 bytes per weight (1.25 with offsets) against 4 for float32; activations stay float32.
It holds these GGUF types bit for bit (``pagedkv/models/gguf_quants.py``, ``EXACT_TYPES``): Q8_0,
Q4_0, Q5_0 (no offsets), Q4_1, Q5_1, Q4_K, Q5_K (offsets).

- ``"none"``: every weight in the model dtype (a GGUF's tensors dequantized), as before.
- ``"auto"`` (default): a GGUF's linear weights, LM head and embedding stay compact, exactly: Q4_0,
  Q4_1, Q4_K and IQ4_NL packed at 4 bits, Q5_0, Q5_1 and Q5_K at 5, Q6_K at 6 (the low-bit layouts,
  :data:`LOWBIT_FORMATS`), Q8_0 in the 8-bit layout; a fused q/k/v or gate/up takes one layout that
  holds all its parts (else the 8-bit one where all its parts are exact there, else float32). The
  others (Q2_K, Q3_K, other IQ types, floats) are dequantized: the values are exactly ``"none"``'s,
  so the answers are the file's. Float GGUFs and Hugging Face folders are ``"none"``.
- ``"q8_0"``: every linear layer, the LM head and the token embedding in the 8-bit layout: the
  exact types as above, every other type and float weights (GGUF or Hugging Face folders)
  requantized (scale = absmax / 127 per 32 values, no offset: lossy).

Measured with ``bench/quant_decode.py`` (one thread): on the default model (Q4_1) ``"auto"``'s
4-bit layout decodes 1.24x the 8-bit layout's tokens/s at batch 1 (0.94x at 32) and holds 1.06x
the file's size; docs/weight_quantization.md has the figures.
"""

from __future__ import annotations

from dataclasses import dataclass

QUANTIZATIONS = ("auto", "none", "q8_0")
Q8_0_GROUP = 32  # values per scale
Q8_0_BYTES_PER_WEIGHT = 1 + 4 / Q8_0_GROUP  # an int8 value plus a share of its float32 scale


@dataclass(frozen=True, slots=True)
class LowBitFormat:
    """A low-bit layout: per run of 32 values along the input, 16 bytes of nibbles (byte i holds value
    i in its low half and value i + 16 in its high half, GGUF's own order), ``planes`` 4-byte bit
    planes (bit j of plane p is value j's bit 4 + p), one float32 scale per ``group`` values and,
    for the types with a minimum, one float32 offset per 32. A value is
    ``scale * (code - zero) + offset`` with ``code = nibble | planes << 4``, or
    ``scale * lut[nibble] + offset`` where ``lut`` (IQ4_NL's non-uniform grid) is given."""

    name: str
    planes: int  # 0: 4 bits, 1: 5 bits, 2: 6 bits
    group: int  # values per scale: 32, or 16 (Q6_K's sub-blocks)
    zero: int  # subtracted from every code (no lut)
    lut: tuple[int, ...] | None = None

    @property
    def bits(self) -> int:
        return 4 + self.planes

    def bytes_per_weight(self, offsets: bool) -> float:
        return self.bits / 8 + 4 / self.group + (4 / 32 if offsets else 0)


IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
LOWBIT_FORMATS = {f.name: f for f in (
    LowBitFormat("i4", 0, 32, 8),  # Q4_0
    LowBitFormat("u4", 0, 32, 0),  # Q4_1, Q4_K (and Q4_0 beside them, its -8 d as offsets)
    LowBitFormat("nl4", 0, 32, 0, IQ4_NL_VALUES),  # IQ4_NL
    LowBitFormat("i5", 1, 32, 16),  # Q5_0
    LowBitFormat("u5", 1, 32, 0),  # Q5_1, Q5_K (and Q5_0 beside them)
    LowBitFormat("i6", 2, 16, 32),  # Q6_K
)}
def check_quantization(value: object) -> str:
    """``value`` if it names a quantization choice; raises ValueError listing them."""
    if value not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {value!r}")
    return str(value)
