"""Shared setup of the MoE and MLA model tests (tests/models/test_moe*.py, test_mla*.py): tiny
random DeepSeek-V2 / V3 checkpoints of odd shapes, and the two checks every family runs against
transformers (prefill logits whole and in chunks of 6; greedy 32 tokens on an attention path).

Imported explicitly (``from pagedkv_testing.moe_cases import ...``); pytest does not collect it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pagedkv.runner import ModelRunner, SeqChunk
from pagedkv_testing.hf_checkpoints import (
    TinyAllocator,
    check_greedy_both_ways,
    hf_greedy,
    hf_logits,
    paged_greedy,
    randomize_,
)

# DeepSeek's tiny shape: odd latent (20 + 6), 3 heads, 8 routed experts, layer 0 dense
DEEPSEEK_TINY: dict[str, Any] = dict(
    vocab_size=256, hidden_size=48, intermediate_size=72, num_hidden_layers=3, num_attention_heads=3,
    num_key_value_heads=3, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=20, first_k_dense_replace=1,
    kv_lora_rank=20, qk_rope_head_dim=6, qk_nope_head_dim=10, v_head_dim=14)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
# name -> (DeepSeek version, overrides)
DEEPSEEK_CASES: dict[str, tuple[int, dict[str, Any]]] = {
    # V2 / V2-Lite: no q_lora_rank, softmax greedy routing, one shared expert, interleaved RoPE
    "v2_no_q_lora": (2, dict(q_lora_rank=None, n_shared_experts=1, topk_method="greedy")),
    # V2 with q_lora_rank, group-limited routing, YaRN with DeepSeek's mscale, scaled weights
    "v2_q_lora_yarn": (2, dict(q_lora_rank=18, n_shared_experts=2, topk_method="group_limited_greedy", n_group=4,
                               topk_group=2, routed_scaling_factor=1.7, rope_parameters=YARN)),
    # V3: sigmoid + correction bias, group-limited (n_group / topk_group), first_k_dense_replace, no interleave
    "v3_groups": (3, dict(q_lora_rank=18, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                          rope_interleave=False, rope_parameters=YARN)),
}


def make_deepseek(tmp: Path, version: int, seed: int, **overrides: Any) -> Path:
    """A tiny random DeepSeek-V2 / V3 checkpoint folder (``DEEPSEEK_TINY`` with ``overrides``) under
    ``tmp``, its correction bias (V3) nonzero so that it changes the routing."""
    import transformers

    if version == 3:
        config: Any = transformers.DeepseekV3Config(**{**DEEPSEEK_TINY, **overrides})
        cls: Any = transformers.DeepseekV3ForCausalLM
    else:
        config = transformers.DeepseekV2Config(**{**DEEPSEEK_TINY, **overrides})
        cls = transformers.DeepseekV2ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).eval()
    randomize_(model, seed)
    with torch.no_grad():  # a correction bias that changes the choice (zero in a fresh model)
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=torch.Generator().manual_seed(seed)))
    folder = tmp / "model"
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    """``n`` random token ids in ``3 .. vocab - 1`` (no BOS / EOS)."""
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_prefill_logits(ref: torch.nn.Module, loaded: Any, n: int, block_size: int, **runner: Any) -> None:
    """``loaded``'s prefill logits of an ``n``-token prompt equal transformers' (``ref``) within
    1e-4, whole and in chunks of 6; ``runner``: more ModelRunner arguments (an attention backend)."""
    ids = prompt(n, loaded.config.vocab_size, 1)
    want = hf_logits(ref, ids)
    num_blocks = 48 + n // block_size
    table = TinyAllocator(num_blocks).take(-(-n // block_size))
    got = ModelRunner(loaded, block_size=block_size, num_blocks=num_blocks, **runner).execute(
        [SeqChunk(ids, 0, table)], return_all_logits=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    chunked = ModelRunner(loaded, block_size=block_size, num_blocks=num_blocks, **runner)
    parts = [chunked.execute([SeqChunk(ids[s:s + 6], s, table)], return_all_logits=True) for s in range(0, n, 6)]
    torch.testing.assert_close(torch.cat(parts), want, atol=1e-4, rtol=1e-4)


def check_greedy_32(ref: torch.nn.Module, loaded: Any, native: bool, memo: dict[Any, Any], key: str,
                    block_sizes: tuple[int, ...] = ()) -> None:
    """Greedy 32 tokens of three prompts equal transformers' (computed once per ``key`` in ``memo``),
    whole prompts batched and 6-token chunks mixed with decodes (``check_greedy_both_ways``), then
    at each of ``block_sizes`` in chunks."""
    prompts = [prompt(n, loaded.config.vocab_size, 10 + n) for n in (13, 21, 5)]
    if (key, "greedy") not in memo:  # one reference for both attention paths
        memo[key, "greedy"] = [hf_greedy(ref, p, 32) for p in prompts]
    want = memo[key, "greedy"]
    check_greedy_both_ways(loaded, prompts, want, native=native, num_blocks=128, chunk=6)
    for block_size in block_sizes:
        runner = ModelRunner(loaded, block_size=block_size, num_blocks=256, native_attention=native)
        assert paged_greedy(runner, prompts, 32, chunk=6) == want


def transformers_tests(names: list[str], case: Callable[..., Any], n_prefill: int, full: bool
                       ) -> tuple[Callable[..., None], Callable[..., None]]:
    """The two equality tests a MoE / MLA test module runs over its ``names``:
    ``test_prefill_logits_whole_and_in_chunks`` (block sizes 1, 16, 64; :func:`check_prefill_logits`
    of ``n_prefill`` tokens) and ``test_greedy_32_tokens_match_transformers`` (native and plain;
    :func:`check_greedy_32`, at 1, 16 and 64 too when ``full``). ``case(name, tmp_path_factory,
    built)`` gives (transformers model, loaded model); ``built`` is the module's memo fixture."""
    import pytest

    @pytest.mark.parametrize("block_size", [1, 16, 64])
    @pytest.mark.parametrize("name", names)
    def test_prefill_logits_whole_and_in_chunks(name: str, block_size: int, tmp_path_factory: pytest.TempPathFactory,
                                                built: dict[str, Any]) -> None:
        ref, loaded = case(name, tmp_path_factory, built)
        check_prefill_logits(ref, loaded, n_prefill, block_size)

    @pytest.mark.parametrize("native", [True, False], ids=["native", "plain"])
    @pytest.mark.parametrize("name", names)
    def test_greedy_32_tokens_match_transformers(name: str, native: bool, tmp_path_factory: pytest.TempPathFactory,
                                                 built: dict[str, Any]) -> None:
        ref, loaded = case(name, tmp_path_factory, built)
        check_greedy_32(ref, loaded, native, built, name, (1, 16, 64) if full else ())  # 4 and 3 in it

    return test_prefill_logits_whole_and_in_chunks, test_greedy_32_tokens_match_transformers
