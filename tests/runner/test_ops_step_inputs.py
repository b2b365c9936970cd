"""Step input flattening: slot mapping, logits rows, decode length groups, batch validation."""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv.runner import BatchError, SeqChunk
from pagedkv.runner.step_inputs import build_step_inputs, split_decode_groups

ARGS = dict(block_size=4, num_blocks=16, num_heads=4, kv_heads=2, head_dim=8, dtype=torch.float32)


def test_slot_mapping_positions_and_logits_rows() -> None:
    chunks = [SeqChunk([11, 12, 13], 5, [9, 2, 7]), SeqChunk([14], 0, [3]), SeqChunk([15, 16], 2, [0])]
    inp = build_step_inputs(chunks, **ARGS)
    assert inp.input_ids.tolist() == [11, 12, 13, 14, 15, 16]
    assert inp.positions.tolist() == [5, 6, 7, 0, 2, 3]
    # position 5 -> block table[1] = 2, offset 1 -> slot 9; position 7 -> slot 11; ...
    assert inp.slot_mapping.tolist() == [9, 10, 11, 12, 2, 3]
    assert inp.logits_indices.tolist() == [2, 3, 5]
    assert [(p.start, p.end, p.start_pos) for p in inp.prefills] == [(0, 3, 5), (4, 6, 2)]
    assert [g.rows.tolist() for g in inp.decode_groups] == [[3]]
    assert not inp.identity_decode


@pytest.mark.parametrize("bad,match", [
    (SeqChunk([], 0, [0]), "no tokens"),
    (SeqChunk([1] * 5, 0, [0]), "2 needed"),
    (SeqChunk([1], 0, [16]), "out of range"),
    (SeqChunk([1], -1, [0]), "start_pos"),
])
def test_bad_chunks_raise(bad: SeqChunk, match: str) -> None:
    with pytest.raises(BatchError, match=match):
        build_step_inputs([SeqChunk([1], 0, [1]), bad], **ARGS)
    with pytest.raises(BatchError):
        build_step_inputs([], **ARGS)


@pytest.mark.parametrize("seed", range(20))
def test_decode_groups_partition_and_never_cost_more(seed: int) -> None:
    rng = random.Random(seed)
    lens = [rng.randint(1, rng.choice([16, 500, 4000])) for _ in range(rng.randint(1, 300))]
    groups = split_decode_groups(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    assert 1 <= len(groups) <= 4
    maxima = [max(lens[i] for i in g) for g in groups]
    assert maxima == sorted(maxima)
    cost = sum(len(g) * m + 256 for g, m in zip(groups, maxima))
    assert cost <= len(lens) * max(lens) + 256
