"""The run-time quality guard of 8-bit KV blocks: how much error the stored K/V carry.

The runner's write kernel accumulates, per layer and K/V, ``sum((dequantized - x)^2)`` and
``sum(x^2)`` over every row it stores (measured on the values as written, before any later scale
growth requantizes them). Every ``every`` steps the guard takes the relative RMS error of the rows
written since its last look, per layer, and logs a warning naming the layer the first time it
passes the format's threshold (``pagedkv.ops.kv_format.ERROR_WARN_THRESHOLD``). ``stats()`` and
``/metrics`` report the error since start.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.runner.protocol import Runner

logger = logging.getLogger(__name__)


class KVQuantGuard:
    def __init__(self, runner: Runner, every: int = 32) -> None:
        """``runner``: one with 8-bit KV blocks (its ``write_error`` is not None)."""
        if runner.write_error is None:
            raise ValueError("KVQuantGuard: the runner's KV blocks are not 8-bit (write_error is None)")
        self.runner = runner
        self.format = runner.kv_format
        self.threshold = self.format.warn_threshold
        self.every = every
        self._errors = runner.write_error
        self._last = self._errors.clone()
        self.warned: set[int] = set()  # layers warned about (once each)

    def after_step(self, step: int) -> None:
        if step % self.every:
            return
        now = self._errors.clone()
        delta = (now - self._last).tolist()  # [layers][K, V][err, ref]
        self._last = now
        for layer, kv in enumerate(delta):
            for name, (err, ref) in zip("KV", kv):
                rel = math.sqrt(err / ref) if ref > 0 else 0.0
                if self.threshold is not None and rel > self.threshold and layer not in self.warned:
                    self.warned.add(layer)
                    logger.warning(
                        "KV quantization error is high in layer %d (%s): relative RMS error %.4f > %.4f "
                        "for kv_cache_dtype %s over the last %d steps; outputs may drift from the full-"
                        "precision model. Consider --kv-cache-dtype int8 (or auto)", layer, name, rel,
                        self.threshold, self.format.name, self.every)


def max_quant_error(per_layer: list[tuple[float, float]] | None) -> float | None:
    """The largest (K or V) relative RMS error over layers, or None without 8-bit blocks."""
    return max((max(kv) for kv in per_layer), default=0.0) if per_layer is not None else None
