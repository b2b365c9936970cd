"""The engine against transformers on tiny random models, and under chaos.

Greedy outputs must equal transformers' greedy continuation for a batch of ragged prompts; with
seeded fault injection (forced preemption by recompute and swap, cache eviction, allocation
failures) on a KV pool small enough to force real preemption, every request must finish with
exactly the output of a clean run, check_integrity() must hold after every step, and no block
may stay in use.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.engine import LLMEngine, RequestRejectedError, RequestTooLongError
from pagedkv.model_shape import kv_layer_slots, shape_from_hf_dict
from pagedkv_testing.hf_checkpoints import hf_greedy, hf_logits, load_hf_reference, make_hf_checkpoint


def ragged_prompts(seed: int, lengths: list[int], vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# gemma3: a hybrid KV cache (sliding-window layers 0, 1 and 3 in groups of their own)
_TINY = {"llama": {}, "qwen2": {}, "gemma3": dict(num_hidden_layers=4, sliding_window=6, sliding_window_pattern=3,
                                                 head_dim=24)}


@pytest.fixture(scope="module", params=list(_TINY))
def tiny(request, tmp_path_factory):
    folder = make_hf_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=5,
                                **_TINY[request.param])
    return folder, load_hf_reference(folder)


def same_memory_blocks(folder, n: int) -> int:
    """Blocks taking the memory of ``n`` blocks of a cache holding every layer in each block (a
    hybrid model's blocks hold one group's layers: more of them fit)."""
    shape = shape_from_hf_dict(json.loads((folder / "config.json").read_text()))
    return n * shape.num_hidden_layers // kv_layer_slots(shape)


def test_greedy_batch_equals_transformers(tiny):
    folder, ref = tiny
    prompts = ragged_prompts(0, [3, 17, 40, 9, 64, 1])
    llm = LLM(str(folder), block_size=4, num_kv_blocks=same_memory_blocks(folder, 200),
              max_num_batched_tokens=48,
              debug_integrity=True, prefix_index="radix")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 20)
        assert out.outputs[0].finish_reason == "length"
    # A second pass hits the prefix cache and must not change a single token.
    again = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    assert sum(o.num_cached_tokens for o in again) >= sum(len(p) // 4 * 4 - 4 for p in prompts)
    assert llm.stats().kv.used_blocks == 0


def test_logprobs_match_transformers(tiny):
    folder, ref = tiny
    prompt = ragged_prompts(1, [12])[0]
    llm = LLM(str(folder), block_size=8, num_kv_blocks=same_memory_blocks(folder, 32))
    comp = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=3,
                                                 ignore_eos=True))[0].outputs[0]
    seq = prompt + comp.token_ids
    expected = torch.log_softmax(hf_logits(ref, seq)[len(prompt) - 1:-1], dim=-1)
    for i, (tok, lps) in enumerate(zip(comp.token_ids, comp.logprobs)):
        assert lps[tok].rank == 1 and abs(lps[tok].logprob - float(expected[i, tok])) < 1e-4
        assert len(lps) == 3  # the chosen token is also the top-1 alternative
    assert comp.cumulative_logprob == pytest.approx(sum(float(expected[i, t])
                                                       for i, t in enumerate(comp.token_ids)), abs=1e-3)


def _workload(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    for i, p in enumerate(prompts):
        if i % 3 == 2:
            params = SamplingParams(temperature=0.9, top_k=40, n=3, seed=i, max_tokens=12, ignore_eos=True)
        else:
            params = SamplingParams(temperature=0, max_tokens=16 + i, ignore_eos=True)
        engine.add_request(f"r{i}", p, params)
    engine.add_request("beam", prompts[0], SamplingParams(max_tokens=6, ignore_eos=True), beam_width=3)
    results: dict[str, list[list[int]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in results, "a request finished twice"
                results[out.request_id] = [c.token_ids for c in out.outputs]
    return results


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_fault_injection_preserves_outputs(tmp_path, mode):
    folder = make_hf_checkpoint(tmp_path, "llama", seed=11)
    prompts = ragged_prompts(2, [5, 30, 14, 22, 9, 41, 3, 18])
    options = dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=40, swap_space=0.0002,
                   preemption_mode=mode, debug_integrity=True)
    clean = LLMEngine.from_options(str(folder), **{**options, "num_kv_blocks": 400})
    expected = _workload(clean, prompts)
    assert set(expected) == {f"r{i}" for i in range(len(prompts))} | {"beam"}
    preemptions = faults = 0
    for seed in range(6):
        engine = LLMEngine.from_options(str(folder), fault_injection=f"seed={seed},rate=0.15", **options)
        got = _workload(engine, prompts)
        assert got == expected, f"fault seed {seed} changed an output"
        stats = engine.stats()
        assert stats.kv.used_blocks == 0 and stats.kv.host_used_blocks == 0
        assert stats.num_running == stats.num_waiting == stats.num_swapped == 0
        preemptions += stats.preemptions_recompute + stats.preemptions_swap
        faults += stats.faults_fired
        if mode == "swap":
            assert stats.kv.swapped_out_blocks == stats.kv.swapped_in_blocks
    assert faults > 0 and preemptions > 6  # memory pressure and faults really preempted


def test_memory_core_changes_only_in_schedule_and_update(tmp_path):
    """One step is schedule -> execute -> update: the memory core is changed inside
    ``Scheduler.schedule`` and ``Scheduler.update_from_output`` only, never by the engine in between,
    and it reads each sequence's own token list (one owner of the tokens)."""
    folder = make_hf_checkpoint(tmp_path, "llama", seed=11)
    engine = LLMEngine.from_options(str(folder), block_size=4, num_kv_blocks=40, max_num_batched_tokens=40,
                                    swap_space=0.0002, preemption_mode="swap",
                                    fault_injection="seed=2,rate=0.15", debug_integrity=True)
    kv, scheduler = engine.kv, engine.scheduler
    phase: list[str] = []
    calls: list[tuple[str, str | None]] = []

    def wrap(obj, name, record):
        original = getattr(obj, name)

        def wrapped(*args, **kwargs):
            record(name)
            return original(*args, **kwargs)
        setattr(obj, name, wrapped)

    for name in ("allocate_prompt", "allocate_slots", "mark_computed", "fork", "free", "swap_out",
                 "swap_in", "evict_cached"):
        wrap(kv, name, lambda n: calls.append((n, phase[-1] if phase else None)))
    for name in ("schedule", "update_from_output"):
        original = getattr(scheduler, name)

        def phased(*args, _original=original, _name=name, **kwargs):
            phase.append(_name)
            try:
                return _original(*args, **kwargs)
            finally:
                phase.pop()
        setattr(scheduler, name, phased)

    prompts = ragged_prompts(2, [5, 30, 14, 22, 9, 41, 3, 18])
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.8, n=1 + i % 3, seed=i, max_tokens=10,
                                                      ignore_eos=True))
    engine.add_request("beam", prompts[0], SamplingParams(max_tokens=6, ignore_eos=True), beam_width=3)
    while engine.has_unfinished_requests():
        engine.step()
        for group in scheduler.groups.values():
            for seq in group.live_seqs:
                if seq.seq_id in kv:
                    assert kv.seqs[seq.seq_id].token_ids is seq.token_ids
    outside = [c for c in calls if c[1] is None]
    assert not outside, f"memory core changed outside schedule/update: {outside[:5]}"
    made = {name for name, _ in calls}
    assert {"mark_computed", "fork", "free", "allocate_slots", "allocate_prompt"} <= made
    assert all(p == "update_from_output" for n, p in calls if n in ("mark_computed", "fork"))
    assert engine.stats().kv.used_blocks == 0


def test_fault_spec_from_environment(tmp_path, monkeypatch):
    folder = make_hf_checkpoint(tmp_path, "llama", seed=1)
    monkeypatch.setenv("PAGEDKV_FAULT_INJECTION", "seed=3,rate=0.5")
    engine = LLMEngine.from_options(str(folder), num_kv_blocks=16)
    assert engine.faults is not None and engine.faults.spec.rate == 0.5
    with pytest.raises(ValueError, match="fault_injection"):
        LLMEngine.from_options(str(folder), num_kv_blocks=16, fault_injection="seed=x")


def test_parallel_sampling_is_seeded_and_shares_blocks(tiny):
    folder, _ = tiny
    prompt = ragged_prompts(3, [30])[0]
    params = SamplingParams(temperature=1.0, n=4, seed=123, max_tokens=10, ignore_eos=True)
    llm = LLM(str(folder), block_size=4, num_kv_blocks=same_memory_blocks(folder, 128), debug_integrity=True)
    alone = llm.generate([prompt], params)[0]
    others = ragged_prompts(4, [7, 19])
    crowd = llm.generate([others[0], prompt, others[1]],
                         [SamplingParams(temperature=1.0, max_tokens=5), params,
                          SamplingParams(temperature=0.5, n=2, max_tokens=8)])[1]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in crowd.outputs]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1  # samples differ from each other
    # While the four samples run, they share the prompt's full blocks.
    engine = llm.engine
    engine.add_request("x", prompt, params)
    savings = []
    while engine.has_unfinished_requests():
        engine.step()
        savings.append(engine.stats().kv.sharing_saving)
    assert max(savings) > 0.4
    assert engine.stats().kv.cow_copies > 0


def reference_beam_search(model, prompt: list[int], width: int, max_tokens: int) -> list[tuple[list[int], float]]:
    """Straightforward beam search by full recompute (no EOS in these tiny models)."""
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    for _ in range(max_tokens):
        proposals = []
        for order, (toks, cum) in enumerate(beams):
            lp = torch.log_softmax(hf_logits(model, prompt + toks)[-1], dim=-1)
            values, ids = torch.topk(lp, 2 * width)
            for rank, (v, t) in enumerate(zip(values.tolist(), ids.tolist())):
                proposals.append((cum + v, order, rank, toks + [t]))
        proposals.sort(key=lambda p: (-p[0], p[1], p[2]))
        beams = [(p[3], p[0]) for p in proposals[:width]]
    return sorted(beams, key=lambda b: -b[1] / len(b[0]))


def test_beam_search_matches_reference(tiny):
    folder, ref = tiny
    prompts = ragged_prompts(5, [6, 21])
    llm = LLM(str(folder), block_size=4, num_kv_blocks=same_memory_blocks(folder, 128), debug_integrity=True)
    outs = llm.beam_search(prompts, beam_width=3, max_tokens=7)
    for prompt, out in zip(prompts, outs):
        expected = reference_beam_search(ref, prompt, 3, 7)
        assert [c.token_ids for c in out.outputs] == [toks for toks, _ in expected]
        for c, (_, cum) in zip(out.outputs, expected):
            assert c.cumulative_logprob == pytest.approx(cum, abs=1e-3)
    assert llm.stats().kv.used_blocks == 0


def test_rejected_requests_leave_others_running(tiny):
    folder, ref = tiny
    engine = LLMEngine.from_options(str(folder), block_size=4, num_kv_blocks=same_memory_blocks(folder, 20),
                                    max_model_len=64)
    engine.add_request("ok", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    with pytest.raises(RequestTooLongError, match="max_model_len is 64"):
        engine.add_request("long", list(range(3, 70)), SamplingParams(max_tokens=1))
    with pytest.raises(RequestTooLongError, match="lower max_tokens to at most 60"):
        engine.add_request("long2", [5, 6, 7, 8], SamplingParams(max_tokens=61))
    with pytest.raises(RequestTooLongError, match="KV blocks"):
        engine.add_request("wide", list(range(3, 40)), SamplingParams(n=8, max_tokens=24))
    with pytest.raises(RequestRejectedError, match="vocabulary"):
        engine.add_request("bad", [5, 10**6], SamplingParams())
    with pytest.raises(RequestRejectedError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(RequestRejectedError, match="already in use"):
        engine.add_request("ok", [1], SamplingParams())
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["ok"]
    assert outs[0].outputs[0].token_ids == hf_greedy(ref, [5, 6, 7], 8)


def test_abort_frees_blocks(tiny):
    folder, _ = tiny
    engine = LLMEngine.from_options(str(folder), block_size=4, num_kv_blocks=same_memory_blocks(folder, 64))
    engine.add_request("a", list(range(3, 30)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", list(range(3, 10)), SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats().kv.used_blocks > 0
    out = engine.abort_request("a")
    assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.abort_request("nope") is None
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().kv.used_blocks == 0


@pytest.mark.parametrize("faults", [None, "seed=3,rate=0.3"])
def test_prompt_logprobs_match_transformers(tiny, faults):
    """Chunked prefill (16-token steps), a prefix already cached by an earlier request and, with
    faults, preemption by recompute and swap: every prompt token's logprob is computed once,
    from logits at every prompt position, and equals transformers'."""
    folder, ref = tiny
    prompt = ragged_prompts(7, [45])[0]
    llm = LLM(str(folder), block_size=4, num_kv_blocks=same_memory_blocks(folder, 64), max_num_batched_tokens=16,
              fault_injection=faults, debug_integrity=True)
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2))  # caches the prompt's blocks
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2,
                                                ignore_eos=True))[0]
    expected = torch.log_softmax(hf_logits(ref, prompt), dim=-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        entry, row = out.prompt_logprobs[p], expected[p - 1]
        assert abs(entry[prompt[p]].logprob - float(row[prompt[p]])) < 1e-4
        assert entry[prompt[p]].rank == int((row > row[prompt[p]]).sum()) + 1
        top2 = row.topk(2).indices.tolist()
        assert set(top2) <= set(entry) and len(entry) <= 3
    assert out.num_cached_tokens == 0  # prompt logprobs take no prefix-cache hit
    assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 3)
    assert llm.stats().kv.used_blocks == 0


def test_a_shared_prefix_being_computed_is_waited_for_not_computed_twice(tiny):
    """Requests sharing a prefix, submitted together: the first computes it, the others are
    admitted once it is written and hit it (no second computation of the shared blocks)."""
    folder, _ = tiny
    engine = LLMEngine.from_options(str(folder), block_size=4, num_kv_blocks=same_memory_blocks(folder, 200),
                                    debug_integrity=True)
    plans = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    prefix = [(5 * i) % 200 + 3 for i in range(40)]
    prompts = [prefix + [7 + i, 9, 11 + i] for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
    assert [s.group.request_id for s in plans[0].scheduled] == ["r0"]  # the others waited for its prefix
    assert [(s.group.request_id, s.start, s.num_tokens) for s in plans[1].scheduled][1:] == [
        ("r1", 40, 3), ("r2", 40, 3), ("r3", 40, 3)]
    assert all(outs[f"r{i}"].num_cached_tokens == 40 for i in (1, 2, 3))
    want = LLM(str(folder), block_size=4, num_kv_blocks=same_memory_blocks(folder, 200),
               enable_prefix_caching=False).generate(prompts, params)
    assert [outs[f"r{i}"].outputs[0].token_ids for i in range(4)] == [o.outputs[0].token_ids for o in want]
