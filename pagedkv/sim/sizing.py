"""KV cache sizing: bytes per token and per block, blocks that fit, and sequences they hold.

The KV bytes of a token and a block come from :mod:`pagedkv.model_shape`, the same formulas the
runner sizes its pools with; this module adds device budgets, weights and length distributions.

Rules (per tensor-parallel rank; every rank holds the same number of blocks)::

    kv heads per rank   = num_kv_heads / tp          (tp must divide it, or be a multiple of it:
                                                      then each rank keeps 1 replicated head)
    kv bytes per token  = layers * 2 (K and V) * kv_heads_per_rank * head_dim * kv_dtype_bytes
                MLA:      layers * (kv_lora_rank + qk_rope_head_dim) * kv_dtype_bytes
                          (one latent, not split across ranks)
    block bytes         = block_size * kv_bytes_per_token + scale bytes
    scale bytes (8-bit) = layers * 2 * kv_heads_per_rank * 4   one fp32 scale per block, layer,
                          K/V and head (MLA: per block and layer) for int8, fp8_e4m3 and
                          fp8_e5m2, as the engine stores them. fp16/bf16/fp32: none.
    kv memory           = device_memory * (1 - reserved_fraction) - weight_memory / tp
                          (or --kv-memory as given)
    num_blocks          = floor(kv_memory / block_bytes)
    max concurrent at max_len = floor(num_blocks / ceil(max_len / block_size))

Under a length distribution, a running sequence of prompt ``p`` and output ``o`` spends ``o``
steps at lengths ``p+1 .. p+o`` and holds on average ``(B-1)/2`` empty slots in its last block, so
the steady-state footprint is ``mean_live_len + (B-1)/2`` slots and the memory holds
``num_blocks * B / footprint`` sequences; the internal waste is ``((B-1)/2) / footprint``.

A hybrid model (Gemma 3: full and sliding-window layers, ``model_shape.kv_groups``) stores each
group's layers in blocks of their own (a block holds ``group size`` layers) and a sliding group
keeps only the blocks its window can see: a sequence of n tokens holds
``kv_blocks_per_sequence(n)`` blocks, each full group ``ceil(n / B)``, each sliding group about
``window / B + 1``. Its steady footprint adds, per group, the tokens it keeps plus ``(B-1)/2``
empty slots at the end (and, past the window, the out-of-window part of its first block).
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field

from pagedkv.model_shape import (
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    SCALED_KV_DTYPES,
    ModelShape,
    check_block_size,
    check_kv_quant_parts,
    full_block_fraction,
    kv_blocks_per_sequence,
    kv_bytes_per_block,
    kv_bytes_per_token,
    kv_dtype_name,
    kv_groups,
    kv_heads_per_rank,
    kv_layer_slots,
    mixed_block_split,
    scale_bytes_per_block,
)
from pagedkv.weight_quant import LOWBIT_FORMATS, Q8_0_BYTES_PER_WEIGHT
from pagedkv.workloads import WorkloadShape

WEIGHT_DTYPE_BYTES: dict[str, float] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1,
                                        "int4": 0.5}
# GGUF's types as pagedkv holds them (float32 scales and offsets: weight_quant.LOWBIT_FORMATS)
WEIGHT_DTYPE_BYTES |= {"q8_0": Q8_0_BYTES_PER_WEIGHT, "q6_k": LOWBIT_FORMATS["i6"].bytes_per_weight(False),
                       "q5_k": LOWBIT_FORMATS["u5"].bytes_per_weight(True),
                       "q5_0": LOWBIT_FORMATS["i5"].bytes_per_weight(False),
                       "q4_k": LOWBIT_FORMATS["u4"].bytes_per_weight(True),
                       "q4_0": LOWBIT_FORMATS["i4"].bytes_per_weight(False)}
MAX_SUGGESTED_TP = 64


class DoesNotFit(ValueError):
    """The weights leave no room for the KV cache: the message names the smallest ``--tp`` and the
    widest weight format (``--weight-dtype``) with which one ``max_len`` sequence would fit
    (``smallest_tp`` / ``weight_dtype``, None where none does)."""

    def __init__(self, message: str, smallest_tp: int | None, weight_dtype: str | None) -> None:
        super().__init__(message)
        self.smallest_tp, self.weight_dtype = smallest_tp, weight_dtype

    def as_dict(self) -> dict[str, object]:
        return {"fits": False, "error": str(self), "smallest_tp": self.smallest_tp,
                "weight_dtype": self.weight_dtype}
CANDIDATE_BLOCK_SIZES = (16, 32, 64, 128)
MIN_KERNEL_BLOCK = 16
_SAMPLES = 20000


@dataclass(frozen=True, slots=True)
class SizingInputs:
    """What ``pagedkv size`` was asked. ``kv_memory`` (bytes per rank) overrides the device
    budget; ``weight_memory`` (bytes, all ranks) overrides ``param_count * weight_dtype``."""

    device_memory: int | None = None
    kv_memory: int | None = None
    weight_memory: int | None = None
    weight_dtype: str = "bf16"
    reserved_fraction: float = 0.10
    kv_dtype: str = "fp16"
    block_size: int = 16
    max_len: int | None = None
    tp: int = 1
    max_waste: float = 0.02
    kv_sink_blocks: int = 0  # a mixed pool (kv_sink_blocks): that many blocks a sequence at sink_dtype
    sink_dtype: str = "bf16"
    kv_quant_parts: str = "kv"  # "v": an 8-bit kv_dtype holds V alone, K at sink_dtype (the model dtype)

    @property
    def k_dtype(self) -> str | None:
        """K's kind where it is not ``kv_dtype`` (``kv_quant_parts`` "v": ``sink_dtype``)."""
        return self.sink_dtype if self.kv_quant_parts == "v" else None

    def validate(self) -> None:
        try:
            kv_dtype_name(self.kv_dtype)
        except ValueError as e:
            raise ValueError(f"--kv-dtype: {e}") from None
        if self.weight_dtype not in WEIGHT_DTYPE_BYTES:
            raise ValueError(f"--weight-dtype: expected one of {', '.join(WEIGHT_DTYPE_BYTES)}, "
                             f"got {self.weight_dtype!r}")
        if self.device_memory is None and self.kv_memory is None:
            raise ValueError("--device-memory or --kv-memory is required")
        check_block_size(self.block_size, "--block-size")
        check_kv_quant_parts(self.kv_quant_parts, self.kv_dtype, "--kv-quant-parts")
        if self.kv_sink_blocks and kv_dtype_name(self.kv_dtype) not in SCALED_KV_DTYPES:
            raise ValueError(f"--kv-sink-blocks: needs an 8-bit --kv-dtype (int8, fp8, fp8_e5m2), "
                             f"got {self.kv_dtype!r}")
        checks = [
            (self.kv_sink_blocks >= 0, "--kv-sink-blocks", ">= 0", self.kv_sink_blocks),
            (0.0 <= self.reserved_fraction < 1.0, "--reserved-fraction", "in [0, 1)",
             self.reserved_fraction),
            (self.max_len is None or self.max_len >= 1, "--max-len", ">= 1", self.max_len),
            (self.tp >= 1, "--tp", ">= 1", self.tp),
            (0.0 < self.max_waste < 1.0, "--max-waste", "in (0, 1)", self.max_waste),
        ]
        for ok, flag, allowed, value in checks:
            if not ok:
                raise ValueError(f"{flag}: must be {allowed}, got {value}")


@dataclass(slots=True)
class SizingResult:
    """Every figure ``pagedkv size`` prints (all memory figures are per tensor-parallel rank)."""

    model: str
    kv_dtype: str
    block_size: int
    tp: int
    max_len: int
    kv_heads_per_rank: int
    kv_bytes_per_token: int
    scale_bytes_per_block: int
    block_bytes: int
    device_memory: int | None
    weight_memory: int
    reserved_memory: int
    kv_memory: int
    num_blocks: int
    token_capacity: int
    blocks_per_max_len_seq: int
    max_concurrent_at_max_len: int
    distribution: str
    mean_final_len: float
    mean_live_len: float
    max_concurrent_at_mean_final_len: int
    max_concurrent_steady: int
    internal_waste: float
    recommended_block_size: int
    recommendation: str
    block_size_table: list[dict[str, float | int]] = field(default_factory=list)
    # hybrid models: how the layers are grouped, and one max-length sequence's KV against a cache
    # that keeps every layer's history ("" and equal figures otherwise)
    kv_groups: str = ""
    seq_bytes_at_max_len: int = 0
    full_cache_seq_bytes_at_max_len: int = 0
    # --block-size auto: the choice and its reason, as the engine logs it; an explicit size: its
    # warning (pagedkv/block_size.py), or ""
    block_size_choice: str = ""
    # a mixed pool (--kv-sink-blocks): of num_blocks, these hold the sink dtype (block_bytes: the 8-bit ones)
    full_precision_blocks: int = 0
    kv_quant_parts: str = "kv"  # "v": kv_dtype is V's, K at the sink dtype
    full_precision_block_bytes: int = 0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def length_moments(shape: WorkloadShape, max_len: int, seed: int = 0) -> tuple[float, float]:
    """``(mean final length, mean live length)`` of ``shape`` clipped to ``max_len``, by a fixed
    seeded sample. Live length weighs each sequence by its lifetime (its output length)."""
    rng = random.Random(seed)
    final_sum = live_sum = steps = 0.0
    for _ in range(_SAMPLES):
        prompt = shape.prompt.sample(rng, max(1, max_len - 1))
        output = shape.output.sample(rng, max(1, max_len - prompt))
        final_sum += prompt + output
        live_sum += output * (prompt + (output + 1) / 2)
        steps += output
    return final_sum / _SAMPLES, live_sum / steps


def size_kv_cache(spec: ModelShape, inputs: SizingInputs, shape: WorkloadShape) -> SizingResult:
    """Compute every sizing figure. Raises ``ValueError`` (naming the flag) when the inputs are
    invalid or the weights leave no room for KV blocks."""
    inputs.validate()
    B, tp = inputs.block_size, inputs.tp
    max_len = inputs.max_len or spec.max_position_embeddings
    per_token = kv_bytes_per_token(spec, inputs.kv_dtype, tp, inputs.k_dtype)
    scales = scale_bytes_per_block(spec, inputs.kv_dtype, tp, inputs.k_dtype)
    block_bytes = kv_bytes_per_block(spec, B, inputs.kv_dtype, tp, inputs.k_dtype)
    if inputs.weight_memory is not None:
        weights = inputs.weight_memory
    elif spec.weight_bytes is not None:
        weights = spec.weight_bytes
    else:
        weights = int(spec.param_count() * WEIGHT_DTYPE_BYTES[inputs.weight_dtype])
    weights_per_rank = weights // tp
    reserved = int((inputs.device_memory or 0) * inputs.reserved_fraction)
    if inputs.kv_memory is not None:
        kv_memory = inputs.kv_memory
    else:
        assert inputs.device_memory is not None
        kv_memory = inputs.device_memory - reserved - weights_per_rank
        if kv_memory < block_bytes:
            raise _does_not_fit(spec, inputs, weights, reserved, block_bytes, max_len)
    num_blocks = kv_memory // block_bytes
    full_blocks = full_bytes = 0
    if inputs.kv_sink_blocks:  # a mixed pool: the engine's split (model_shape.full_block_fraction)
        full_bytes = kv_bytes_per_block(spec, B, inputs.sink_dtype, tp)
        full_blocks, quant_blocks = mixed_block_split(
            kv_memory, full_bytes, block_bytes, full_block_fraction(inputs.kv_sink_blocks, max_len, B))
        num_blocks = full_blocks + quant_blocks
    blocks_per_seq = kv_blocks_per_sequence(spec, max_len, B)
    mean_final, mean_live = length_moments(shape, max_len)
    table = [_block_size_row(b, spec, inputs, kv_memory, mean_live)
             for b in sorted({MIN_BLOCK_SIZE, 8, *CANDIDATE_BLOCK_SIZES, B, MAX_BLOCK_SIZE})]
    best, reason = recommend_block_size(table, inputs.max_waste, mean_live, spec)
    footprint, waste = steady_footprint(spec, B, mean_live)
    full_cache_block = block_bytes // kv_layer_slots(spec) * spec.num_hidden_layers
    return SizingResult(
        model=spec.name, kv_dtype=inputs.kv_dtype, kv_quant_parts=inputs.kv_quant_parts, block_size=B, tp=tp,
        max_len=max_len,
        kv_heads_per_rank=kv_heads_per_rank(spec, tp),
        kv_bytes_per_token=per_token, scale_bytes_per_block=scales, block_bytes=block_bytes,
        device_memory=inputs.device_memory, weight_memory=weights_per_rank,
        reserved_memory=reserved, kv_memory=kv_memory, num_blocks=num_blocks,
        token_capacity=num_blocks * B, blocks_per_max_len_seq=blocks_per_seq,
        max_concurrent_at_max_len=num_blocks // blocks_per_seq, distribution=shape.name,
        mean_final_len=mean_final, mean_live_len=mean_live,
        max_concurrent_at_mean_final_len=int(num_blocks // kv_blocks_per_sequence(spec, math.ceil(mean_final), B)),
        max_concurrent_steady=int(num_blocks * B / footprint),
        internal_waste=waste / footprint,
        recommended_block_size=best, recommendation=reason, block_size_table=table,
        kv_groups=describe_groups(spec), seq_bytes_at_max_len=blocks_per_seq * block_bytes,
        full_cache_seq_bytes_at_max_len=math.ceil(max_len / B) * full_cache_block,
        full_precision_blocks=full_blocks, full_precision_block_bytes=full_bytes)


def _does_not_fit(spec: ModelShape, inputs: SizingInputs, weights: int, reserved: int, block_bytes: int,
                  max_len: int) -> DoesNotFit:
    """The error for weights that leave no KV block, with what would fit: the smallest ``--tp``
    (the same weights split across ranks, each rank's KV heads too) and the widest weight format at
    this ``--tp``, each leaving room for one ``max_len`` sequence."""
    assert inputs.device_memory is not None
    budget = inputs.device_memory - reserved

    def room(tp: int, weight_bytes: int) -> bool:
        try:
            seq = kv_blocks_per_sequence(spec, max_len, inputs.block_size) * kv_bytes_per_block(
                spec, inputs.block_size, inputs.kv_dtype, tp, inputs.k_dtype)
        except ValueError:  # a --tp that does not divide the model's heads
            return False
        return budget - weight_bytes // tp >= seq
    tp = next((t for t in range(inputs.tp + 1, MAX_SUGGESTED_TP + 1) if room(t, weights)), None)
    params = spec.param_count()
    current = weights / max(1, params)  # bytes a weight now (a file's own size counts its format)
    dtype = next((d for d, b in sorted(WEIGHT_DTYPE_BYTES.items(), key=lambda kv: -kv[1])
                  if b < current and room(inputs.tp, int(params * b))), None)
    options = []
    if tp is not None:
        options.append(f"--tp {tp} ({weights // tp:,} bytes of weights per rank)")
    if dtype is not None:
        options.append(f"{dtype} weights at --tp {inputs.tp} (--weight-dtype {dtype}: "
                       f"{int(params * WEIGHT_DTYPE_BYTES[dtype]):,} bytes)")
    fix = (f"it would fit (one {max_len}-token sequence) with " + " or with ".join(options) if options else
           f"no --tp up to {MAX_SUGGESTED_TP} nor weight format fits one {max_len}-token sequence: raise "
           "--device-memory or lower --max-len")
    return DoesNotFit(f"--device-memory: {inputs.device_memory:,} bytes minus the reserved {reserved:,} and "
                      f"{weights // inputs.tp:,} bytes of weights per rank leave no room for one "
                      f"{block_bytes:,}-byte KV block; {fix}", tp, dtype)


def steady_footprint(spec: ModelShape, block_size: int, mean_live: float) -> tuple[float, float]:
    """``(slots, empty slots)`` one running sequence of mean live length holds, counted in token
    slots of blocks (a hybrid model's summed over its groups, whose blocks each hold fewer
    layers; see the module docstring)."""
    tail = (block_size - 1) / 2
    if not spec.is_hybrid:
        return mean_live + tail, tail
    slots = waste = 0.0
    for group in kv_groups(spec):
        if group.window is None or mean_live <= group.window:
            slots, waste = slots + mean_live + tail, waste + tail
        else:  # the window, its first block's out-of-window part and the last block's empty slots
            slots, waste = slots + group.window + 2 * tail, waste + 2 * tail
    return slots, waste


def describe_groups(spec: ModelShape) -> str:
    """A hybrid model's KV groups in words ("" for one group of every layer)."""
    groups = kv_groups(spec)
    if len(groups) == 1:
        return ""
    full = sum(1 for g in groups if g.window is None)
    windows = sorted({g.window for g in groups if g.window is not None})
    return (f"{full} full + {len(groups) - full} sliding (window {', '.join(map(str, windows))}), "
            f"{kv_layer_slots(spec)} layers per block")


def _block_size_row(b: int, spec: ModelShape, inputs: SizingInputs, kv_memory: int,
                    mean_live: float) -> dict[str, float | int]:
    block_bytes = kv_bytes_per_block(spec, b, inputs.kv_dtype, inputs.tp, inputs.k_dtype)
    blocks = kv_memory // block_bytes
    footprint, waste = steady_footprint(spec, b, mean_live)
    return {"block_size": b, "block_bytes": block_bytes, "num_blocks": blocks,
            "internal_waste": waste / footprint,
            "max_concurrent_steady": int(blocks * b / footprint)}


def recommend_block_size(table: list[dict[str, float | int]], max_waste: float, mean_live: float,
                         spec: ModelShape) -> tuple[int, str]:
    """The largest of 16/32/64/128 whose steady-state internal waste stays within ``max_waste``
    (16 when none does), with the reasoning as one paragraph.

    Why these bounds: attention kernels read KV in tiles of at least 16 tokens, so smaller blocks
    leave tiles part-empty and add block-table lookups (the vLLM paper measured 1-8 slower);
    larger blocks mean fewer, bigger swap/copy transfers and shorter block tables, but waste
    ``(B-1)/2`` slots per running sequence and share prefixes only in whole blocks.
    """
    rows = {int(r["block_size"]): r for r in table}
    fitting = [b for b in CANDIDATE_BLOCK_SIZES if rows[b]["internal_waste"] <= max_waste]
    best = max(fitting) if fitting else MIN_KERNEL_BLOCK
    waste = rows[best]["internal_waste"]
    parts = [f"block size {best}: a sequence wastes {(best - 1) / 2:.1f} slots on average in its "
             f"last block, {waste:.1%} of the KV in use at a mean live length of {mean_live:.0f} "
             f"tokens"]
    bigger = [b for b in CANDIDATE_BLOCK_SIZES if b > best]
    if bigger:
        nxt = bigger[0]
        parts.append(f"{nxt} would waste {rows[nxt]['internal_waste']:.1%} (target "
                     f"<= {max_waste:.0%}, --max-waste)")
    if best > MIN_KERNEL_BLOCK:
        parts.append(f"larger blocks halve block-table entries and make swap/CoW copies "
                     f"{rows[best]['block_bytes'] / 1024:.0f} KiB each")
    parts.append(f"blocks below {MIN_KERNEL_BLOCK} underfill the attention kernel's "
                 f"{MIN_KERNEL_BLOCK}-token tiles")
    parts.append("prefix caching shares whole blocks only, so a shared prompt loses up to "
                 f"{best - 1} tokens of reuse")
    if spec.is_mla:
        parts.append("MLA kernels such as FlashMLA need block size 64")
    return best, "; ".join(parts) + "."
