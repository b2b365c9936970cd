"""Weight quantization choices (pure Python: ``EngineConfig`` validates against them, the loader
resolves them; ``pagedkv/models/quant_linear.py`` holds the modules).

The 8-bit layout: int8 values with one float32 scale and, optionally, one float32 offset per 32
along the input (value = scale * q + offset; GGUF's Q8_0 with its fp16 scales widened, plus the
offset), 1.125 bytes per weight (1.25 with offsets) against 4 for float32; activations stay float32.
It holds these GGUF types bit for bit (``pagedkv/models/gguf_quants.py``, ``EXACT_TYPES``): Q8_0,
Q4_0, Q5_0 (no offsets), Q4_1, Q5_1, Q4_K, Q5_K (offsets).

- ``"none"``: every weight in the model dtype (a GGUF's tensors dequantized), as before.
- ``"auto"`` (default): a GGUF's linear weights, LM head and embedding stay in the 8-bit layout
  where their type is one of those (a fused q/k/v or gate/up only when all its parts are), and the
  others (Q6_K, Q2_K, Q3_K, IQ*, floats) are dequantized: the values are exactly ``"none"``'s, so
  the answers are the file's. Float GGUFs and Hugging Face folders are ``"none"``.
- ``"q8_0"``: every linear layer, the LM head and the token embedding in the 8-bit layout: the
  exact types as above, every other type and float weights (GGUF or Hugging Face folders)
  requantized (scale = absmax / 127 per 32 values, no offset: lossy).

Measured with ``bench/quant_decode.py`` (one thread): on the default model (Q4_1, all of it exact)
``"auto"`` decodes faster than float32 at batch 1 and 32 in a fraction of the memory; README.md,
"Quantized weights", has the figures.
"""

from __future__ import annotations

QUANTIZATIONS = ("auto", "none", "q8_0")
Q8_0_GROUP = 32  # values per scale
Q8_0_BYTES_PER_WEIGHT = 1 + 4 / Q8_0_GROUP  # an int8 value plus a share of its float32 scale


def check_quantization(value: object) -> str:
    """``value`` if it names a quantization choice; raises ValueError listing them."""
    if value not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {value!r}")
    return str(value)
