"""Tensor-parallel shards of tiny random models (models/sharding.py) on 2 and 3 gloo ranks against one
rank: the same greedy tokens over 16 prompts and logits within 1e-4, through each rank's ModelRunner
(prefill, then decode steps), for Llama with fewer KV heads than ranks (replicated), Qwen3 (per-head
q/k norms, KV heads divided), Gemma 3 (hybrid sliding window, softcaps), Phi-3 (fused q/k/v and
gate/up checkpoints), DeepSeek-V3 (MLA + routed and shared experts), Qwen3-MoE, plus int8 KV blocks
(per-block scales of the rank's heads), Q8_0 weights, LoRA adapters (separate and fused parts) and a
Q8_0 GGUF whose row-parallel blocks do not divide over the ranks (dequantized for sharding), dense
and with 8-bit experts, and one in low-bit layouts (K-quants, IQ4_NL, Q4_1 split inside a block). Plus
what is refused by name, and the split rules.

One spawn of N ranks runs every model (the cost is the processes' start-up); the checkpoints are
written once per module. ``PAGEDKV_FULL_MATRIX=1`` decodes more steps.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv.distributed.group import ShardingError, TPGroup, kv_head_range, vocab_range
from pagedkv.models.config import ModelConfig
from pagedkv.models.sharding import local_config, param_split
from pagedkv_testing.hf_checkpoints import make_hf_checkpoint, randomize_
from pagedkv_testing.tp_ranks import run_ranks, sharded_greedy

pytestmark = [pytest.mark.serial]
FULL = os.environ.get("PAGEDKV_FULL_MATRIX") == "1"  # docs/environment.md
STEPS = 6 if FULL else 3
# query heads 6 and intermediate sizes divisible by 2 and 3; vocab 250: padded at 3 ranks
COMMON: dict[str, Any] = dict(vocab_size=250, hidden_size=48, intermediate_size=96, num_attention_heads=6)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_kv1": ("llama", dict(num_key_value_heads=1, attention_bias=True)),  # KV replicated; row-parallel bias
    "qwen3": ("qwen3", dict(num_key_value_heads=6, head_dim=8)),
    "gemma3": ("gemma3", dict(num_key_value_heads=1, head_dim=16, num_hidden_layers=3, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              final_logit_softcapping=5.0, query_pre_attn_scalar=16)),
    "phi3": ("phi3", dict(num_key_value_heads=6)),
}


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(35)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 14))] for _ in range(16)]


def _moe_checkpoint(tmp: Path, kind: str) -> Path:
    import transformers

    if kind == "deepseek_v3":
        config: Any = transformers.DeepseekV3Config(
            **COMMON, num_hidden_layers=2, num_key_value_heads=6, max_position_embeddings=256, rms_norm_eps=1e-5,
            n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24, first_k_dense_replace=1,
            n_shared_experts=1, n_group=4, topk_group=2, kv_lora_rank=20, q_lora_rank=18, qk_rope_head_dim=6,
            qk_nope_head_dim=10, v_head_dim=14, routed_scaling_factor=2.5)
        cls: Any = transformers.DeepseekV3ForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(**COMMON, num_hidden_layers=2, num_key_value_heads=6, head_dim=8,
                                             num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24,
                                             norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=256)
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    randomize_(model, 3)
    with torch.no_grad():  # a correction bias that changes the choice (zero in a fresh model)
        for name, b in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=torch.Generator().manual_seed(1)))
    folder = tmp / "model"
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """name -> case of ``sharded_greedy`` (the checkpoints written once)."""
    from pagedkv_testing.quantized_gguf import EXACT, Q, write_gguf

    root = tmp_path_factory.mktemp("tp_models")
    out: dict[str, dict[str, Any]] = {}
    for name, (kind, over) in MODELS.items():
        folder = make_hf_checkpoint(root / name, kind, seed=len(name), **{**COMMON, "num_hidden_layers": 2, **over})
        out[name] = dict(folder=str(folder), prompts=_prompts(COMMON["vocab_size"]), steps=STEPS)
    for kind in ("deepseek_v3", "qwen3_moe"):
        out[kind] = dict(folder=str(_moe_checkpoint(root / kind, kind)), prompts=_prompts(250), steps=STEPS)
    # int8 KV blocks: per-block scales over the rank's own heads
    out["qwen3_int8_kv"] = {**out["qwen3"], "kv_cache_dtype": "int8"}
    # Q8_0 weights quantized as they load: each rank quantizes its shard, whose row-parallel inputs
    # (q 6 x 32, intermediate 192) split into whole blocks of 32 at 2 and 3 ranks
    aligned = make_hf_checkpoint(root / "q8_0", "llama", seed=8, **{**COMMON, "hidden_size": 96, "head_dim": 32,
                                                                    "intermediate_size": 192, "num_key_value_heads": 1,
                                                                    "num_hidden_layers": 2})
    out["llama_q8_0"] = dict(folder=str(aligned), prompts=_prompts(250), steps=STEPS, quantization="q8_0")
    # a GGUF with Q8_0/Q4_0 matrices kept 8-bit: ffn_down's 96 inputs split 48/48 inside blocks of 32
    # LoRA on shards: q/k/v and gate/up (B's rows split), o and down (A's columns split); and on Phi-3's
    # fused q/k/v and gate/up, where one adapter part spans several runs of the rank's rows
    from pagedkv_testing.lora_adapters import make_adapter

    for base in ("llama_kv1", "phi3"):
        targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if base == "phi3" else \
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        make_adapter(Path(out[base]["folder"]), root / f"{base}_lora", seed=5, std=0.1, r=4, lora_alpha=8,
                     target_modules=targets)
        out[f"{base}_lora"] = {**out[base], "lora": str(root / f"{base}_lora")}
    gguf_path = root / "exact.gguf"
    write_gguf(gguf_path, EXACT, tied=True, seed=4)
    out["gguf_q8_0"] = dict(folder=str(gguf_path), prompts=_prompts(128), steps=STEPS, quantization="auto")
    # Mixtral's layout with 8-bit experts (QuantExperts): gate/up rows split, down's 96 inputs dequantized
    moe_path = root / "experts.gguf"
    write_gguf(moe_path, {**EXACT, "ffn_gate_exps.weight": Q.Q8_0, "ffn_up_exps.weight": Q.Q4_0,
                          "ffn_down_exps.weight": Q.Q8_0}, tied=True, seed=6, experts=4)
    out["gguf_experts_q8_0"] = dict(folder=str(moe_path), prompts=_prompts(128), steps=STEPS, quantization="auto")
    # low-bit layouts kept packed ("auto"): K-quants and IQ4_NL split at whole blocks; ffn_down (Q4_1,
    # 96 inputs) split inside a block, dequantized from its low-bit blocks
    lowbit = {"attn_q.weight": Q.Q4_K, "attn_k.weight": Q.Q4_1, "attn_v.weight": Q.Q5_0, "attn_output.weight": Q.Q5_K,
              "ffn_gate.weight": Q.Q6_K, "ffn_up.weight": Q.IQ4_NL, "ffn_down.weight": Q.Q4_1,
              "token_embd.weight": Q.Q8_0, "output.weight": Q.Q6_K}
    lowbit_path = root / "lowbit.gguf"
    write_gguf(lowbit_path, lowbit, tied=False, seed=7, hidden=256, ffn=96)
    out["gguf_lowbit"] = dict(folder=str(lowbit_path), prompts=_prompts(128), steps=STEPS, quantization="auto")
    return out


TP2 = ["llama_kv1", "qwen3", "gemma3", "phi3", "deepseek_v3", "qwen3_moe", "qwen3_int8_kv", "llama_q8_0",
       "llama_kv1_lora", "phi3_lora", "gguf_q8_0", "gguf_experts_q8_0", "gguf_lowbit"]
# the GGUFs' 4 heads do not split over 3
TP3 = [n for n in TP2 if not n.startswith("gguf")]


@pytest.fixture(scope="module")
def results(cases: dict[str, dict[str, Any]]) -> dict[int, dict[str, dict[str, Any]]]:
    """TP size -> name -> rank 0's tokens and logits (TP 1 in this process)."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    ref = sharded_greedy(None, [cases[n] for n in TP2])
    assert ref is not None
    out[1] = dict(zip(TP2, ref))
    for size, names in ((2, TP2), (3, TP3)):
        got = run_ranks(size, sharded_greedy, ([cases[n] for n in names],))[0]
        out[size] = dict(zip(names, got))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("name", TP2)
def test_tp_shards_give_one_ranks_tokens_and_logits(name: str, size: int,
                                                    results: dict[int, dict[str, dict[str, Any]]]) -> None:
    if name not in results[size]:
        pytest.skip(f"{name} does not split over {size} ranks (test_unsplittable_shapes_are_refused_by_name)")
    ref, got = results[1][name], results[size][name]
    assert got["tokens"] == ref["tokens"]
    assert got["logits"].shape == ref["logits"].shape
    err = float((got["logits"] - ref["logits"]).abs().max())
    assert err <= 1e-4, f"{name} at TP={size}: logits differ by {err}"


@pytest.mark.slow
def test_rank_holds_its_kv_heads(results: dict[int, dict[str, dict[str, Any]]]) -> None:
    """The rank-local config sizes each rank's KV cache: divided, replicated, MLA's latent whole."""
    assert results[2]["qwen3"]["kv_heads"] == 3 and results[3]["qwen3"]["kv_heads"] == 2
    assert results[1]["llama_kv1"]["kv_heads"] == results[3]["llama_kv1"]["kv_heads"] == 1
    assert results[3]["deepseek_v3"]["kv_heads"] == 1


@pytest.mark.slow
def test_the_adapters_change_the_outputs(results: dict[int, dict[str, dict[str, Any]]]) -> None:
    """The LoRA cases test something: the adapter moves the base model's logits."""
    for base in ("llama_kv1", "phi3"):
        assert float((results[1][f"{base}_lora"]["logits"] - results[1][base]["logits"]).abs().max()) > 1e-2


def _config(**over: Any) -> ModelConfig:
    base: dict[str, Any] = dict(model_type="llama", vocab_size=250, hidden_size=48, intermediate_size=96,
                                num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=8)
    return ModelConfig(**{**base, **over})


def test_unsplittable_shapes_are_refused_by_name() -> None:
    with pytest.raises(ShardingError, match=r"num_attention_heads = 6 is not divisible by 4.*would work: 1, 2, 3, 6"):
        local_config(_config(num_key_value_heads=6), TPGroup(0, 4))
    with pytest.raises(ShardingError, match="num_key_value_heads = 2"):
        local_config(_config(), TPGroup(0, 3))
    with pytest.raises(ShardingError, match="intermediate_size = 100 is not divisible by 3"):
        local_config(_config(intermediate_size=100, num_key_value_heads=6), TPGroup(0, 3))


def test_split_rules() -> None:
    """KV heads replicated as vLLM does (rank r: the head its query heads use), the vocabulary padded,
    fused q/k/v split per part, row-parallel biases on rank 0 alone."""
    assert [kv_head_range(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]
    assert [vocab_range(250, r, 3) for r in range(3)] == [(0, 84), (84, 168), (168, 250)]
    cfg = _config()
    qkv = param_split(cfg, "layers.0.self_attn.qkv_proj.weight", TPGroup(1, 2))
    assert qkv is not None and qkv.dim == 0
    # q rows 24..48 of 48, k rows of head 1 (48 + 8..16), v rows of head 1 (64 + 8..16)
    assert [(s.rank_start, s.rank_end, s.local) for s in qkv.segments] == [(24, 48, 0), (56, 64, 24), (72, 80, 32)]
    o = param_split(cfg, "layers.0.self_attn.o_proj.qweight", TPGroup(1, 2))
    assert o is not None and o.dim == 1 and (o.segments[0].rank_start, o.segments[0].rank_end) == (24, 48)
    bias = param_split(cfg, "layers.0.mlp.down_proj.bias", TPGroup(1, 2))
    assert bias is not None and bias.rank0_only
    assert param_split(cfg, "layers.0.input_layernorm.weight", TPGroup(1, 2)) is None
    assert param_split(cfg, "layers.0.self_attn.qkv_proj.weight", TPGroup(0, 1)) is None


def test_safetensors_entries_read_rows_columns_and_into_a_destination(tmp_path: Path) -> None:
    """The sharded loader's reader (models/hf_loader.py) against safetensors' own slices."""
    from safetensors.torch import save_file

    from pagedkv.models.hf_loader import iter_safetensors_entries

    tensors = {"a": torch.randn(5, 70, 9), "b": torch.randn(33, 17).to(torch.bfloat16), "c": torch.randn(4)}
    save_file(tensors, str(tmp_path / "t.safetensors"))
    indices = [None, (slice(1, 3),), (slice(None), slice(5, 9)), (slice(None), slice(None), slice(2, 7)),
               (slice(1, 4), slice(3, 8))]
    for name, entry in iter_safetensors_entries([tmp_path / "t.safetensors"]):
        whole = tensors[name]
        assert entry.shape == tuple(whole.shape)
        for index in indices:
            if index is not None and len(index) > whole.dim():
                continue
            want = whole if index is None else whole[index]
            assert torch.equal(entry.read(index), want), (name, index)
            for dtype in (whole.dtype, torch.float64):  # straight into it, or converted
                out = torch.zeros(want.shape, dtype=dtype)
                assert entry.read(index, out) is out and torch.equal(out, want.to(dtype)), (name, index, dtype)


def test_a_rank_reads_only_its_shard(cases: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch,
                                     caplog: pytest.LogCaptureFixture) -> None:
    """In this process (no collective runs while loading): rank 1 of 2 reads no more elements than
    its parameters hold, about half the checkpoint's; a quantized tensor split inside a block of 32
    is dequantized for the shard, with a log line."""
    import logging

    from pagedkv.models import load_model
    from pagedkv.models.gguf_loader import converted_folder
    from pagedkv.models.hf_loader import SafetensorsEntry

    read_elements = []
    original = SafetensorsEntry.read

    def counting(self: SafetensorsEntry, index: Any = None, out: Any = None) -> torch.Tensor:
        got = original(self, index, out)
        read_elements.append((got.numel(), int(torch.tensor(self.shape).prod())))
        return got

    monkeypatch.setattr(SafetensorsEntry, "read", counting)
    loaded = load_model(cases["qwen3"]["folder"], quantization="none", tp=TPGroup(1, 2))
    held = sum(p.numel() for p in loaded.model.parameters())
    read, whole = sum(n for n, _ in read_elements), sum(n for _, n in read_elements)
    assert read <= held and read < 0.6 * whole
    assert loaded.config.num_attention_heads == 3 and loaded.full_config is not None
    assert loaded.full_config.num_attention_heads == 6
    folder = converted_folder(Path(cases["gguf_q8_0"]["folder"]), "auto")
    with caplog.at_level(logging.INFO, logger="pagedkv.models.weights"):
        shard = load_model(str(folder), quantization="auto", tp=TPGroup(1, 2))
    assert "dequantized for this rank's shard" in caplog.text
    assert type(shard.model.layers[0].mlp.down_proj) is torch.nn.Linear  # 48 of 96 inputs: inside a block
    assert type(shard.model.layers[0].self_attn.o_proj).__name__ == "QuantLinear"  # 32 of 64: whole blocks
