"""MLA models on the Triton backend (``ops/triton/latent.py``), in Triton's interpreter on CPU
tensors: a tiny DeepSeek-V2 (no q_lora_rank) and V3 (group-limited routing, YaRN) give
transformers' prefill logits (whole and in chunks of 6, block sizes 1 and 16) and greedy tokens,
reading the latent blocks in place; 8-bit latent blocks agree with the native kernel's."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from pagedkv.models import load_model
from pagedkv.ops import native
from pagedkv.ops import triton as triton_ops
from pagedkv.runner import ModelRunner, SeqChunk
from pagedkv_testing.hf_checkpoints import TinyAllocator, hf_greedy, load_hf_reference, paged_greedy
from pagedkv_testing.moe_cases import DEEPSEEK_CASES, check_prefill_logits, make_deepseek, prompt

if not triton_ops.usable_on("cpu"):
    pytest.skip("Triton (or its interpreter, TRITON_INTERPRET=1) is unavailable here", allow_module_level=True)

FULL = os.environ.get("PAGEDKV_MOE_FULL_MATRIX") == "1"  # docs/environment.md: both models, block sizes 1 and 16
# the interpreter runs one program at a time: V3 at block size 16 by default (block size 1 and odd
# shapes: tests/ops/triton/test_triton_latent.py)
NAMES = ["v2_no_q_lora", "v3_groups"] if FULL else ["v3_groups"]
PREFILL = [(n, bs) for n in NAMES for bs in ((1, 16) if FULL else (16,))]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = {}
    for name in NAMES:
        version, overrides = DEEPSEEK_CASES[name]
        folder = make_deepseek(tmp_path_factory.mktemp(name), version, seed=len(name), **overrides)
        out[name] = (load_hf_reference(folder), load_model(str(folder)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name,block_size", PREFILL)
def test_prefill_logits_on_triton(name: str, block_size: int, built: dict[str, Any]) -> None:
    ref, loaded = built[name]
    check_prefill_logits(ref, loaded, 20, block_size, attention_backend="triton")


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_on_triton(name: str, built: dict[str, Any]) -> None:
    """Prompts prefilled in chunks of 5 mixed with the others' decodes (block size 3)."""
    ref, loaded = built[name]
    prompts = [prompt(n, loaded.config.vocab_size, 10 + n) for n in (9, 4)]
    want = [hf_greedy(ref, p, 8) for p in prompts]
    runner = ModelRunner(loaded, block_size=3, num_blocks=32, attention_backend="triton")
    assert paged_greedy(runner, prompts, 8, chunk=5) == want


@pytest.mark.slow
def test_int8_latent_blocks_on_triton_equal_the_native_kernel(built: dict[str, Any]) -> None:
    """8-bit latent blocks (one scale per block and layer): the Triton kernel reads what the native
    kernel reads (the same quantized blocks: written by each backend's own write kernel)."""
    if not native.available():
        pytest.skip("8-bit KV blocks need the native kernels on CPU")
    _, loaded = built["v3_groups"]
    ids = prompt(18, loaded.config.vocab_size, 3)
    logits = []
    for backend in ("native", "triton"):
        runner = ModelRunner(loaded, block_size=8, num_blocks=8, kv_cache_dtype="int8", attention_backend=backend)
        table = TinyAllocator(8).take(3)
        first = runner.execute([SeqChunk(ids[:10], 0, table)], return_all_logits=True)
        logits.append(torch.cat((first, runner.execute([SeqChunk(ids[10:], 10, table)], return_all_logits=True))))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-3, rtol=1e-3)
