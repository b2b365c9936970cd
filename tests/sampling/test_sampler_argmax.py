"""The sampler's chunked argmax equals torch.argmax: ties go to the first maximum, in every chunk
layout (vocab a multiple of the chunk or not, smaller than two chunks), rows of -inf included."""

from __future__ import annotations

import pytest
import torch

from pagedkv.sampling.sampler import argmax_rows


@pytest.mark.parametrize("vocab", [49152, 32000, 2049, 2048, 1500, 100])
def test_argmax_rows_equals_torch_argmax(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    for _ in range(20):
        x = torch.randint(-3, 4, (6, vocab), generator=gen).float()  # many ties
        x[0] = float("-inf")
        x[1, -1] = 100.0  # the maximum in the last (partial) chunk
        x[2, 5] = x[2, min(1500, vocab - 2)] = 50.0  # a tie across chunks: the first wins
        x[3, 1024 % vocab] = float("inf")
        assert torch.equal(argmax_rows(x), x.argmax(-1))
    wide = torch.randn(3, 2 * vocab, generator=gen)[:, ::2]  # strided rows: the plain argmax
    assert torch.equal(argmax_rows(wide), wide.argmax(-1))
