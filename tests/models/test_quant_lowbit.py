"""GGUF's 4-, 5- and 6-bit types kept at their own width (``weight_quant.LOWBIT_FORMATS``,
``models/gguf_quants.py``, ``ops/csrc/lowbit_matmul.cpp``): every type's values bit for bit
``gguf.quants.dequantize`` (numpy and the modules' torch path; odd row counts, rows that are no
multiple of 256), the native kernel against the dequantized weight at decode and prefill row counts
(within the rounding of its integer activations: ``pagedkv_testing/activation_rounding.py``), and a
tiny random model written as GGUF of each type: packed where "auto" says, the file's values,
the same greedy tokens as the dequantized-float32 ("none") model, and its resident bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedkv.models import load_model
from pagedkv.models.gguf_loader import module_layout
from pagedkv.models.gguf_quants import LOWBIT_TYPES, as_unsigned, dequantize_lowbit_np, unpack_lowbit
from pagedkv.models.quant_linear import QuantEmbedding, QuantLinear, dequantize_lowbit, weight_bytes
from pagedkv.ops import native
from pagedkv.runner import ModelRunner, SeqChunk
from pagedkv.weight_quant import LOWBIT_FORMATS
from pagedkv_testing.activation_rounding import (
    assert_logits_within_head_rounding,
    assert_within_activation_rounding,
    record_inputs,
)
from pagedkv_testing.quantized_gguf import LAYERS, VOCAB, write_gguf

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402 - only once importorskip found gguf

Q = gguf.GGMLQuantizationType
# byte offsets of each type's fp16 fields (d, and dmin / m where it has one)
FP16_FIELDS = {"Q4_0": (0,), "IQ4_NL": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}
LOWBIT_NATIVE = native.available() and hasattr(torch.ops.pagedkv, "lowbit_linear")


def _random_tensor(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """A ``[rows, cols]`` tensor of random ``type_name`` blocks: uint8 ``[rows, row bytes]``; fp16 fields
    finite, with zeros, the smallest subnormal and the largest value among them."""
    qtype = Q[type_name]
    block, width = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * cols // block, width), dtype=np.uint8)
    for at in FP16_FIELDS[type_name]:
        v = (rng.standard_normal(len(raw)) * np.exp2(rng.integers(-24, 10, len(raw)))).astype(np.float16)
        special = [0.0, -0.0, 6e-8, -6e-8, 65504.0, -65504.0][:len(v)]
        v[:len(special)] = special
        raw[:, at:at + 2] = v.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def test_every_listed_type_has_a_low_bit_format_of_at_most_a_byte_a_weight() -> None:
    assert set(LOWBIT_TYPES) == {"Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "Q5_0", "Q5_1", "Q5_K", "Q6_K"}
    for type_name, fmt in LOWBIT_TYPES.items():
        f = LOWBIT_FORMATS[fmt]
        assert f.bits == int(type_name.lstrip("IQ")[0])
        assert f.bytes_per_weight(offsets=False) <= 1.0


@pytest.mark.parametrize("type_name", sorted(LOWBIT_TYPES))
@pytest.mark.parametrize("rows", [1, 7])
def test_low_bit_values_are_ggufs_dequantize_bit_for_bit(type_name: str, rows: int) -> None:
    # K-quant rows of 3 super-blocks (768); the 32-value types' rows of 7 blocks (224), no multiple of 256
    cols = 768 if type_name.endswith("_K") else 224
    raw = _random_tensor(type_name, rows, cols, seed=rows + Q[type_name].value)
    want = dequantize(raw, Q[type_name]).reshape(rows, cols)
    assert np.isfinite(want).all()
    lb = unpack_lowbit(raw, type_name)
    assert lb.format.name == LOWBIT_TYPES[type_name] and lb.nibbles.shape == (rows * cols // 32, 16)
    assert (lb.planes is None) == (lb.format.planes == 0)
    assert np.array_equal(dequantize_lowbit_np(lb).view(np.uint32), want.reshape(-1).view(np.uint32))
    # Q4_0 / Q5_0 as u4 / u5 with their zero as an offset (a fused module's join): the same values
    # (a zero scale gives +0 where gguf has -0: equal as numbers)
    assert np.array_equal(dequantize_lowbit_np(as_unsigned(lb)), want.reshape(-1))

    # the modules' torch dequantization, rows first
    def rowwise(a: np.ndarray | None) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(a.reshape(rows, -1))
    nibbles, scales = rowwise(lb.nibbles), rowwise(lb.scales)
    assert nibbles is not None and scales is not None
    got = dequantize_lowbit(nibbles, rowwise(lb.planes), scales, rowwise(lb.offsets), lb.format)
    assert torch.equal(got.view(torch.int32), torch.from_numpy(want).view(torch.int32))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_ggufs_own_quantizer_output_is_kept_exactly(type_name: str) -> None:
    w = np.random.default_rng(0).standard_normal((5, 288)).astype(np.float32)
    raw = quantize(w, Q[type_name])
    assert np.array_equal(dequantize_lowbit_np(unpack_lowbit(raw, type_name)).reshape(5, 288),
                          dequantize(raw, Q[type_name]))


def test_types_without_a_low_bit_form_are_refused_and_fused_modules_take_one_layout() -> None:
    with pytest.raises(ValueError, match="no low-bit layout"):
        unpack_lowbit(np.zeros(84, dtype=np.uint8), "Q2_K")
    assert module_layout(["Q4_K", "Q4_K"]) == "u4"
    assert module_layout(["Q4_0", "Q4_K", "Q4_1"]) == "u4"  # Q4_0's -8 d as offsets
    assert module_layout(["Q5_0", "Q5_K"]) == "u5"
    assert module_layout(["Q4_0"]) == "i4" and module_layout(["Q6_K"]) == "i6"
    assert module_layout(["Q4_K", "Q5_0", "Q8_0"]) == "q8_0"  # all exact in the 8-bit layout
    assert module_layout(["Q4_K", "Q6_K"]) is None  # no common layout: dequantized
    assert module_layout(["Q3_K"]) is None


def _random_module(fmt: str, k: int, n: int, offsets: bool, seed: int) -> QuantLinear:
    gen = torch.Generator().manual_seed(seed)
    layer = QuantLinear(k, n, bias=True, offsets=offsets, fmt=fmt)
    layer.qweight.copy_(torch.randint(0, 256, layer.qweight.shape, generator=gen, dtype=torch.uint8))
    if layer.planes is not None:
        layer.planes.copy_(torch.randint(0, 256, layer.planes.shape, generator=gen, dtype=torch.uint8))
    layer.scales.copy_(torch.rand(layer.scales.shape, generator=gen) / 64)
    if layer.offsets is not None:
        layer.offsets.copy_(torch.randn(layer.offsets.shape, generator=gen) / 16)
    assert layer.bias is not None
    layer.bias.copy_(torch.randn(n, generator=gen))
    return layer


@pytest.mark.parametrize("use_native", [pytest.param(True, marks=pytest.mark.skipif(
    not LOWBIT_NATIVE, reason="native low-bit kernel unavailable")), False])
@pytest.mark.parametrize("fmt", sorted(LOWBIT_FORMATS))
def test_low_bit_linear_matches_pytorch_on_the_dequantized_weight(use_native: bool, fmt: str) -> None:
    # 37 weight rows; inputs of 96 (less than a K-quant super-block of 256) and 800 (3 super-blocks and
    # a run: rows that are no multiple of the super-block); activations of mixed magnitudes, a run of zeros.
    # The bound: the integer activations' rounding (rows 1 and 2), float rounding (the others).
    for k, offsets in ((96, False), (96, True), (800, True)):
        layer = _random_module(fmt, k, 37, offsets, seed=len(fmt) + offsets + k)
        layer.native = use_native
        weight = layer.weight
        assert layer.bias is not None
        for m in (1, 2, 5, 9, 33, 70):  # integer activations, one group, several, the tiled path (past 32 rows)
            gen = torch.Generator().manual_seed(m)
            x = torch.randn(m, k, generator=gen) * torch.randn(m, k, generator=gen).exp()
            x[0, 32:64] = 0.0
            assert_within_activation_rounding(layer(x), x, weight, layer.offsets, layer.bias)
        assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16
        assert f"format={fmt}" in repr(layer)


def test_low_bit_embedding_gathers_rows_and_a_tied_head_shares_them() -> None:
    src = _random_module("u5", 64, 50, offsets=True, seed=3)
    emb = QuantEmbedding(50, 64, offsets=True, fmt="u5")
    for name in ("qweight", "planes", "scales", "offsets"):
        getattr(emb, name).copy_(getattr(src, name))
    ids = torch.tensor([[3, 49], [0, 3]])
    torch.testing.assert_close(emb(ids), emb.weight[ids], atol=0, rtol=0)
    head = QuantLinear.sharing(emb)
    assert head.fmt == "u5" and head.planes is not None and head.planes.data_ptr() == emb.planes.data_ptr()
    for m in (1, 3):
        x = torch.randn(m, 64)
        assert_within_activation_rounding(head(x), x, emb.weight, emb.offsets)


def _greedy(runner: ModelRunner, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    table = list(range(16))
    logits = runner.execute([SeqChunk(prompt, 0, table)])
    first, out, pos = logits, [], len(prompt)
    for _ in range(steps):
        out.append(int(logits[0].argmax()))
        logits = runner.execute([SeqChunk([out[-1]], pos, table)])
        pos += 1
    return out, first


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("type_name", sorted(LOWBIT_TYPES))
def test_a_tiny_gguf_of_each_type_runs_packed_with_the_dequantized_models_tokens(
        cache: Path, tmp_path: Path, type_name: str) -> None:
    hidden, ffn = (256, 256) if type_name.endswith("_K") else (64, 96)
    path = tmp_path / f"{type_name}.gguf"
    write_gguf(path, {"weight": Q[type_name]}, tied=False, hidden=hidden, ffn=ffn)
    packed, plain = load_model(str(path)), load_model(str(path), quantization="none")
    fmt = LOWBIT_TYPES[type_name]
    assert packed.quantization == "auto"
    mods = [m for m in packed.model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    assert len(mods) == 4 * LAYERS + 2 and {m.fmt for m in mods} == {fmt}  # every matrix, the head and embedding
    for (name, a), (_, b) in zip(packed.model.named_modules(), plain.model.named_modules()):
        if isinstance(a, (QuantLinear, QuantEmbedding)):
            assert torch.equal(a.weight, b.weight), name  # the file's values, bit for bit
    # resident bytes: the format's own width (Q4_0 / Q5_0 without offsets)
    f = LOWBIT_FORMATS[fmt]
    matrices = sum(m.qweight.shape[0] * m.qweight.shape[1] * 2 for m in mods)
    offsets = type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K")
    norms = (2 * LAYERS + 1) * hidden * 4
    assert weight_bytes(packed.model) == round(matrices * f.bytes_per_weight(offsets)) + norms
    prompt = [5, 40, 77, 120, 9, 100, 33, 64, 3]
    want, want_logits = _greedy(ModelRunner(plain, block_size=4, num_blocks=32), prompt, 12)
    # the prompt's logits: float rounding, and the LM head's integer activations on its one row
    head = next(m for m in packed.model.modules() if isinstance(m, QuantLinear) and m.out_features == VOCAB)
    head_inputs = record_inputs(head)
    for use_native in ([True] if LOWBIT_NATIVE else []) + [False]:
        for m in packed.model.modules():
            if isinstance(m, QuantLinear):
                m.native = use_native
        head_inputs.clear()
        got, got_logits = _greedy(ModelRunner(packed, block_size=4, num_blocks=32), prompt, 12)
        assert got == want
        assert_logits_within_head_rounding(got_logits, want_logits, head_inputs[0], head)
    assert VOCAB == plain.config.vocab_size
