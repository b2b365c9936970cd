"""The KV block size: ``"auto"`` (the choice from the model, the context and the device) and the
warnings an explicit size can earn.

Pure Python: the engine (``engine/build.py``) and ``pagedkv size`` (``sim/cli.py``) call the same
:func:`choose_block_size`, so the size ``pagedkv size MODEL --block-size auto`` prints is the one
``pagedkv serve MODEL`` runs with on that device and context.

The choice, in order (each step is named in the reason that is logged)::

    1. the device's measured preference    pagedkv/block_size_table.json, made by
       at the context served               `bench/attention.py --block-size-sweep --write`: per
                                           context length, the block >= 16 with the least decode
                                           time per token held, its tail's empty slots counted
                                           (:func:`preferred_block_size`; a row from reasoning,
                                           marked so, where nothing was measured). With a
                                           workload profile (``block_size_seq_len``: its typical
                                           running length) the times measured nearest below that
                                           length, weighed at that length, instead of the
                                           max_model_len row
    2. latent (MLA) models                 the device row's "mla" size, where its kernels take
                                           only that one (FlashMLA and vLLM's MLA backends on
                                           CUDA: 64); the rules below do not apply then
    3. head dims                           the measured size is a number of bytes read per block
                                           lookup (block * kv_heads * head_dim at the measured
                                           shape): a model with more bytes per token gets the
                                           smaller measured size whose bytes come nearest; never
                                           a larger one (a size above the measured preference
                                           was not measured to pay at any shape, and its tail
                                           waste is certain)
    4. sliding-window groups               at most window / 8: a sliding group holds window / B + 1
                                           blocks and frees them whole, so B beyond that keeps up
                                           to B out-of-window tokens per sequence
    5. short contexts                      at most max_model_len / 4: a longest sequence spans at
                                           least 4 blocks (waste stays <= 1/8 of a sequence)
    never below 16 (AUTO_MIN_BLOCK_SIZE: the kernels' tiles), never above 64 (AUTO_MAX_BLOCK_SIZE):
    prefix caching shares whole blocks only, so a larger block loses up to B - 1 tokens of every
    shared prompt, and the study in docs/block_size.md measures paged@64 already holding fewer
    sequences than paged@16 on ShareGPT-like traffic; a measured preference above 64 (long
    contexts on the CPU) is capped there and said in the reason.

Why not 16 for everything: the CPU kernel chases one block-table pointer per block, so at long
contexts larger blocks measure faster (the table), while a short-context model wastes up to
``B - 1`` slots per sequence for nothing; and the GPU MLA kernels take 64 only.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.model_shape import ModelShape, check_block_size, kv_groups

AUTO = "auto"
DEVICE_KINDS = ("cpu", "cuda")  # the table's keys, as torch names the device types
AUTO_MIN_BLOCK_SIZE = 16       # "auto" never picks below the kernels' 16-token tiles
AUTO_MAX_BLOCK_SIZE = 64       # ... nor above 64: prefix-sharing granularity and tail waste
PREFERENCE_TOLERANCE = 0.03    # within 3% counts as a tie, won by the smaller block
LONG_CONTEXT = 8192            # beyond this, an explicit block below 16 earns a warning
TINY_BLOCK = 4                 # an explicit block below this earns a warning at any context
SLIDING_BLOCKS_PER_WINDOW = 8
MIN_BLOCKS_PER_MAX_LEN = 4
TABLE_PATH = Path(__file__).with_name("block_size_table.json")


@dataclass(frozen=True, slots=True)
class Device:
    """What the choice knows of a device: its kind (``cpu``, ``cuda``; the table's keys) and a
    name for the log (a GPU's, e.g. ``NVIDIA H100 80GB HBM3``)."""

    kind: str
    name: str = ""

    def __str__(self) -> str:
        return f"{self.kind} ({self.name})" if self.name else self.kind


@dataclass(frozen=True, slots=True)
class BlockSizeChoice:
    """The block size ``"auto"`` resolved to, and why (one sentence per rule that applied)."""

    block_size: int
    reason: str

    def __str__(self) -> str:
        return f"block_size auto -> {self.block_size}: {self.reason}"


def is_auto(block_size: object) -> bool:
    return block_size == AUTO


def parse_block_size(text: str) -> int | str:
    """A ``--block-size`` flag's value: ``auto`` or an integer (argparse ``type``); the bounds are
    checked where the value is used (``EngineConfig``, ``pagedkv size``)."""
    if text == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"expected an integer or {AUTO!r}, got {text!r}") from None


def check_block_size_setting(block_size: object, name: str = "block_size") -> int | str:
    """``block_size`` as the engine and ``pagedkv size`` accept it: ``"auto"`` or an integer in
    the bounds of :func:`pagedkv.model_shape.check_block_size`. ValueError names ``name`` and
    both forms."""
    if is_auto(block_size):
        return AUTO
    try:
        return check_block_size(block_size, name)
    except ValueError as exc:
        raise ValueError(f"{exc} (or {AUTO!r}: chosen for the model, context and device)") from None


def preferred_block_size(ctx: int, relative_time: dict[int, float]) -> int:
    """The table's preference at context ``ctx`` from each block size's measured decode time
    (relative to block 16's): the size >= 16 with the least time per token *held*, where a block
    of B keeps ``(B - 16) / 2`` more empty slots than block 16 on average in a sequence's last
    block (``time * (1 + (B - 16) / (2 * ctx))``); sizes within 3% of the least tie, and the
    smallest of them wins (it also shares prefixes more finely). So a larger block is chosen
    only when its kernel is faster by more than the memory its tail wastes at that context."""
    cost = {b: t * (1 + (b - AUTO_MIN_BLOCK_SIZE) / (2 * ctx)) for b, t in relative_time.items()
            if b >= AUTO_MIN_BLOCK_SIZE}
    best = min(cost.values())
    return min(b for b, c in cost.items() if c <= best * (1 + PREFERENCE_TOLERANCE))


def load_table(path: Path = TABLE_PATH) -> dict[str, dict[str, Any]]:
    """The per-device rows of the committed table (``{"cpu": {...}, "cuda": {...}}``)."""
    return dict(json.loads(path.read_text())["devices"])


def write_device_row(kind: str, row: dict[str, Any], path: Path = TABLE_PATH) -> Path:
    """Store ``row`` as the table's ``kind`` entry, keeping the other rows (the benchmark's
    ``--write``). Returns the path written."""
    data = json.loads(path.read_text())
    data["devices"][kind] = row
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def choose_block_size(shape: ModelShape, max_model_len: int, device: Device,
                      table: dict[str, dict[str, Any]] | None = None, *,
                      seq_len: int | None = None) -> BlockSizeChoice:
    """What ``block_size="auto"`` resolves to for ``shape`` served at ``max_model_len`` tokens on
    ``device`` (rules: the module docstring). ``seq_len``, a workload profile's typical running
    sequence length (``block_size_seq_len``), replaces max_model_len in rule 1: the kernel's
    measured times at that length, weighed against tail waste at that length
    (:func:`preferred_block_size`). ``table`` defaults to the committed one; a device kind it lacks
    gets 16, said in the reason."""
    rows = load_table() if table is None else table
    row = rows.get(device.kind)
    if row is None:
        return BlockSizeChoice(AUTO_MIN_BLOCK_SIZE, f"no measured preference for device {device} in "
                                                    f"{TABLE_PATH.name}; the kernels' minimum tile")
    ctx, size = _preferred_at(row, seq_len or max_model_len)
    measured = "measured" if row.get("source") == "measured" else "from reasoning, not measured"
    times = row.get("relative_time", {}).get(str(ctx))
    if seq_len is not None and times:
        size = preferred_block_size(seq_len, {int(b): float(t) for b, t in times.items()})
        reasons = [f"{device}: for sequences of about {seq_len} tokens (block_size_seq_len), the kernel's "
                   f"times measured at {ctx} tokens against the tail's empty slots give {size} ({measured}; "
                   f"{TABLE_PATH.name})"]
    else:
        reasons = [f"{device}: the kernel's preference for {ctx}-token contexts is {size} ({measured}; "
                   f"{TABLE_PATH.name})"]
    if shape.is_mla and row.get("mla"):  # what the device's latent kernels take: no cap applies
        reasons.append(f"latent (MLA) cache: {row.get('mla_why', 'its kernels take this size')}")
        return BlockSizeChoice(int(row["mla"]), "; ".join(reasons))
    size = _scaled_for_heads(row, size, shape, reasons)
    # A hybrid model's sliding groups free blocks; a model-wide window (mistral) is one group
    # kept whole (applied as a mask), so it does not bound the size.
    windows = [g.window for g in kv_groups(shape) if g.window is not None]
    if windows:
        cap = _pow2_at_most(min(windows) // SLIDING_BLOCKS_PER_WINDOW)
        if cap < size:
            size = cap
            reasons.append(f"sliding window {min(windows)}: at most window/{SLIDING_BLOCKS_PER_WINDOW} so a "
                           f"sliding group frees its blocks within {SLIDING_BLOCKS_PER_WINDOW}ths of the window")
    cap = _pow2_at_most(max_model_len // MIN_BLOCKS_PER_MAX_LEN)
    if cap < size:
        size = cap
        reasons.append(f"max_model_len {max_model_len}: a longest sequence spans at least "
                       f"{MIN_BLOCKS_PER_MAX_LEN} blocks")
    final = min(AUTO_MAX_BLOCK_SIZE, max(AUTO_MIN_BLOCK_SIZE, size))
    if final != size:
        reasons.append(f"kept within [{AUTO_MIN_BLOCK_SIZE}, {AUTO_MAX_BLOCK_SIZE}] (the kernels' tiles below; "
                       f"prefix sharing in whole blocks and tail waste above)")
    return BlockSizeChoice(final, "; ".join(reasons))


def block_size_warning(block_size: int, max_model_len: int, device: Device | None = None,
                       table: dict[str, dict[str, Any]] | None = None) -> str | None:
    """The warning an explicit ``block_size`` earns (None: none): below 4 at any context, or below
    16 with contexts beyond 8k tokens. It names the cost: block-table entries of a longest
    sequence and, where the device row measured it, the kernel's time against block 16."""
    long = max_model_len > LONG_CONTEXT
    if block_size >= TINY_BLOCK and not (long and block_size < AUTO_MIN_BLOCK_SIZE):
        return None
    entries = math.ceil(max_model_len / block_size)
    cost = (f"block_size {block_size}: a {max_model_len}-token sequence holds {entries:,} blocks "
            f"({entries // math.ceil(max_model_len / AUTO_MIN_BLOCK_SIZE)}x block 16's), and decode attention "
            f"looks up one block-table entry per block")
    measured = _measured_slowdown(block_size, max_model_len, device, table)
    if measured is not None:
        ctx, slower = measured
        cost += f"; the {device} kernel measured {slower:.2f}x block 16's decode time at {ctx} tokens"
    why = "below 4 tokens" if block_size < TINY_BLOCK else f"below 16 with contexts beyond {LONG_CONTEXT} tokens"
    return f"{cost} ({why}); use block_size {AUTO_MIN_BLOCK_SIZE} or more, or {AUTO!r}"


def _preferred_at(row: dict[str, Any], max_model_len: int) -> tuple[int, int]:
    """(context, size): the row's preference at the longest measured context <= max_model_len
    (the shortest measured one when max_model_len is below them all)."""
    prefs = sorted((int(ctx), int(size)) for ctx, size in row["preferred"].items())
    fitting = [p for p in prefs if p[0] <= max_model_len]
    return fitting[-1] if fitting else prefs[0]


def _scaled_for_heads(row: dict[str, Any], size: int, shape: ModelShape, reasons: list[str]) -> int:
    """``size`` moved to the measured size whose bytes per block lookup come nearest the
    measured shape's (rule 3); unchanged when the row names no shape."""
    measured = row.get("shape")
    if not measured:
        return size
    if shape.is_mla:  # one latent per token and layer
        per_token = (shape.kv_lora_rank or 0) + (shape.qk_rope_head_dim or 0)
        what = f"a {per_token}-wide latent"
    else:
        per_token = 2 * shape.num_key_value_heads * shape.head_dim
        what = f"K and V of {shape.num_key_value_heads} KV heads x head_dim {shape.head_dim}"
    at_measured = 2 * int(measured["kv_heads"]) * int(measured["head_dim"])
    if per_token == at_measured:
        return size
    sizes = sorted({int(s) for rel in row.get("relative_time", {}).values() for s in rel
                    if int(s) >= AUTO_MIN_BLOCK_SIZE} | {size})
    target = size * at_measured / per_token
    if target >= size:  # fewer bytes per token than measured: keep the measured size (rule 3)
        return size
    scaled = min((s for s in sizes if s <= size), key=lambda s: (abs(math.log2(s / target)), s))
    if scaled != size:
        reasons.append(f"{what} per token and layer against the measured {measured['kv_heads']} x "
                       f"{measured['head_dim']}: {scaled} reads the measured bytes per block lookup")
    return scaled


def _measured_slowdown(block_size: int, max_model_len: int, device: Device | None,
                       table: dict[str, dict[str, Any]] | None) -> tuple[int, float] | None:
    """(context, decode time of ``block_size`` / block 16's) at the longest measured context
    <= max_model_len, where the device row measured it."""
    if device is None:
        return None
    row = (load_table() if table is None else table).get(device.kind) or {}
    times = row.get("relative_time") or {}
    if not times:
        return None
    ctx = max((int(c) for c in times if int(c) <= max_model_len), default=min(int(c) for c in times))
    value = times[str(ctx)].get(str(block_size))
    return None if value is None else (ctx, float(value))


def _pow2_at_most(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1) if n >= 1 else 1
