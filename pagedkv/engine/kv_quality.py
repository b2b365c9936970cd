"""The run-time quality guard of 8-bit KV blocks: how much error the stored K/V carry; and a
request's own KV precision (:func:`request_kv_salt`).

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

from pagedkv.engine.errors import RequestRejectedError
from pagedkv.memory import FULL_PRECISION_SALT
from pagedkv.model_shape import SCALED_KV_DTYPES, kv_dtype_name

if TYPE_CHECKING:
    from pagedkv.runner.protocol import Runner

logger = logging.getLogger(__name__)


def request_kv_salt(kind: str | None, salt: str | None, runner: Runner, blocks_needed: int) -> str | None:
    """The prefix-cache salt of a request that asks for KV format ``kind`` (``SamplingParams.kv_cache_dtype``,
    the request's ``kv_cache_dtype`` extension): ``salt`` itself when the pool already stores that
    precision; with ``FULL_PRECISION_SALT`` added when it asks for full precision (a float kind) in
    a mixed pool, so that its blocks are all full precision (``memory/block_pool.py``) and never
    shared with 8-bit blocks of the same tokens. RequestRejectedError when the pool cannot serve it:
    a float kind from an 8-bit pool without full-precision blocks, another 8-bit kind, or more
    blocks (``blocks_needed``, prompt and output) than the pool's full-precision ones."""
    if kind is None or kind == "auto":
        return salt
    try:
        name = kv_dtype_name(kind)
    except ValueError as exc:
        raise RequestRejectedError(f"kv_cache_dtype: {exc}") from None
    pool = runner.kv_format.name
    if name == pool or (name not in SCALED_KV_DTYPES and pool not in SCALED_KV_DTYPES):
        return salt  # already stored so (a float pool: the model dtype is the full precision it has)
    if name in SCALED_KV_DTYPES:
        raise RequestRejectedError(f"kv_cache_dtype {name!r}: this engine stores {pool} blocks; a request may "
                                   f"ask for its own format or full precision (float32, bfloat16, float16)")
    full = runner.kv_full_blocks
    if not full:
        raise RequestRejectedError(f"kv_cache_dtype {name!r}: this engine stores every block as {pool}; start it "
                                   f"with kv_sink_blocks >= 1 (a mixed pool) to serve full-precision requests")
    if blocks_needed > full:
        raise RequestRejectedError(f"kv_cache_dtype {name!r}: the request needs {blocks_needed} full-precision "
                                   f"blocks, the pool has {full}; shorten it or give the engine more KV memory")
    return f"{salt or ''}{FULL_PRECISION_SALT}"


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
