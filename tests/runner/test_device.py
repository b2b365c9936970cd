"""The engine on the Triton attention backend, against transformers on tiny random models.

Here (no GPU) the Triton kernels run in Triton's interpreter on CPU tensors
(``PAGEDKV_ATTENTION=triton``, ``TRITON_INTERPRET=1``); ``scripts/gpu_check.sh`` runs this file on
a GPU with ``PAGEDKV_TEST_DEVICE=cuda``, where the engine runs with ``device="cuda"``. Greedy tokens
must equal transformers' and plain-CPU pagedkv's; a preempting, forking workload must give the same
outputs on both backends; 8-bit KV blocks must give the CPU path's tokens (same quantization rule).
"""

from __future__ import annotations

import os

DEVICE = os.environ.get("PAGEDKV_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest  # noqa: E402 - after TRITON_INTERPRET is set: triton reads it when it is imported

from pagedkv import LLM, SamplingParams  # noqa: E402 - as pytest above
from pagedkv_testing.hf_checkpoints import hf_greedy, load_hf_reference, make_hf_checkpoint  # noqa: E402

pytest.importorskip("triton", reason="Triton is not installed")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("TRITON_INTERPRET=1 was not set before triton was imported", allow_module_level=True)


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    monkeypatch.setenv("PAGEDKV_ATTENTION", "triton")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_hf_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=5, hidden_size=64,
                                num_attention_heads=4, num_key_value_heads=2)
    return folder, load_hf_reference(folder)


def prompts() -> list[list[int]]:
    import random
    rng = random.Random(0)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in (3, 17, 9, 30)]


def test_greedy_equals_transformers_on_the_triton_backend(tiny):
    folder, ref = tiny
    llm = LLM(str(folder), device=DEVICE, block_size=4, num_kv_blocks=200, max_num_batched_tokens=24,
              debug_integrity=True)
    assert llm.engine.runner.backend == "triton"
    outs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for p, out in zip(prompts(), outs):
        assert out.outputs[0].token_ids == hf_greedy(ref, p, 8)
    assert llm.stats().kv.used_blocks == 0


def test_forks_and_preemption_match_the_cpu_path(tiny, monkeypatch):
    folder, _ = tiny
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2 if i % 2 else 1) for i in range(4)]
    options = dict(block_size=4, num_kv_blocks=24, max_num_batched_tokens=24, swap_space=0.0001,
                   preemption_mode="swap")
    got = LLM(str(folder), device=DEVICE, debug_integrity=True, **options).generate(prompts(), params)
    monkeypatch.setenv("PAGEDKV_ATTENTION", "plain")
    want = LLM(str(folder), **options).generate(prompts(), params)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_8bit_kv_blocks_match_the_native_cpu_kernels(tiny, monkeypatch, kv_cache_dtype):
    from pagedkv.ops import native
    if not native.available():
        pytest.skip("the native CPU kernels (the reference of the 8-bit formats) are unavailable")
    folder, _ = tiny
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = LLM(str(folder), device=DEVICE, block_size=4, num_kv_blocks=200,
              kv_cache_dtype=kv_cache_dtype).generate(prompts(), params)
    monkeypatch.setenv("PAGEDKV_ATTENTION", "native")
    want = LLM(str(folder), block_size=4, num_kv_blocks=200, kv_cache_dtype=kv_cache_dtype).generate(prompts(), params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
