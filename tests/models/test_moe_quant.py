"""Quantized experts (``QuantExperts``, models/quant_linear.py): a MoE layer's 3-D expert weights
kept in the 8-bit layout under ``quantization="q8_0"`` (an HF folder) and a GGUF's quantized
``ffn_{gate,up,down}_exps`` kept as the file holds them under "auto" / "q8_0", computed one kernel
call per active expert. Each is checked against the same model run in float with the dequantized
weights (greedy tokens equal, logits within float rounding), and by its weight bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv.models import load_model
from pagedkv.models.quant_linear import QuantEmbedding, QuantExperts, QuantLinear
from pagedkv.runner import ModelRunner, SeqChunk
from pagedkv_testing.hf_checkpoints import TinyAllocator, paged_greedy, randomize_

# odd expert counts and top-k; hidden and the expert width multiples of 32 (the 8-bit layout's run)
HF_CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=7, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True, head_dim=16,
        decoder_sparse_step=1, mlp_only_layers=[1])),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, kv_lora_rank=32, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, routed_scaling_factor=2.0)),
}
TINY: dict[str, Any] = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_folder(tmp: Path, name: str) -> Path:
    import transformers

    cfg_cls, model_cls, overrides = HF_CASES[name]
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**{**TINY, **overrides})).eval()
    randomize_(model, len(name))
    model.save_pretrained(tmp, safe_serialization=True)
    return tmp


def _dequantized_into(quantized: torch.nn.Module, float_model: torch.nn.Module) -> None:
    """Copy every quantized weight of ``quantized``, dequantized, into ``float_model``'s same place."""
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if isinstance(module, (QuantLinear, QuantEmbedding)):
                target = float_model.get_submodule(name) if name != "lm_head" or float_model.lm_head is not None \
                    else None
                if target is not None:
                    target.weight.copy_(module.weight)
            elif isinstance(module, QuantExperts):
                parent, _, attr = name.rpartition(".")
                getattr(float_model.get_submodule(parent), attr).copy_(module.weight)


def _expert_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes the expert weights take, their number of weights)."""
    total = count = 0
    for m in model.modules():
        for w in (getattr(m, name) for name in getattr(m, "EXPERT_WEIGHTS", ())):
            if isinstance(w, QuantExperts):
                total += sum(t.numel() * t.element_size() for t in (w.qweight, w.planes, w.scales, w.offsets)
                             if t is not None)
                count += w.num_experts * w.out_features * w.in_features
            else:
                total, count = total + w.numel() * w.element_size(), count + w.numel()
    return total, count


def _same_outputs(quantized: Any, reference: Any, native: bool = True) -> None:
    """Prefill logits (whole and in chunks of 6, block size 16) within float rounding, and greedy
    16 tokens of three prompts equal."""
    vocab = quantized.config.vocab_size
    ids = _prompt(30, vocab, 1)
    logits = []
    for loaded in (quantized, reference):
        runner = ModelRunner(loaded, block_size=16, num_blocks=32, native_attention=native)
        table = TinyAllocator(32).take(2)
        logits.append(torch.cat([runner.execute([SeqChunk(ids[s:s + 6], s, table)], return_all_logits=True)
                                 for s in range(0, 30, 6)]))
    torch.testing.assert_close(logits[0], logits[1], atol=2e-4, rtol=2e-4)
    prompts = [_prompt(n, vocab, 10 + n) for n in (11, 19, 4)]
    want = paged_greedy(ModelRunner(reference, block_size=4, num_blocks=96), prompts, 16)
    assert paged_greedy(ModelRunner(quantized, block_size=4, num_blocks=96), prompts, 16, chunk=6) == want


@pytest.mark.parametrize("name", list(HF_CASES))
def test_q8_0_experts_equal_the_dequantized_float_model(name: str, tmp_path: Path) -> None:
    folder = _hf_folder(tmp_path, name)
    quantized, reference = load_model(str(folder), quantization="q8_0"), load_model(str(folder), quantization="none")
    sparse = [layer.mlp for layer in quantized.model.layers if hasattr(layer.mlp, "EXPERT_WEIGHTS")]
    assert sparse and all(isinstance(m.gate_up, QuantExperts) and isinstance(m.down, QuantExperts)
                          and m.gate_up.fmt == "q8_0" for m in sparse)
    assert all(type(m.router) is torch.nn.Parameter for m in sparse)  # the router stays float
    # 8-bit: one byte a weight plus a float32 scale per 32 (1.125 bytes), against 4 in float32
    got, weights = _expert_bytes(quantized.model)
    assert got == weights * 9 // 8 and _expert_bytes(reference.model)[0] == weights * 4
    _dequantized_into(quantized.model, reference.model)
    _same_outputs(quantized, reference)


def test_experts_run_one_kernel_call_per_active_expert(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Grouped by expert under quantization too: one call per expert that got rows, over all of
    them, on the native kernel and on the plain-PyTorch fallback alike."""
    loaded = load_model(str(_hf_folder(tmp_path, "qwen3_moe")), quantization="q8_0")
    layer = loaded.model.layers[0].mlp
    x = torch.randn(23, TINY["hidden_size"], generator=torch.Generator().manual_seed(0))
    calls: list[tuple[int, int]] = []
    real = QuantExperts.linear

    def counting(self: QuantExperts, expert: int, rows: torch.Tensor, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
        calls.append((expert, rows.shape[0]))
        return real(self, expert, rows, out)

    monkeypatch.setattr(QuantExperts, "linear", counting)
    outs = []
    for native in (None, False):
        layer.gate_up.native = layer.down.native = native
        calls.clear()
        with torch.inference_mode():
            outs.append(layer(x))
        gate_up_calls = calls[0::2]  # gate/up then down, expert by expert
        assert len(calls) == 2 * len({e for e, _ in gate_up_calls}) and sum(n for _, n in gate_up_calls) == 23 * 3
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


# GGUF (Mixtral's layout, llama with experts): "auto" keeps Q8_0 experts 8-bit and Q4_0 ones at
# 4 bits; "q8_0" keeps every expert 8-bit, a Q4_0 gate beside a Q4_1 up (offsets) joined with zero
# offsets for the gate's rows. All of these are exact in their layout: the experts of the float load
# ("none") of the same file are the file's values, as the quantized ones.
GGUF_CASES = {
    "auto": ("auto", {"ffn_gate_exps.weight": "Q8_0", "ffn_up_exps.weight": "Q8_0", "ffn_down_exps.weight": "Q4_0"},
             {"gate_up": "q8_0", "down": "i4"}),
    "q8_0": ("q8_0", {"ffn_gate_exps.weight": "Q4_0", "ffn_up_exps.weight": "Q4_1", "ffn_down_exps.weight": "Q8_0"},
             {"gate_up": "q8_0+offsets", "down": "q8_0"}),
    # a Q4_K_M file's experts (K-quants: rows of 256): Q4_K gate/up at 4 bits, Q6_K down at 6
    "auto_k": ("auto", {"ffn_gate_exps.weight": "Q4_K", "ffn_up_exps.weight": "Q4_K", "ffn_down_exps.weight": "Q6_K"},
               {"gate_up": "u4+offsets", "down": "i6"}),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_quantized_experts_are_kept_and_equal_the_float_load(case: str, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = pytest.importorskip("gguf")
    from pagedkv_testing.quantized_gguf import write_gguf

    quantization, types, formats = GGUF_CASES[case]
    path = tmp_path / "moe.gguf"
    sizes = dict(hidden=256, ffn=256) if case == "auto_k" else {}
    write_gguf(path, {k: gguf.GGMLQuantizationType[v] for k, v in types.items()}, tied=False, experts=5, **sizes)
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    quantized, reference = load_model(str(path), quantization=quantization), load_model(str(path), quantization="none")
    assert quantized.config.moe is not None and quantized.config.moe.num_experts == 5
    for layer, float_layer in zip(quantized.model.layers, reference.model.layers, strict=True):
        for name, fmt in formats.items():
            experts = getattr(layer.mlp, name)
            assert isinstance(experts, QuantExperts)
            assert experts.fmt + ("+offsets" if experts.offsets is not None else "") == fmt
            assert torch.equal(experts.weight, getattr(float_layer.mlp, name).detach())  # the file's values
    got, weights = _expert_bytes(quantized.model)
    assert got < weights * 1.3  # 8-bit, 4-bit with scales and offsets: well under float32's 4 bytes
    _dequantized_into(quantized.model, reference.model)  # "q8_0" requantizes the F32 attention weights
    _same_outputs(quantized, reference)

