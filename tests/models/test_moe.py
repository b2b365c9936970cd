"""Mixture-of-experts layers (models/moe.py): tiny random Mixtral / Qwen2-MoE / Qwen3-MoE checkpoints
against transformers (float32), DeepSeek-V2/V3 routing against transformers' own MoE blocks, and
what is refused or skipped by name."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv.model_shape import shape_from_hf_dict
from pagedkv.models import load_model
from pagedkv.models.config import ModelConfig, moe_from_hf
from pagedkv.models.errors import UnsupportedModelError
from pagedkv.models.moe import MoEMLP
from pagedkv.models.weights import build_model
from pagedkv_testing.hf_checkpoints import load_hf_reference, randomize_
from pagedkv_testing.moe_cases import prompt as _prompt
from pagedkv_testing.moe_cases import transformers_tests

TINY: dict[str, Any] = dict(vocab_size=200, hidden_size=48, intermediate_size=72, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
# name -> (transformers config class, model class, overrides): odd sizes, dense and sparse layers mixed
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # every-other-layer sparse and layer 2 forced dense; renormalized top-k; head_dim off hidden/heads
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=7, num_experts_per_tok=3, moe_intermediate_size=20, norm_topk_prob=True, head_dim=10,
        decoder_sparse_step=1, mlp_only_layers=[1])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=5, num_experts_per_tok=2)),
    # gated shared expert; top-k weights not renormalized
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=28, shared_expert_intermediate_size=36,
        norm_topk_prob=False, decoder_sparse_step=2)),
}
FULL = os.environ.get("PAGEDKV_MOE_FULL_MATRIX") == "1"  # docs/environment.md


def _make(tmp: Path, name: str, seed: int) -> Path:
    import transformers

    cfg_cls, model_cls, overrides = CASES[name]
    config = getattr(transformers, cfg_cls)(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    randomize_(model, seed)
    folder = tmp / "model"
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return {}


def _case(name: str, tmp_path_factory: pytest.TempPathFactory, cache: dict[str, Any]) -> Any:
    if name not in cache:
        folder = _make(tmp_path_factory.mktemp(name), name, seed=len(name))
        cache[name] = (load_hf_reference(folder), load_model(str(folder)))
    return cache[name]


@pytest.mark.parametrize("name", list(CASES))
def test_config_reads_the_routing(name: str, tmp_path_factory: pytest.TempPathFactory,
                                  built: dict[str, Any]) -> None:
    _, loaded = _case(name, tmp_path_factory, built)
    cfg: ModelConfig = loaded.config
    assert cfg.moe is not None
    sparse = {"qwen3_moe": {0, 2}, "mixtral": {0, 1, 2}, "qwen2_moe": {1}}[name]
    assert cfg.moe.sparse_layers == sparse
    assert [type(layer.mlp).__name__ for layer in loaded.model.layers] == [
        "MoEMLP" if i in sparse else "LlamaMLP" for i in range(3)]
    # to_hf_dict (what a GGUF conversion writes) reads back to the same config
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


# prefill logits (block sizes 1, 16, 64) and greedy 32 tokens (native, plain) against transformers
test_prefill_logits_whole_and_in_chunks, test_greedy_32_tokens_match_transformers = transformers_tests(
    list(CASES), _case, 40, FULL)


def _deepseek_moe(version: int, **overrides: Any) -> tuple[torch.nn.Module, dict[str, Any]]:
    """transformers' DeepSeek MoE block of a tiny random config, and that config's dict."""
    import transformers

    cls = transformers.DeepseekV3Config if version == 3 else transformers.DeepseekV2Config
    config = cls(**{**TINY, "n_routed_experts": 12, "num_experts_per_tok": 3, "moe_intermediate_size": 20,
                    "n_shared_experts": 2, "first_k_dense_replace": 1, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 12, "v_head_dim": 10, **overrides})
    model = (transformers.DeepseekV3ForCausalLM if version == 3 else transformers.DeepseekV2ForCausalLM)(config)
    randomize_(model, version)
    block = model.model.layers[1].mlp
    if version == 3:  # a correction bias that changes the choice (zero in a fresh model)
        with torch.no_grad():
            block.gate.e_score_correction_bias.copy_(torch.randn(12, generator=torch.Generator().manual_seed(7)))
    return block.eval(), config.to_dict()


@pytest.mark.parametrize("version,overrides", [
    (3, dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
    (3, dict(n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False)),
    (2, dict(topk_method="group_limited_greedy", n_group=3, topk_group=2, routed_scaling_factor=1.5)),
    (2, dict(topk_method="greedy", routed_scaling_factor=1.0)),
], ids=["v3_groups", "v3_plain", "v2_group_limited", "v2_greedy"])
def test_deepseek_routing_matches_transformers(version: int, overrides: dict[str, Any]) -> None:
    """DeepSeek's routing (sigmoid scores + correction bias + group-limited top-k, V2's softmax
    variants; shared experts; routed_scaling_factor) on transformers' own MoE block's weights."""
    block, d = _deepseek_moe(version, **overrides)
    shape = shape_from_hf_dict(d)
    moe = moe_from_hf(d, shape)
    assert moe is not None and moe.sparse_layers == {1, 2}  # first_k_dense_replace=1
    ours = _our_moe_from(block, shape, moe)
    x = torch.randn(37, TINY["hidden_size"], generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = block(x.unsqueeze(0))[0]
        got = ours(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _our_moe_from(block: torch.nn.Module, shape: Any, moe: Any) -> MoEMLP:
    """Our MoEMLP with ``block``'s weights (the routing config read from config.json)."""
    from types import SimpleNamespace

    # MoEMLP reads only these two fields of a ModelConfig: a namespace stands in for it.
    ours = MoEMLP(SimpleNamespace(moe=moe, hidden_size=shape.hidden_size))  # type: ignore[arg-type]
    state = block.state_dict()
    inter = moe.intermediate_size
    with torch.no_grad():
        ours.router.copy_(state["gate.weight"])
        if ours.e_score_correction_bias is not None:
            ours.e_score_correction_bias.copy_(state["gate.e_score_correction_bias"])
        ours.gate_up.copy_(state["experts.gate_up_proj"])
        ours.down.copy_(state["experts.down_proj"])
        assert ours.shared is not None and ours.gate_up.shape[1] == 2 * inter
        ours.shared.gate_up_proj.weight.copy_(torch.cat((state["shared_experts.gate_proj.weight"],
                                                         state["shared_experts.up_proj.weight"])))
        ours.shared.down_proj.weight.copy_(state["shared_experts.down_proj.weight"])
    return ours.eval()


def test_experts_run_one_matmul_each_over_their_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Grouped by expert: one router matmul, then one gate/up matmul per expert that received rows
    (each over all of its rows), whatever the number of tokens; never a loop over tokens."""
    import pagedkv.models.moe as moe_module
    from pagedkv.models.config import MoEConfig

    moe = MoEConfig(num_experts=12, top_k=3, intermediate_size=8, sparse_layers=frozenset({0}))
    # A stand-in for ModelConfig with the two fields MoEMLP reads.
    layer = MoEMLP(type("C", (), {"moe": moe, "hidden_size": 16})())  # type: ignore[arg-type]
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    rows: list[int] = []
    real = moe_module.F.linear

    def counting(x: torch.Tensor, w: torch.Tensor, *args: Any) -> torch.Tensor:
        rows.append(x.shape[0])
        return real(x, w, *args)

    monkeypatch.setattr(moe_module.F, "linear", counting)
    x = torch.randn(50, 16, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = layer(x)
    _, ids = moe_module.route(moe, real(x, layer.router), None)
    active = torch.unique(ids).numel()
    assert len(rows) == 1 + active and rows[0] == 50 and sum(rows[1:]) == 50 * 3
    # the same as computing every token alone
    with torch.inference_mode():
        alone = torch.cat([layer(x[i:i + 1]) for i in range(50)])
    torch.testing.assert_close(out, alone, atol=1e-5, rtol=1e-5)


def test_deepseek_moe_layer_freq_and_first_dense_pick_the_sparse_layers() -> None:
    d = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **TINY, "num_hidden_layers": 7,
         "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "first_k_dense_replace": 2,
         "moe_layer_freq": 2, "n_group": 2, "topk_group": 1, "kv_lora_rank": 16, "qk_rope_head_dim": 4,
         "qk_nope_head_dim": 8, "v_head_dim": 8}
    moe = ModelConfig.from_hf_dict(d).moe
    assert moe is not None and moe.sparse_layers == {2, 4, 6}
    assert (moe.scoring, moe.group_score, moe.correction_bias, moe.norm_topk_prob) == ("sigmoid", "top2_sum", True,
                                                                                       True)


def test_group_limited_choice_stays_in_the_best_groups() -> None:
    """With topk_group of n_group groups, every chosen expert lies in one of the kept groups."""
    from pagedkv.models.config import MoEConfig
    from pagedkv.models.moe import route

    moe = MoEConfig(num_experts=16, top_k=4, intermediate_size=8, sparse_layers=frozenset({0}), scoring="sigmoid",
                    n_group=8, topk_group=2, group_score="top2_sum", correction_bias=True)
    logits = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(16, generator=torch.Generator().manual_seed(1))
    weights, ids = route(moe, logits, bias)
    assert torch.allclose(weights.sum(-1), torch.ones(64))  # renormalized
    groups = (ids // 2)  # 8 groups of 2 experts
    assert all(len(set(row)) <= 2 for row in groups.tolist())
    choice = logits.sigmoid() + bias
    best = choice.view(64, 8, 2).topk(2, dim=-1)[0].sum(-1).topk(2, dim=-1)[1]
    assert all(set(g) <= set(b) for g, b in zip(groups.tolist(), best.tolist()))


def test_lora_slots_are_refused_on_expert_layers(tmp_path_factory: pytest.TempPathFactory,
                                                built: dict[str, Any]) -> None:
    from pagedkv.lora.layers import apply_lora

    _, loaded = _case("mixtral", tmp_path_factory, built)
    with pytest.raises(ValueError, match="layer 0 has no mlp.gate_up_proj .*leave enable_lora off"):
        apply_lora(loaded.model, max_loras=1, max_rank=4)
    assert type(loaded.model.layers[0].self_attn.qkv_proj).__name__ != "LoRALinear"  # nothing wrapped


def test_sparse_attention_v32_is_refused_by_name() -> None:
    d = {"architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", **TINY, "index_topk": 2048}
    with pytest.raises(UnsupportedModelError, match="DeepseekV32ForCausalLM.*sparse attention.*index_topk"):
        ModelConfig.from_hf_dict(d)


def test_fp8_block_scaled_checkpoint_is_refused_naming_the_field() -> None:
    d = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **TINY, "num_local_experts": 4,
         "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}}
    with pytest.raises(UnsupportedModelError, match=r"quantization_config \(quant_method 'fp8', "
                                                    r"weight_block_size \[128, 128\]\)"):
        ModelConfig.from_hf_dict(d)


def test_unknown_routing_is_refused_by_name() -> None:
    d = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **TINY, "num_local_experts": 4,
         "num_experts_per_tok": 5}
    with pytest.raises(ValueError, match="num_experts_per_tok must be in"):
        ModelConfig.from_hf_dict(d)


def test_multi_token_prediction_layers_are_skipped_with_a_log_line(
        tmp_path_factory: pytest.TempPathFactory, built: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint's layers past num_hidden_layers (DeepSeek-V3's MTP layer 61 of 61) are skipped
    with one log line naming them; no unknown-tensor warning for them."""
    ref, loaded = _case("mixtral", tmp_path_factory, built)
    cfg: ModelConfig = loaded.config
    # the LM head from transformers' model: a runner packs the loaded one's (models/packed_linear.py)
    tensors = [(f"model.{name}" if name.startswith("layers.") or name in ("embed_tokens.weight", "norm.weight")
                else name, t) for name, t in _checkpoint_of(loaded.model, cfg, ref.lm_head.weight)]
    mtp = [(f"model.layers.3.{suffix}", torch.zeros(2)) for suffix in ("enorm.weight", "eh_proj.weight",
                                                                        "mlp.experts.0.w1.weight")]
    with caplog.at_level(logging.INFO, logger="pagedkv.models.weights"):
        model = build_model(cfg, tensors + mtp)
    assert "skipped the checkpoint's layers 3 past num_hidden_layers=3" in caplog.text
    ids = torch.tensor(_prompt(9, cfg.vocab_size, 4))
    with torch.inference_mode():
        assert torch.equal(model(ids, torch.arange(9), _causal)[-1].argmax(), loaded.model(ids, torch.arange(9),
                                                                                               _causal)[-1].argmax())


def _checkpoint_of(model: torch.nn.Module, cfg: ModelConfig, head: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """HF-named tensors of a loaded Mixtral (experts split back per expert, q/k/v and gate/up unfused)
    with LM head ``head``."""
    out: list[tuple[str, torch.Tensor]] = [("embed_tokens.weight", model.embed_tokens.weight),
                                           ("norm.weight", model.norm.weight), ("lm_head.weight", head)]
    q, kv = cfg.q_size, cfg.kv_size
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."
        qkv = layer.self_attn.qkv_proj.weight
        out += [(p + "self_attn.q_proj.weight", qkv[:q]), (p + "self_attn.k_proj.weight", qkv[q:q + kv]),
                (p + "self_attn.v_proj.weight", qkv[q + kv:]),
                (p + "self_attn.o_proj.weight", layer.self_attn.o_proj.weight),
                (p + "input_layernorm.weight", layer.input_layernorm.weight),
                (p + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight),
                (p + "block_sparse_moe.gate.weight", layer.mlp.router)]
        inter = cfg.moe.intermediate_size if cfg.moe else 0
        for e in range(cfg.num_experts):
            out += [(p + f"block_sparse_moe.experts.{e}.w1.weight", layer.mlp.gate_up[e, :inter]),
                    (p + f"block_sparse_moe.experts.{e}.w3.weight", layer.mlp.gate_up[e, inter:]),
                    (p + f"block_sparse_moe.experts.{e}.w2.weight", layer.mlp.down[e])]
    return [(n, t.detach().clone()) for n, t in out]


def _causal(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           is_causal=True)
    return out.transpose(0, 1)
