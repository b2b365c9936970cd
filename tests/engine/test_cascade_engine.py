"""Shared-block (cascade) attention through the engine: outputs with it on (the default) and off
(``disable_cascade_attn``) are the same, and equal transformers'.

Prompts share a long prefix (prefix caching and the batch's own sharing), ``n > 1`` forks and beam
candidates share their parents' blocks, speculative decoding verifies proposals over shared
blocks, and fault injection preempts and recomputes sequences in the middle of it. Greedy token
ids must be identical and every logprob within 1e-5. Models: Llama with head_dim 64 (the kernel's
vector path) and Gemma 2 (soft-capped scores, sliding-window layers whose window leaves shared
blocks behind, head_dim 16: the portable path).
"""

from __future__ import annotations

import random

import pytest

from pagedkv import SamplingParams
from pagedkv.engine import LLMEngine
from pagedkv.ops import cascade
from pagedkv.runner import step_inputs
from pagedkv_testing.hf_checkpoints import hf_greedy, load_hf_reference, make_hf_checkpoint

pytestmark = pytest.mark.skipif(not cascade.available(), reason="the native cascade kernel is unavailable here")

_MODELS = {"llama": dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1),
           "gemma2": dict(sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=None)}


@pytest.fixture(scope="module", params=list(_MODELS))
def folder(request, tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=3,
                              **_MODELS[request.param])


@pytest.fixture(autouse=True)
def every_shared_run(monkeypatch):
    """Tiny prompts share fewer tokens than the default thresholds pay for: attend every run, and
    every chunk of two or more rows (a prompt's later chunk, a speculative proposal) over the
    blocks before it as a node of its own."""
    monkeypatch.setattr(cascade, "MIN_SAVED_TOKENS", 0)
    monkeypatch.setattr(cascade, "CHUNK_MIN_ROWS", 2)
    monkeypatch.setattr(cascade, "CHUNK_MIN_TOKENS", 1)


@pytest.fixture
def planned(monkeypatch):
    """Counts the steps whose inputs found shared runs (so a test knows cascade really ran)."""
    found = []

    def counting(*args, **kwargs):
        plan = find(*args, **kwargs)
        found.append(plan is not None)
        return plan

    find = step_inputs.find_shared_runs
    monkeypatch.setattr(step_inputs, "find_shared_runs", counting)
    return found


def _prompts(seed: int, prefix: int, tails: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(prefix)]
    return [shared + [rng.randrange(3, 256) for _ in range(n)] for n in tails]


def _run(folder, prompts, cascade_on: bool, beam: bool = True, **options) -> dict[str, list]:
    """Every request's outputs: per completion, (token ids, logprob of each chosen token)."""
    engine = LLMEngine.from_options(str(folder), block_size=4, num_kv_blocks=300, max_num_batched_tokens=64,
                                    disable_cascade_attn=not cascade_on, debug_integrity=True, **options)
    for i, p in enumerate(prompts):
        if i % 3 == 1:
            params = SamplingParams(temperature=0.8, n=3, seed=i, max_tokens=10, logprobs=2, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
        engine.add_request(f"r{i}", p, params)
    if beam:
        engine.add_request("beam", prompts[0], SamplingParams(max_tokens=6, ignore_eos=True), beam_width=3)
    results: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = [
                    (c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs or [], c.token_ids)]
                     if c.logprobs else [c.cumulative_logprob]) for c in out.outputs]
    assert engine.stats().kv.used_blocks == 0
    return results


def _assert_same(on: dict[str, list], off: dict[str, list]) -> None:
    assert on.keys() == off.keys()
    for rid in on:
        assert [ids for ids, _ in on[rid]] == [ids for ids, _ in off[rid]], f"{rid}: token ids differ"
        for (_, a), (_, b) in zip(on[rid], off[rid]):
            assert len(a) == len(b)
            assert max((abs(x - y) for x, y in zip(a, b)), default=0.0) <= 1e-5, f"{rid}: logprobs differ"


def test_outputs_with_sharing_on_and_off(folder, planned):
    """Greedy, n = 3 forks and beam search over prompts sharing a 37-token prefix."""
    prompts = _prompts(0, 37, [1, 5, 9, 3, 14, 7])
    on = _run(folder, prompts, True)
    assert any(planned), "no step found a shared run: cascade never ran"
    count = len(planned)
    off = _run(folder, prompts, False)
    assert len(planned) == count  # off: the step inputs never look for sharing
    _assert_same(on, off)


def test_speculative_decoding_and_faults_with_sharing_on_and_off(folder, planned):
    """n-gram proposals verified over shared blocks, while injected faults preempt (recompute and
    swap) and evict; on and off see the same faults (same seed) and give the same outputs."""
    prompts = _prompts(1, 30, [4, 8, 2, 11])
    prompts = [p + p[-6:] * 2 for p in prompts]  # repeats the n-gram proposer can find
    options = dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                       "prompt_lookup_max": 3},
                   fault_injection="seed=4,rate=0.1", swap_space=0.0005)
    on = _run(folder, prompts, True, beam=False, **options)
    assert any(planned)
    _assert_same(on, _run(folder, prompts, False, beam=False, **options))


def test_greedy_with_sharing_equals_transformers(folder):
    ref = load_hf_reference(folder)
    prompts = _prompts(2, 26, [2, 6, 1, 9])
    engine = LLMEngine.from_options(str(folder), block_size=4, num_kv_blocks=200)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(ref, p, 8)


def test_long_prompts_in_chunks_with_sharing_on_and_off(folder, planned):
    """Prompts longer than the step's 64 tokens: each later chunk attends the blocks before it as
    one node of its rows (and a second prompt the first one's prefix as a shared node first);
    greedy outputs on and off the same, and transformers'."""
    prompts = _prompts(3, 150, [60, 9])
    on = _run(folder, prompts, True, beam=False)
    assert any(planned)
    _assert_same(on, _run(folder, prompts, False, beam=False))
    ref = load_hf_reference(folder)
    assert on["r0"][0][0] == hf_greedy(ref, prompts[0], 12)
