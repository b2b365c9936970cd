"""Weights kept in Q8_0 (``quantization="q8_0"`` and ``"auto"``): QuantLinear / QuantEmbedding, with
and without offsets, against plain PyTorch on the dequantized weights (native kernel and fallback),
and tiny GGUF files and HF folders loaded each way: module types, exact values where the file's type
allows (all of them under "auto"), logits, greedy tokens, resident bytes, cache folders, the "auto"
choice and bad values.

The files are written by ``pagedkv_testing/quantized_gguf.py`` (K-quant tensors as random blocks
with their scales set). ``tests/models/test_gguf_quants.py`` checks every type's exactness."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedkv.engine import EngineConfig, LLMEngine
from pagedkv.models import load_model
from pagedkv.models.loader import resolve_quantization
from pagedkv.models.quant_linear import (
    QuantEmbedding,
    QuantLinear,
    dequantize_q8_0,
    quantize_model,
    quantize_q8_0,
    weight_bytes,
)
from pagedkv.ops import native
from pagedkv.runner import ModelRunner, SeqChunk
from pagedkv.sampling_params import SamplingParams
from pagedkv_testing.activation_rounding import assert_logits_within_head_rounding, record_inputs
from pagedkv_testing.quantized_gguf import EXACT, FFN, HIDDEN, LAYERS, VOCAB, write_gguf
from pagedkv_testing.tiny_model import write_tiny_model

gguf = pytest.importorskip("gguf")

Q = gguf.GGMLQuantizationType
NEEDS_NATIVE = pytest.mark.skipif(not native.available(), reason="native kernels unavailable")


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _greedy(runner: ModelRunner, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    table = list(range(16))
    logits = runner.execute([SeqChunk(prompt, 0, table)])
    first, out, pos = logits, [], len(prompt)
    for _ in range(steps):
        out.append(int(logits[0].argmax()))
        logits = runner.execute([SeqChunk([out[-1]], pos, table)])
        pos += 1
    return out, first


def _set_native(model: torch.nn.Module, on: bool) -> None:
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.native = on


@pytest.mark.parametrize("use_native", [pytest.param(True, marks=NEEDS_NATIVE), False])
@pytest.mark.parametrize("m", [1, 5, 33, 300])
def test_quant_linear_matches_pytorch_on_the_dequantized_weights(use_native: bool, m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    weight, bias = torch.randn(300, 96, generator=gen), torch.randn(300, generator=gen)
    weight[3, 32:64] = 0.0  # an all-zero block: scale 0
    layer = QuantLinear.from_float(weight, bias)
    layer.native = use_native
    x = torch.randn(2, m, 96, generator=gen)  # any leading shape
    want = torch.nn.functional.linear(x, layer.weight, bias)
    torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-5)
    assert (layer.weight - weight).abs().max() <= weight.abs().max() / 254 + 1e-6  # half a step of 127
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16
    # with offsets (Q4_1-like: q in 0..15, offset about -8 scales)
    with_offsets = QuantLinear(96, 300, bias=True, offsets=True)
    with_offsets.native = use_native
    with_offsets.qweight.copy_(torch.randint(0, 16, (300, 96), generator=gen))
    with_offsets.scales.copy_(torch.rand(300, 3, generator=gen) / 16)
    with_offsets.offsets.copy_(-8 * with_offsets.scales + 0.01 * torch.randn(300, 3, generator=gen))
    with_offsets.bias.copy_(bias)
    want = torch.nn.functional.linear(x, with_offsets.weight, bias)
    torch.testing.assert_close(with_offsets(x), want, atol=1e-4, rtol=1e-5)
    assert "offsets" in repr(with_offsets) and "offsets" not in repr(layer)


def test_fused_rows_concatenate_and_embedding_gathers_dequantized_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    q_w, k_w = torch.randn(64, 64, generator=gen), torch.randn(32, 64, generator=gen)
    fused, parts = quantize_q8_0(torch.cat([q_w, k_w])), [quantize_q8_0(q_w), quantize_q8_0(k_w)]
    assert torch.equal(fused[0], torch.cat([p[0] for p in parts]))
    assert torch.equal(fused[1], torch.cat([p[1] for p in parts]))
    emb = QuantEmbedding.from_float(torch.randn(50, 64, generator=gen))
    ids = torch.tensor([[3, 49], [0, 3]])
    torch.testing.assert_close(emb(ids), emb.weight[ids], atol=0, rtol=0)
    head = QuantLinear.sharing(emb)
    assert head.qweight.data_ptr() == emb.qweight.data_ptr() and head.out_features == 50
    emb = QuantEmbedding(50, 64, offsets=True)  # offsets gathered with their rows
    emb.qweight.copy_(torch.randint(0, 16, (50, 64), generator=gen))
    emb.scales.copy_(torch.rand(50, 2, generator=gen))
    emb.offsets.copy_(torch.randn(50, 2, generator=gen))
    torch.testing.assert_close(emb(ids), emb.weight[ids], atol=0, rtol=0)
    head = QuantLinear.sharing(emb)
    assert head.offsets is not None and head.offsets.data_ptr() == emb.offsets.data_ptr()
    x = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(head(x), x @ emb.weight.t(), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_q8_0_gguf_matches_its_dequantized_float_model(cache: Path, tmp_path: Path, tied: bool) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, {**EXACT, "output.weight": Q.Q8_0}, tied=tied)
    plain = load_model(str(path), quantization="none")
    quant = load_model(str(path), quantization="q8_0")
    assert (plain.quantization, quant.quantization) == ("none", "q8_0")
    layer = quant.model.layers[1]
    for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj,
                quant.model.lm_head):
        assert isinstance(mod, QuantLinear)
    assert isinstance(quant.model.embed_tokens, QuantEmbedding)
    if tied:  # the head is the embedding's own tensors
        assert quant.model.lm_head.qweight.data_ptr() == quant.model.embed_tokens.qweight.data_ptr()
    # bit for bit the file's values (q/k rows un-permuted alike)
    for i in range(LAYERS):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            a, b = plain.model.get_submodule(f"layers.{i}.{name}"), quant.model.get_submodule(f"layers.{i}.{name}")
            assert torch.equal(a.weight, b.weight), name
    assert torch.equal(plain.model.embed_tokens.weight, quant.model.embed_tokens.weight)
    # memory: int8 plus a float32 scale per 32 for every matrix, float32 for the norms
    matrices = VOCAB * HIDDEN * (1 if tied else 2) + LAYERS * (HIDDEN * (HIDDEN + 2 * 32) + HIDDEN * HIDDEN
                                                             + 3 * FFN * HIDDEN)
    norms = (2 * LAYERS + 1) * HIDDEN * 4
    assert weight_bytes(quant.model) == matrices * 9 // 8 + norms
    assert weight_bytes(plain.model) == matrices * 4 + norms
    # same greedy tokens, close logits
    prompt = [5, 40, 77, 120, 9, 100, 33, 64, 3]
    want, want_logits = _greedy(ModelRunner(plain, block_size=4, num_blocks=32), prompt, 16)
    got, got_logits = _greedy(ModelRunner(quant, block_size=4, num_blocks=32), prompt, 16)
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
    _set_native(quant.model, False)  # the plain-PyTorch path agrees too
    fallback, fallback_logits = _greedy(ModelRunner(quant, block_size=4, num_blocks=32), prompt, 16)
    assert fallback == want
    torch.testing.assert_close(fallback_logits, want_logits, atol=1e-4, rtol=1e-4)
    # one converted folder per choice, each reused
    folders = sorted(p.parent.name for p in (cache / "gguf").glob("*/.complete"))
    assert len(folders) == 2 and {f.split("-")[1] for f in folders} == {"none", "q8_0"}
    load_model(str(path), quantization="q8_0")
    assert len(list((cache / "gguf").glob("*/.complete"))) == 2


# Every exact type with offsets or without, and two without an exact form, in one tiny model (K-quants
# need inputs of 256): q/k/v fuse Q4_K, Q4_1 (offsets) and Q5_0 (none: its rows get zero offsets);
# gate/up fuse Q5_1 and Q6_K, which share no layout, so "auto" keeps that module in float; an
# untied head is Q6_K, kept at 6 bits (tests/models/test_quant_lowbit.py has every low-bit type).
MIXED = {"attn_q.weight": Q.Q4_K, "attn_k.weight": Q.Q4_1, "attn_v.weight": Q.Q5_0, "attn_output.weight": Q.Q5_K,
         "ffn_gate.weight": Q.Q5_1, "ffn_up.weight": Q.Q6_K, "ffn_down.weight": Q.Q4_K, "token_embd.weight": Q.Q4_1,
         "output.weight": Q.Q6_K}
K_HIDDEN, K_FFN = 256, 512
MODULES = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@pytest.mark.parametrize("tied", [True, False])
def test_auto_keeps_exact_types_quantized_and_the_files_values(cache: Path, tmp_path: Path, tied: bool) -> None:
    path = tmp_path / "mixed.gguf"
    write_gguf(path, MIXED, tied=tied, hidden=K_HIDDEN, ffn=K_FFN)
    auto = load_model(str(path))  # the default
    plain = load_model(str(path), quantization="none")
    assert auto.quantization == "auto" and resolve_quantization("auto", path) == "auto"
    layer, cfg = auto.model.layers[0], auto.config
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.offsets is not None
    assert not qkv.offsets[cfg.q_size + cfg.kv_size:].any() and qkv.offsets[:cfg.q_size].any()
    assert isinstance(layer.self_attn.o_proj, QuantLinear) and isinstance(layer.mlp.down_proj, QuantLinear)
    assert type(layer.mlp.gate_up_proj) is torch.nn.Linear  # its up part is Q6_K: dequantized
    assert isinstance(auto.model.embed_tokens, QuantEmbedding) and auto.model.embed_tokens.offsets is not None
    assert isinstance(auto.model.lm_head, QuantLinear)
    assert auto.model.lm_head.fmt == ("u4" if tied else "i6")
    # the values are the file's: "none"'s, bit for bit
    for i in range(LAYERS):
        for name in MODULES:
            a, b = plain.model.get_submodule(f"layers.{i}.{name}"), auto.model.get_submodule(f"layers.{i}.{name}")
            assert torch.equal(a.weight, b.weight), name
    assert torch.equal(plain.model.embed_tokens.weight, auto.model.embed_tokens.weight)
    if not tied:
        assert torch.equal(plain.model.lm_head.weight, auto.model.lm_head.weight)
    # so the same greedy tokens and logits within float rounding (plus the low-bit LM head's rounding
    # of its one row's activations, pagedkv_testing/activation_rounding.py), native kernel and
    # plain-PyTorch path
    prompt = [5, 40, 77, 120, 9, 100, 33, 64, 3]
    want, want_logits = _greedy(ModelRunner(plain, block_size=4, num_blocks=32), prompt, 16)
    head_inputs = record_inputs(auto.model.lm_head)
    for use_native in ([True] if native.available() else []) + [False]:
        _set_native(auto.model, use_native)
        head_inputs.clear()
        got, got_logits = _greedy(ModelRunner(auto, block_size=4, num_blocks=32), prompt, 16)
        assert got == want
        assert_logits_within_head_rounding(got_logits, want_logits, head_inputs[0], auto.model.lm_head)


def test_q8_0_requantizes_only_what_has_no_exact_form(cache: Path, tmp_path: Path) -> None:
    path = tmp_path / "mixed.gguf"
    write_gguf(path, MIXED, tied=False, hidden=K_HIDDEN, ffn=K_FFN)
    quant = load_model(str(path), quantization="q8_0")
    plain = load_model(str(path), quantization="none")
    inter = quant.config.intermediate_size
    for i in range(LAYERS):
        for name in MODULES:
            mod = quant.model.get_submodule(f"layers.{i}.{name}")
            want = plain.model.get_submodule(f"layers.{i}.{name}").weight
            assert isinstance(mod, QuantLinear), name
            exact = slice(0, inter) if name == "mlp.gate_up_proj" else slice(None)  # up (Q6_K) is not
            assert torch.equal(mod.weight[exact], want[exact]), name
    gate_up = quant.model.layers[0].mlp.gate_up_proj
    assert gate_up.offsets is not None and not gate_up.offsets[inter:].any()  # requantized: no offsets
    for got, want in ((gate_up.weight[inter:], plain.model.layers[0].mlp.gate_up_proj.weight[inter:]),
                      (quant.model.lm_head.weight, plain.model.lm_head.weight)):
        step = want.view(want.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 127  # per 32 values
        assert ((got - want).view_as(step.expand(-1, -1, 32)).abs() <= step / 2 + 1e-6).all()
    assert quant.model.lm_head.offsets is None
    prompt = [5, 40, 77, 120, 9]
    _, want_logits = _greedy(ModelRunner(plain, block_size=4, num_blocks=32), prompt, 0)
    _, got_logits = _greedy(ModelRunner(quant, block_size=4, num_blocks=32), prompt, 0)
    assert torch.nn.functional.cosine_similarity(got_logits, want_logits).item() > 0.999


def test_auto_is_none_without_an_exact_quantized_matrix(cache: Path, tmp_path: Path) -> None:
    float_file, q3_k_file = tmp_path / "f32.gguf", tmp_path / "q3_k.gguf"
    write_gguf(float_file, {})
    write_gguf(q3_k_file, {"weight": Q.Q3_K}, hidden=K_HIDDEN, ffn=K_FFN)
    assert resolve_quantization("auto", float_file) == "none"  # a float GGUF keeps its precision
    assert resolve_quantization("auto", q3_k_file) == "none"  # dequantized: nothing to keep
    loaded = load_model(str(q3_k_file))
    assert loaded.quantization == "none" and type(loaded.model.layers[0].mlp.down_proj) is torch.nn.Linear


def test_hf_folder_quantizes_at_load_and_the_engine_threads_the_option(cache: Path, tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "hf")
    assert resolve_quantization("auto", folder) == "none"
    plain = load_model(str(folder))
    quant = load_model(str(folder), quantization="q8_0")
    assert plain.quantization == "none" and isinstance(plain.model.layers[0].mlp.down_proj, torch.nn.Linear)
    assert isinstance(quant.model.lm_head, QuantLinear) and isinstance(quant.model.embed_tokens, QuantEmbedding)
    assert quantize_model(quant.model) == 0  # idempotent
    torch.testing.assert_close(quant.model.layers[0].mlp.down_proj.weight, plain.model.layers[0].mlp.down_proj.weight,
                               atol=0.02, rtol=0)
    engine = LLMEngine.from_options(str(folder), quantization="q8_0", num_kv_blocks=32, block_size=4)
    assert isinstance(engine.runner.model.layers[1].self_attn.qkv_proj, QuantLinear)
    engine.add_request("r", "hello world", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()


def test_a_bad_quantization_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(str(tmp_path / "absent.gguf"), quantization="q4")
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantLinear.from_float(torch.randn(8, 40))


def test_dequantize_round_trip() -> None:
    w = torch.randn(4, 64)
    q, d = quantize_q8_0(w)
    assert q.dtype == torch.int8 and d.shape == (4, 2)
    assert (dequantize_q8_0(q, d) - w).abs().max() <= w.abs().max() / 254 + 1e-6
