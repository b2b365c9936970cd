"""GGUF block types in the 8-bit layout (``models/gguf_quants.py``): ``scale * q + offset`` is bit for
bit ``gguf.quants.dequantize`` on random blocks of every exact type (random bytes are valid blocks;
the fp16 fields are set to finite values, subnormals and the largest included), in numpy and through
``dequantize_q8_0``; files' own quantizer output too; other types are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedkv.models.gguf_quants import EXACT_TYPES, unpack
from pagedkv.models.quant_linear import dequantize_q8_0

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402 - only once importorskip found gguf

Q = gguf.GGMLQuantizationType
FP16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2)}


def _random_blocks(qtype: gguf.GGMLQuantizationType, blocks: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (blocks, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    for at in FP16_FIELDS[qtype.name]:
        v = (rng.standard_normal(blocks) * np.exp2(rng.integers(-24, 10, blocks))).astype(np.float16)
        v[:6] = [0.0, -0.0, 6e-8, -6e-8, 65504.0, -65504.0]  # zeros, the smallest subnormal, the largest
        raw[:, at:at + 2] = v.view(np.uint8).reshape(blocks, 2)
    return raw


def test_the_exact_types_are_those_with_a_scale_and_offset_per_32() -> None:
    assert EXACT_TYPES == {"Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K"}


@pytest.mark.parametrize("type_name", sorted(EXACT_TYPES))
def test_scale_times_q_plus_offset_is_ggufs_dequantize_bit_for_bit(type_name: str) -> None:
    qtype = Q[type_name]
    raw = _random_blocks(qtype, 2048, seed=len(type_name) + qtype.value)
    want = dequantize(raw, qtype).reshape(-1, 32)  # float32
    q, scales, offsets = unpack(raw, type_name)
    assert q.dtype == np.int8 and scales.dtype == np.float32 and q.shape == want.shape
    assert (offsets is None) == (type_name in ("Q8_0", "Q4_0", "Q5_0"))
    got = q.astype(np.float32) * scales[:, None]
    if offsets is not None:
        got = got + offsets[:, None]
    assert np.isfinite(want).all()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # bits, signed zeros included
    # the modules' dequantization: [N, K] rows of 8 blocks
    t = dequantize_q8_0(torch.from_numpy(q.reshape(-1, 256)), torch.from_numpy(scales.reshape(-1, 8)),
                        None if offsets is None else torch.from_numpy(offsets.reshape(-1, 8)))
    assert torch.equal(t.view(-1, 32).view(torch.int32), torch.from_numpy(want).view(torch.int32))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q5_0", "Q4_1", "Q5_1"])
def test_ggufs_own_quantizer_output_unpacks_exactly(type_name: str) -> None:
    w = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    raw = quantize(w, Q[type_name])
    q, scales, offsets = unpack(raw, type_name)
    got = q.astype(np.float32) * scales[:, None] + (0 if offsets is None else offsets[:, None])
    assert np.array_equal(got.reshape(64, 256), dequantize(raw, Q[type_name]))


@pytest.mark.parametrize("type_name", ["Q6_K", "Q2_K", "Q3_K", "IQ4_NL", "F16", "BF16"])
def test_other_types_have_no_exact_form(type_name: str) -> None:
    with pytest.raises(ValueError, match="no exact form"):
        unpack(np.zeros(256, dtype=np.uint8), type_name)
