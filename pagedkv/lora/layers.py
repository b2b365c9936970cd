"""The LoRA transform: a wrapper around each adaptable linear layer, adapters in preallocated slots.

The model code is untouched (STYLE habit 13): ``apply_lora`` swaps every layer's ``qkv_proj``,
``o_proj``, ``gate_up_proj`` and ``down_proj`` (float, input-major or Q8_0: whatever the loader
and the runner put there) for a ``LoRALinear`` holding the base module and ``max_loras`` slots::

    lora_a  [max_loras, parts * max_rank, in]     slot s: the adapter's A rows of every fused part
    lora_bt [max_loras, parts * max_rank, out]    slot s: its B^T (scale folded in), each part's
                                                  columns only on that part's output rows

so loading an adapter is a copy into a slot and a fused layer's adapters (q, k, v) are one pair of
matmuls. Each step the runner hands the rows of each slot (``LoRABatch.ranges``: the chunks are
ordered by slot, so an adapter's rows are one run) and every wrapper adds, per run,

    y[s:e] += (x[s:e] @ A_slot^T) @ B_slot^T          (rows of the base model: nothing added)

never merging weights: rows of many adapters and of the base model share the base matmul (a fused
layer's parts each onto their own output rows: the zeros of B^T elsewhere cost nothing). When the
runs are of equal length, back to back, in consecutive slots (a decode batch spread evenly over
the adapters: the common case), the products of all runs are two batched matmuls instead of two
per run (``LoRABatch.uniform``): on one CPU thread a small matmul costs about as much in call
overhead as in arithmetic, and this cuts the adapters' extra time per layer by about a third.

On a tensor-parallel rank's shard (``models/sharding.py``) every rank gets the whole adapter and
keeps its part (``shard_parts``): on a column-parallel layer (q/k/v, gate/up) A whole and the rows
of B on the rank's output rows; on a row-parallel one (o, down) the rank's columns of A and B
whole (the partial products are summed with the layer's own output by its ``all_reduce``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.lora.adapter import FUSED_PARTS, LoRAPart, LoRAWeights
from pagedkv.models.sharding import Split, param_split


@dataclass(slots=True)
class LoRABatch:
    """The step's rows per slot: ``(slot, first row, end row)`` runs of the flattened tokens, and
    ``uniform`` = (first slot, runs, first row, rows per run) when the runs are of one length,
    back to back, in consecutive slots (else None)."""

    ranges: tuple[tuple[int, int, int], ...] = ()
    uniform: tuple[int, int, int, int] | None = None

    def set(self, ranges: tuple[tuple[int, int, int], ...]) -> None:
        self.ranges = ranges
        self.uniform = None
        if len(ranges) > 1:
            slot0, start, end = ranges[0]
            k = end - start
            if all(r == (slot0 + i, start + i * k, start + (i + 1) * k) for i, r in enumerate(ranges)):
                self.uniform = (slot0, len(ranges), start, k)


class LoRALinear(nn.Module):
    """``base(x)`` plus each slot's low-rank product on that slot's rows (see the module doc)."""

    lora_a: torch.Tensor  # [slots, width, in] (a buffer: declared so its type is not nn.Module's __getattr__)
    lora_bt: torch.Tensor  # [slots, width, out]

    def __init__(self, base: nn.Module, parts: int, max_loras: int, max_rank: int, batch: LoRABatch,
                 dtype: torch.dtype, device: torch.device, split: Split | None = None) -> None:
        super().__init__()
        self.base = base
        self.split = split  # a tensor-parallel rank's part of the layer (None: all of it)
        # nn.Module's __getattr__ is typed Tensor | Module; every wrapped linear layer has int features
        self.in_features: int = base.in_features  # type: ignore[assignment]
        self.out_features: int = base.out_features  # type: ignore[assignment]
        width = parts * max_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, width, self.in_features, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("lora_bt", torch.zeros(max_loras, width, self.out_features, dtype=dtype, device=device),
                             persistent=False)
        self.width = [0] * max_loras  # columns in use per slot (the adapter's ranks summed)
        # per slot: (first column, end column, first output row, end output row) of each part
        self.parts: list[tuple[tuple[int, int, int, int], ...]] = [()] * max_loras
        self.batch = batch

    def set_slot(self, slot: int, parts: list[LoRAPart]) -> None:
        """Fill ``slot`` with ``parts`` (empty: this adapter leaves the layer alone); parts name the
        whole layer's rows (a tensor-parallel rank keeps its own: :func:`shard_parts`)."""
        if self.split is not None:
            parts = shard_parts(parts, self.split)
        self.lora_a[slot].zero_()
        self.lora_bt[slot].zero_()
        col = 0
        spans = []
        for p in parts:
            r = p.a.shape[0]
            self.lora_a[slot, col:col + r] = p.a.to(self.lora_a.dtype)
            self.lora_bt[slot, col:col + r, p.row_start:p.row_end] = p.b.t().to(self.lora_bt.dtype)
            spans.append((col, col + r, p.row_start, p.row_end))
            col += r
        self.width[slot] = col
        self.parts[slot] = tuple(spans)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] -> [T, out]
        y = self.base(x)
        if self.batch.uniform is not None:
            s0, n, start, k = self.batch.uniform
            w = max(self.width[s0:s0 + n])
            if w:  # slots' columns past their width are zero: a common width w is exact
                xs = x[start:start + n * k].reshape(n, k, self.in_features)  # [runs, rows, in]
                h = torch.bmm(xs, self.lora_a[s0:s0 + n, :w].transpose(1, 2))  # [runs, rows, w]
                ys = y[start:start + n * k].view(n, k, self.out_features)
                parts = self.parts[s0]
                if len(parts) > 1 and all(self.parts[s] == parts for s in range(s0 + 1, s0 + n)):
                    # the same parts in every slot: each onto its rows (a quarter less time on the
                    # default model's q/k/v and gate/up at decode: the zeros of B^T are not read)
                    for c0, c1, r0, r1 in parts:
                        ys[:, :, r0:r1].baddbmm_(h[:, :, c0:c1], self.lora_bt[s0:s0 + n, c0:c1, r0:r1])
                else:
                    ys.baddbmm_(h, self.lora_bt[s0:s0 + n, :w])
            return y
        for slot, s, e in self.batch.ranges:
            w = self.width[slot]
            if not w:
                continue
            h = F.linear(x[s:e], self.lora_a[slot, :w])  # [rows, w]
            parts = self.parts[slot]
            if len(parts) == 1 and parts[0][2:] == (0, self.out_features):
                y[s:e].addmm_(h, self.lora_bt[slot, :w])
            else:  # each part onto its own output rows: B^T's zeros elsewhere are not multiplied
                for c0, c1, r0, r1 in parts:
                    y[s:e, r0:r1].addmm_(h[:, c0:c1], self.lora_bt[slot, c0:c1, r0:r1])
        return y

    def extra_repr(self) -> str:
        slots, width = self.lora_a.shape[:2]
        return f"slots={slots}, width={width}"


class LoRAStack:
    """The wrappers of one model and the step's ``LoRABatch`` they read (owned by the runner)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_rank}")
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.batch = LoRABatch()
        self.layers: dict[str, LoRALinear] = {}  # "layers.3.self_attn.qkv_proj" -> wrapper
        ref = next(model.parameters())
        dtype = ref.dtype if ref.dtype.is_floating_point else torch.float32
        tp, full = getattr(model, "tp", None), getattr(model, "full_config", None)  # a rank's shard
        for i, layer in enumerate(getattr(model, "layers", ())):  # checked before anything is wrapped
            for suffix in FUSED_PARTS:
                parent_name, child = suffix.split(".")
                if getattr(getattr(layer, parent_name), child, None) is None:  # models/moe.py, models/mla.py
                    raise ValueError(f"enable_lora: layer {i} has no {suffix} (a mixture-of-experts or latent-"
                                     "attention layer); LoRA slots are not supported on this model: leave "
                                     "enable_lora off")
        for i, layer in enumerate(getattr(model, "layers", ())):
            for suffix, parts in FUSED_PARTS.items():
                parent_name, child = suffix.split(".")
                parent = getattr(layer, parent_name)
                base = getattr(parent, child)
                if isinstance(base, LoRALinear):
                    raise ValueError("apply_lora: the model already carries LoRA slots")
                split = param_split(full, f"layers.{i}.{suffix}.weight", tp) if full is not None else None
                wrapper = LoRALinear(base, parts, max_loras, max_rank, self.batch, dtype, ref.device, split)
                setattr(parent, child, wrapper)
                self.layers[f"layers.{i}.{suffix}"] = wrapper

    def set_slot(self, slot: int, weights: LoRAWeights | None) -> None:
        """Load ``weights`` into ``slot`` (None: empty it). Modules it does not adapt are zeroed."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot} out of range 0..{self.max_loras - 1}")
        modules = weights.modules if weights is not None else {}
        if weights is not None and (unknown := set(modules) - set(self.layers)):
            raise ValueError(f"adapter {weights.name!r} adapts modules this model lacks: {sorted(unknown)[:3]}")
        with torch.inference_mode():
            for name, layer in self.layers.items():
                layer.set_slot(slot, modules.get(name, []))

    @contextmanager
    def step(self, ranges: tuple[tuple[int, int, int], ...]) -> Iterator[None]:
        """The rows of each slot while one forward pass runs (then none again)."""
        self.batch.set(ranges)
        try:
            yield
        finally:
            self.batch.set(())


def shard_parts(parts: list[LoRAPart], split: Split) -> list[LoRAPart]:
    """A tensor-parallel rank's share of a layer's adapter ``parts`` (rows of the whole layer):
    column-parallel (``split.dim`` 0), each part's B rows on the rank's output rows, at their local
    rows, A whole (a part over several runs, Phi-3's fused q/k/v, becomes one part per run);
    row-parallel (dim 1), the rank's columns of A, B whole."""
    out = []
    for p in parts:
        if split.dim == 1:
            seg = split.segments[0]
            out.append(LoRAPart(p.row_start, p.row_end, p.a[:, seg.rank_start:seg.rank_end].contiguous(), p.b))
            continue
        for seg in split.segments:
            a, b = max(seg.rank_start, p.row_start), min(seg.rank_end, p.row_end)
            if a < b:
                local = seg.local + a - seg.rank_start
                out.append(LoRAPart(local, local + b - a, p.a, p.b[a - p.row_start:b - p.row_start].contiguous()))
    return out


def apply_lora(model: nn.Module, max_loras: int, max_rank: int) -> LoRAStack:
    """Wrap ``model``'s adaptable linears with ``max_loras`` empty slots of rank ``max_rank``."""
    return LoRAStack(model, max_loras, max_rank)
