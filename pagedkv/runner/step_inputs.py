"""Flatten a list of ``SeqChunk`` into the tensors one forward pass needs, built once per step.

Token order is chunk order: chunk 0's tokens, then chunk 1's, ...

With the native kernel (``native=True``), decodes and prefill chunks over a cached prefix are all
attended by one call per layer that reads blocks in place (``NativeMetadata``: each row's sequence
and visible length); only prefill chunks without a cached prefix go to torch's flash SDPA over
their own fresh K/V. Without it (the plain PyTorch path), decode chunks (one token) are
batched into few paged-attention calls: sorted by context length and cut into at most
``MAX_DECODE_GROUPS`` groups where that saves more padded slots than a group costs, because the
padded slots are what decode attention spends its time reading. Prefill chunks (several tokens)
each get their own call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedkv.errors import PagedKVError
from pagedkv.ops.cascade import CascadePlan, find_shared_runs
from pagedkv.ops.paged_attention import DecodeMetadata, NativeMetadata
from pagedkv.runner.batch import SeqChunk


class BatchError(PagedKVError, ValueError):
    """A step's chunks are malformed (empty chunk, block table too short, bad block id)."""


@dataclass(slots=True)
class PrefillItem:
    """One prefill chunk's rows ``[start, end)`` of the flattened tokens."""

    start: int
    end: int
    start_pos: int
    block_table: torch.Tensor  # [num_blocks_used] int64


MAX_DECODE_GROUPS = 4
GROUP_COST_SLOTS = 256  # a group's fixed per-layer cost (~6 small ops), in padded slots


@dataclass(slots=True)
class DecodeGroup:
    """Decode tokens attended together: their rows of the flattened tokens and shared metadata."""

    rows: torch.Tensor  # [B_g] int64
    meta: DecodeMetadata


def split_decode_groups(lens: list[int], max_groups: int = MAX_DECODE_GROUPS,
                        group_cost: int = GROUP_COST_SLOTS, max_cuts: int = 32) -> list[list[int]]:
    """Indices into ``lens`` grouped to minimise sum(len(group) * max_len(group)) + cost per group.

    Dynamic programme over the sequences sorted by length; cuts are only considered at up to
    ``max_cuts`` evenly spaced places, so a step of 256 decodes costs a few thousand operations.
    """
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    n = len(order)
    stride = max(1, -(-n // max_cuts))
    cuts = sorted(set(range(0, n, stride)) | {n})  # candidate group boundaries
    inf = float("inf")
    # best[g][c]: cheapest split of the first cuts[c] sorted sequences into g groups; back[g][c]: previous cut
    best = [[inf] * len(cuts) for _ in range(max_groups + 1)]
    back = [[0] * len(cuts) for _ in range(max_groups + 1)]
    best[0][0] = 0.0
    for g in range(1, max_groups + 1):
        for c in range(1, len(cuts)):
            j = cuts[c]
            for b in range(c):
                cost = best[g - 1][b] + (j - cuts[b]) * lens[order[j - 1]] + group_cost
                if cost < best[g][c]:
                    best[g][c], back[g][c] = cost, b
    last = len(cuts) - 1
    g = min(range(1, max_groups + 1), key=lambda k: best[k][last])
    groups: list[list[int]] = []
    c = last
    while g > 0:
        b = back[g][c]
        groups.append(order[cuts[b]:cuts[c]])
        c, g = b, g - 1
    return groups[::-1]


@dataclass(slots=True)
class TritonMetadata:
    """Per-step inputs of the Triton kernels (``ops/triton``), on the runner's device, shared by
    every layer: one block-table row per chunk; decode rows (one token) by their visible length
    (0 for the other rows); prefill chunks (several tokens) by their rows and first position."""

    block_tables: torch.Tensor  # [chunks, max_blocks] int32
    row_seq: torch.Tensor  # [T] int32: each row's chunk
    row_len: torch.Tensor  # [T] int32: a decode row's visible length, else 0
    chunk_seq: torch.Tensor  # [P] int32: prefill chunks' rows of block_tables
    chunk_row_start: torch.Tensor  # [P] int32
    chunk_num_rows: torch.Tensor  # [P] int32
    chunk_start_pos: torch.Tensor  # [P] int32
    num_decode: int
    num_prefill: int


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [sum(c.num_logits)] int64: each chunk's last token (or all its tokens)
    max_position: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillItem]
    identity_decode: bool  # one decode group covering every token in order: its output is the output
    native: NativeMetadata | None = None  # the native kernel's rows (then no decode groups)
    triton: TritonMetadata | None = None  # the Triton kernels' rows and chunks (then neither of the above)
    # the runs of blocks several rows hold at the same positions, attended once (ops/cascade.py);
    # native and Triton decode rows only, None when nothing is shared or cascade is off
    cascade: CascadePlan | None = None
    # a hybrid model's KV groups after the first: their own slots, tables and metadata
    other_groups: list[StepInputs] = field(default_factory=list)
    # LoRA: (slot, first row, end row) runs of rows computed by one adapter (pagedkv/lora/layers.py)
    lora_ranges: tuple[tuple[int, int, int], ...] = ()

    def group(self, g: int) -> StepInputs:
        """The inputs of KV group ``g``'s layers."""
        return self if g == 0 else self.other_groups[g - 1]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_step_inputs(chunks: list[SeqChunk], *, block_size: int, num_blocks: int, num_heads: int,
                      kv_heads: int, head_dim: int, dtype: torch.dtype,
                      sliding_window: int | None = None, native: bool = False,
                      fresh_from_cache: bool = False, triton: bool = False,
                      device: torch.device | str = "cpu", cascade: bool = False) -> StepInputs:
    """Validate ``chunks`` and build every index the step's 30-odd layers share.

    ``cascade`` (native and Triton): find the runs of blocks several sequences hold at the same
    positions (``ops/cascade.py``), once here for every layer, so the kernels attend each run
    once for all its rows.

    ``fresh_from_cache`` (native only; the runner sets it for 8-bit blocks): prefill chunks
    without a cached prefix also attend through the kernel, to the K/V as stored, so every token
    sees the same values whether it was computed in a prefill, a decode or a recompute."""
    if not chunks:
        raise BatchError("execute() needs at least one chunk")
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    last_rows: list[int] = []
    dec_rows: list[int] = []
    dec_tables: list[list[int]] = []
    dec_lens: list[int] = []
    prefills: list[PrefillItem] = []
    tables: list[list[int]] = []  # native: one per chunk
    row_seq: list[int] = []
    row_len: list[int] = []
    lora_ranges: list[tuple[int, int, int]] = []
    raw_tables: list[list[int]] = []  # cascade: each chunk's table as given (-1: released)
    for i, c in enumerate(chunks):
        n = len(c.token_ids)
        if n == 0:
            raise BatchError(f"chunk {i} has no tokens")
        if c.start_pos < 0:
            raise BatchError(f"chunk {i} has start_pos {c.start_pos} < 0")
        ctx = c.start_pos + n
        needed = (ctx + block_size - 1) // block_size
        if len(c.block_table) < needed:
            raise BatchError(
                f"chunk {i}: block table has {len(c.block_table)} blocks, {needed} needed for "
                f"{ctx} tokens at block_size={block_size}"
            )
        table = c.block_table[:needed]
        if min(table[c.start_pos // block_size:]) < 0 or max(table) >= num_blocks:
            raise BatchError(f"chunk {i}: block id out of range 0..{num_blocks - 1}: {table}")
        if cascade:
            raw_tables.append(table)
        if min(table) < 0:  # a sliding group's released blocks: out of every query's window, never read
            table = [b if b >= 0 else 0 for b in table]
        row = len(input_ids)
        if c.lora_slot >= 0:
            if lora_ranges and lora_ranges[-1][0] == c.lora_slot and lora_ranges[-1][2] == row:
                lora_ranges[-1] = (c.lora_slot, lora_ranges[-1][1], row + n)
            else:
                lora_ranges.append((c.lora_slot, row, row + n))
        input_ids.extend(c.token_ids)
        for p in range(c.start_pos, ctx):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        last_rows.extend(range(row, row + n) if c.all_logits else (row + n - 1,))
        if triton:
            tables.append(table)
            row_seq.extend([i] * n)
            if n == 1:
                row_len.append(ctx)
            else:
                row_len.extend([0] * n)
                prefills.append(PrefillItem(row, row + n, c.start_pos, torch.tensor([i])))
        elif native:
            fresh = n > 1 and c.start_pos == 0 and not fresh_from_cache  # flash SDPA over its own K/V
            tables.append(table)
            row_seq.extend([i] * n)
            row_len.extend([0] * n if fresh else range(c.start_pos + 1, ctx + 1))
            if fresh:
                prefills.append(PrefillItem(row, row + n, 0, torch.tensor(table, dtype=torch.long)))
        elif n == 1:
            dec_rows.append(row)
            dec_tables.append(table)
            dec_lens.append(ctx)
        else:
            prefills.append(PrefillItem(row, row + n, c.start_pos, torch.tensor(table, dtype=torch.long)))
    plan = find_shared_runs(raw_tables, row_seq, row_len, block_size) if cascade and (native or triton) else None
    if triton:
        inputs = _triton_inputs(input_ids, positions, slots, last_rows, tables, row_seq, row_len, prefills, device,
                                tuple(lora_ranges))
        inputs.cascade = plan.to(device) if plan is not None else None
        return inputs
    groups = []
    for members in (split_decode_groups(dec_lens) if dec_rows else []):
        meta = DecodeMetadata.build([dec_tables[i] for i in members], [dec_lens[i] for i in members],
                                    block_size=block_size, num_heads=num_heads, kv_heads=kv_heads,
                                    head_dim=head_dim, dtype=dtype, sliding_window=sliding_window)
        groups.append(DecodeGroup(torch.tensor([dec_rows[i] for i in members], dtype=torch.long), meta))
    identity = (not prefills and len(groups) == 1
                and groups[0].rows.tolist() == list(range(len(input_ids))))
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        logits_indices=torch.tensor(last_rows, dtype=torch.long),
        max_position=max(positions),
        decode_groups=groups,
        prefills=prefills,
        identity_decode=identity,
        native=NativeMetadata.build(tables, row_seq, row_len) if native else None,
        lora_ranges=tuple(lora_ranges),
        cascade=plan,
    )


def _triton_inputs(input_ids: list[int], positions: list[int], slots: list[int], last_rows: list[int],
                   tables: list[list[int]], row_seq: list[int], row_len: list[int],
                   prefills: list[PrefillItem], device: torch.device | str,
                   lora_ranges: tuple[tuple[int, int, int], ...] = ()) -> StepInputs:
    def t(values: list[int] | list[list[int]], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device)

    width = max(len(x) for x in tables)
    meta = TritonMetadata(
        block_tables=t([x + [0] * (width - len(x)) for x in tables]), row_seq=t(row_seq), row_len=t(row_len),
        chunk_seq=t([int(p.block_table[0]) for p in prefills]), chunk_row_start=t([p.start for p in prefills]),
        chunk_num_rows=t([p.end - p.start for p in prefills]), chunk_start_pos=t([p.start_pos for p in prefills]),
        num_decode=sum(1 for n in row_len if n > 0), num_prefill=len(prefills))
    return StepInputs(input_ids=t(input_ids, torch.long), positions=t(positions, torch.long),
                      slot_mapping=t(slots, torch.long), logits_indices=t(last_rows, torch.long),
                      max_position=max(positions), decode_groups=[], prefills=[], identity_decode=False,
                      triton=meta, lora_ranges=lora_ranges)
