"""Slow tier: the engine on the bundled SmolLM2-135M-Instruct against transformers."""

import pytest
import torch

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Paged attention stores the key-value cache of a transformer in fixed-size blocks, so",
    "1, 2, 3, 4,",
]


@pytest.fixture(scope="module")
def llm():
    from pagedkv import LLM

    return LLM(block_size=16, kv_cache_memory="256MiB", max_num_batched_tokens=32,
               debug_integrity=True)


@pytest.fixture(scope="module")
def hf_model():
    import transformers

    from pagedkv.models.default_model import default_model_path
    from pagedkv.models.gguf_loader import converted_folder

    folder = converted_folder(default_model_path())
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, torch_dtype=torch.float32, attn_implementation="eager").eval()


def test_batch_greedy_equals_transformers(llm, hf_model):
    from pagedkv import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=24, min_new_tokens=24)[0, ids.shape[1]:]
        assert out.outputs[0].token_ids == ref.tolist(), out.prompt
    assert llm.stats().kv.used_blocks == 0


def test_chat_answers_and_prefix_cache_hits(llm):
    from pagedkv import SamplingParams

    conv = [{"role": "system", "content": "You are a helpful assistant. " * 4},
            {"role": "user", "content": "What is the capital of France?"}]
    first = llm.chat(conv, SamplingParams(temperature=0, max_tokens=16))[0]
    assert "Paris" in first.outputs[0].text
    again = llm.chat(conv, SamplingParams(temperature=0, max_tokens=16))[0]
    assert again.num_cached_tokens >= 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
