"""Flatten a list of ``SeqChunk`` into the tensors one forward pass needs, built once per step.

Token order is chunk order: chunk 0's tokens, then chunk 1's, ... Decode chunks (one token) are
grouped into one batched paged-attention call; prefill chunks (several tokens) each get their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.ops.paged_attention import DecodeMetadata
from pagedkv.runner.batch import SeqChunk


class BatchError(ValueError):
    """A step's chunks are malformed (empty chunk, block table too short, bad block id)."""


@dataclass(slots=True)
class PrefillItem:
    """One prefill chunk's rows ``[start, end)`` of the flattened tokens."""

    start: int
    end: int
    start_pos: int
    block_table: torch.Tensor  # [num_blocks_used] int64


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [len(chunks)] int64: each chunk's last token
    max_position: int
    decode_rows: torch.Tensor | None  # [B] rows of T that are decode tokens
    decode: DecodeMetadata | None
    prefills: list[PrefillItem]
    all_decode: bool  # every chunk is a decode, in order: decode output is the whole output

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def build_step_inputs(chunks: list[SeqChunk], *, block_size: int, num_blocks: int, num_heads: int,
                      kv_heads: int, head_dim: int, dtype: torch.dtype,
                      sliding_window: int | None = None) -> StepInputs:
    """Validate ``chunks`` and build every index the step's 30-odd layers share."""
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
        if min(table) < 0 or max(table) >= num_blocks:
            raise BatchError(f"chunk {i}: block id out of range 0..{num_blocks - 1}: {table}")
        row = len(input_ids)
        input_ids.extend(c.token_ids)
        for p in range(c.start_pos, ctx):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        last_rows.append(row + n - 1)
        if n == 1:
            dec_rows.append(row)
            dec_tables.append(table)
            dec_lens.append(ctx)
        else:
            prefills.append(PrefillItem(row, row + n, c.start_pos, torch.tensor(table, dtype=torch.long)))
    decode = (DecodeMetadata.build(dec_tables, dec_lens, block_size=block_size, num_heads=num_heads,
                                   kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                                   sliding_window=sliding_window)
              if dec_rows else None)
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        logits_indices=torch.tensor(last_rows, dtype=torch.long),
        max_position=max(positions),
        decode_rows=torch.tensor(dec_rows, dtype=torch.long) if dec_rows else None,
        decode=decode,
        prefills=prefills,
        all_decode=not prefills,
    )
