"""Weight quantization choices (pure Python: ``EngineConfig`` validates against them, the loader
resolves them; ``pagedkv/models/quant_linear.py`` holds the modules).

- ``"none"``: every weight in the model dtype (a GGUF's tensors dequantized), as before.
- ``"q8_0"``: the linear layers, the LM head and the token embedding are kept as int8 values with
  one float32 scale per 32 along the input (GGUF's Q8_0 with its fp16 scales widened), 1.125 bytes
  per weight against 4 for float32; activations stay float32. A GGUF's Q8_0 tensors are kept bit
  for bit and Q4_0 ones exactly (a Q4_0 block is a scale times integers in [-8, 7]); other GGUF
  types (Q4_1, K-quants, ...) and float weights (GGUF or Hugging Face folders) are requantized
  (scale = absmax / 127 per 32 values).
- ``"auto"`` (default): ``"q8_0"`` for a GGUF file whose linear weights are quantized, else
  ``"none"`` (float GGUFs and Hugging Face folders keep their precision). Chosen by measurement
  (``bench/quant_decode.py``, one thread): on the default model (Q4_1) ``"q8_0"`` decodes 1.9x
  faster than float32 at batch 1 and 1.1x at batch 32, in 151 MB of weights instead of 538;
  README.md, "Quantized weights", has the figures.
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
