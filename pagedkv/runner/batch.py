"""The runner's step input: one ``SeqChunk`` per scheduled sequence."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(slots=True)
class SeqChunk:
    """Tokens of one sequence whose KV is computed in this step.

    A prefill chunk (many tokens) or one decode token. Region map of the sequence's slots::

        [ cached: 0 .. start_pos-1 | this step: start_pos .. start_pos+len(token_ids)-1 | free ]

    ``block_table`` maps logical block i to a physical block id and must cover
    ``start_pos + len(token_ids)`` slots. ``all_logits`` asks for the logits of every token of the
    chunk (prompt logprobs), not only of its last one. A hybrid model's KV groups after the first
    (``model_shape.kv_groups``) have their own tables in ``group_tables``; a sliding group's
    entries for blocks out of every query's window are -1 (released). ``lora_slot`` is the LoRA
    slot whose adapter computes the chunk (``pagedkv/lora``), -1 for the base model.
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    all_logits: bool = False
    group_tables: tuple[list[int], ...] = ()
    lora_slot: int = -1

    @property
    def num_logits(self) -> int:
        """Rows of logits ``execute`` returns for this chunk."""
        return len(self.token_ids) if self.all_logits else 1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def in_group(self, group: int) -> SeqChunk:
        """This chunk with KV group ``group``'s block table (group 0: itself)."""
        if group == 0:
            return self
        return replace(self, block_table=self.group_tables[group - 1], group_tables=())
