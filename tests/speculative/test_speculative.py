"""Speculative decoding (pagedkv/speculative): proposers, exact verification and KV rollback.

Greedy outputs with speculation must equal those without it, token for token, for the n-gram
and the draft-model proposers, across block sizes 1, 16 and 64, with forks (n > 1), penalties,
logprobs, preemption by recompute and swap, fault injection and a hybrid (sliding-window) model;
check_integrity() runs after every step and no block may stay in use. Sampling with speculation
must keep the target distribution (chi-square tests, in the verifier alone and through the engine).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedkv import LLM, SamplingParams
from pagedkv.engine import EngineConfig
from pagedkv.engine.flags import add_engine_arguments, engine_options
from pagedkv.memory import KVCacheManager
from pagedkv.sampling.rejection import verify
from pagedkv.sampling.sampler import Sampler, SampleRow
from pagedkv.speculative import SpeculativeConfig
from pagedkv.speculative.decoder import SpeculativeDecoder, SpeculativeState
from pagedkv.speculative.ngram import propose_ngram
from pagedkv_testing.hf_checkpoints import make_hf_checkpoint

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


def copy_heavy_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    """Prompts that repeat a random passage: the n-gram proposer finds matches at once."""
    rng = random.Random(seed)
    prompts = []
    for n in lengths:
        passage = [rng.randrange(3, 256) for _ in range(n)]
        prompts.append(passage + passage + passage[:n // 2])
    return prompts


def truncated_draft(folder, tmp_path, keep_layers: int = 1):
    """A draft model: the target's weights with only its first ``keep_layers`` layers."""
    draft = tmp_path / "draft"
    shutil.copytree(folder, draft)
    config = json.loads((draft / "config.json").read_text())
    config["num_hidden_layers"] = keep_layers
    (draft / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(draft / "model.safetensors"))
    save_file({k: v for k, v in tensors.items()
               if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= keep_layers)},
              str(draft / "model.safetensors"))
    return draft


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=5, num_hidden_layers=3)


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory):
    return truncated_draft(target, tmp_path_factory.mktemp("draft"))


def run(folder, prompts, params, **options):
    options.setdefault("num_kv_blocks", 1000 if options.get("block_size", 16) < 16 else 200)
    llm = LLM(str(folder), debug_integrity=True, **options)
    outs = llm.generate(prompts, params)
    stats = llm.stats()
    assert stats.kv.used_blocks == 0, "a block stayed in use"
    spec = llm.engine.speculative
    if spec is not None and spec.draft is not None:
        assert not spec.draft.lists  # finished sequences left the draft's cache too
    return [[c.token_ids for c in o.outputs] for o in outs], stats


# ---------------------------------------------------------------------------------- configuration
def test_config_is_validated_with_clear_errors():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 2, 5)
    assert SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 2}).method == "draft_model"
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}).method == "ngram"
    for bad, words in [('{"method": "medusa"}', "method must be one of"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
                       ({"method": "draft_model"}, '"model"'),
                       ({"method": "ngram", "model": "/m"}, '"model" is for'),
                       ({"method": "ngram", "k": 3}, "unknown field"),
                       ("{not json", "JSON object"),
                       ("[1, 2]", "JSON object")]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 99})
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 6}'])
    assert EngineConfig(**engine_options(args)).speculative.num_speculative_tokens == 6


def test_config_takes_vllms_spellings():
    one_bound = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 1})
    assert (one_bound.prompt_lookup_min, one_bound.prompt_lookup_max) == (1, 1)
    assert SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_min": 7}).prompt_lookup_max == 7
    legacy = SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_min": None})
    assert (legacy.method, legacy.model, legacy.prompt_lookup_min) == ("ngram", None, 2)
    vllm = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1,
                                    "acceptance_method": "rejection_sampler", "disable_logprobs": False,
                                    "disable_by_batch_size": 4})
    assert vllm.disable_by_batch_size == 4
    for bad, words in [({"method": "ngram", "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size 2"),
                       ({"method": "ngram", "acceptance_method": "typical_acceptance_sampler"}, "acceptance_method"),
                       ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size")]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)


def test_disable_by_batch_size_stops_proposals_for_large_batches(target):
    prompts = copy_heavy_prompts(9, [20, 30, 24])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    limited = {**NGRAM, "disable_by_batch_size": 2}
    plain, _ = run(target, prompts, params, block_size=4)
    busy, stats = run(target, prompts, params, block_size=4, speculative_config=limited)
    _, free_stats = run(target, prompts, params, block_size=4, speculative_config=NGRAM)
    assert busy == plain
    # no proposal while two or three run: only the last one left speculates
    assert stats.spec_num_drafts < free_stats.spec_num_drafts
    one, one_stats = run(target, prompts[:1], params, block_size=4, speculative_config=limited)
    assert one == plain[:1] and one_stats.spec_num_drafts > 0


def test_draft_model_with_another_tokenizer_is_refused(tmp_path):
    from pagedkv_testing.tiny_model import write_tiny_model
    tiny_target = write_tiny_model(tmp_path / "target")
    other = write_tiny_model(tmp_path / "other", seed=1)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: another tokenizer of the same size
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="another tokenizer than the target"):
        LLM(str(tiny_target), speculative_config={"method": "draft_model", "model": str(other)})


# ---------------------------------------------------------------------------------- n-gram proposer
def test_ngram_proposes_what_followed_the_longest_most_recent_match():
    assert propose_ngram([1, 2, 3, 4, 9, 1, 2, 3], 3, 1, 4) == [4, 9, 1]
    assert propose_ngram([1, 2, 3, 4, 9, 1, 2, 3], 6, 1, 4) == [4, 9, 1, 2, 3, 4]  # a loop of period 5
    # the longest match wins over a more recent shorter one
    assert propose_ngram([7, 2, 3, 5, 6, 8, 3, 4, 7, 2, 3], 2, 1, 3) == [5, 6]
    # among equally long matches the most recent one wins
    assert propose_ngram([1, 5, 0, 1, 6, 0, 1], 1, 1, 2) == [6]
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []           # nothing repeats
    assert propose_ngram([5, 1, 2, 6, 2], 3, 2, 3) == []        # the match is shorter than the minimum
    assert propose_ngram([3, 3, 3, 3], 5, 1, 2) == [3] * 5      # a loop continues past the end
    assert propose_ngram([8, 1, 2, 1, 2], 3, 2, 2) == [1, 2, 1]
    assert propose_ngram([1], 4, 1, 2) == [] and propose_ngram([1, 2, 1], 0, 1, 2) == []


# ---------------------------------------------------------------------------------- verification
def test_greedy_verification_accepts_the_argmax_prefix():
    logits = torch.full((4, 8), -5.0)
    for row, best in enumerate([3, 5, 1, 6]):
        logits[row, best] = 5.0
    params = SamplingParams(temperature=0)
    rows = [SampleRow(i, params, None) for i in range(4)]
    batch = Sampler().prepare(logits, rows)
    tokens, accepted = verify(batch, rows, (3, 5, 2))
    assert ([t.token for t in tokens], accepted) == ([3, 5, 1], 2)
    tokens, accepted = verify(batch, rows, (3, 5, 1))
    assert ([t.token for t in tokens], accepted) == ([3, 5, 1, 6], 3)  # all accepted: a bonus token


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for a chi-square variable of ``df`` degrees of freedom."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def chi_square_p(observed: list[int], expected: list[float]) -> float:
    """p-value of Pearson's goodness-of-fit test (cells of probability 0 must stay empty)."""
    assert sum(o for o, e in zip(observed, expected) if e == 0) == 0, "a token of probability 0 was drawn"
    cells = [(o, e) for o, e in zip(observed, expected) if e > 0]
    total, mass = sum(o for o, _ in cells), sum(e for _, e in cells)
    statistic = sum((o - total * e / mass) ** 2 / (total * e / mass) for o, e in cells)
    return chi2_sf(statistic, len(cells) - 1)


def contingency_p(a: Counter, b: Counter) -> float:
    """p-value of Pearson's test that two samples come from one distribution."""
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    statistic = 0.0
    for k in keys:
        col = a[k] + b[k]
        for observed, n in ((a[k], na), (b[k], nb)):
            expected = col * n / (na + nb)
            statistic += (observed - expected) ** 2 / expected
    return chi2_sf(statistic, len(keys) - 1)


def test_rejection_sampling_keeps_the_target_distribution():
    """Two positions of a tiny vocabulary: the joint distribution of the emitted tokens equals the
    target's, p0(x) p1(y | x = d0) or p0(x) p_any(y) (y from the row after a rejection is drawn in
    the next step), whatever the proposal; seeds reproduce draws."""
    torch.manual_seed(0)
    vocab = 6
    logits = torch.randn(3, vocab) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5)
    from pagedkv.sampling.sampler import filtered_probs
    p = [filtered_probs(logits[i], params) for i in range(3)]
    proposal = (int(p[0].argmax()), 2)
    counts: Counter = Counter()
    firsts: Counter = Counter()
    trials = 20000
    gen = torch.Generator().manual_seed(10)
    rows = [SampleRow(i, params, gen) for i in range(3)]
    batch = Sampler().prepare(logits, rows)
    for _ in range(trials):
        tokens, accepted = verify(batch, rows, proposal)
        firsts[tokens[0].token] += 1
        if accepted >= 1:
            counts[tokens[1].token] += 1
    # position 0: the target's distribution
    assert chi_square_p([firsts[t] for t in range(vocab)], p[0].tolist()) > 1e-3
    # position 1, given that the proposal's first token was accepted: row 1's distribution
    assert chi_square_p([counts[t] for t in range(vocab)], p[1].tolist()) > 1e-3
    # the same generator seed gives the same draws
    again = [SampleRow(i, params, torch.Generator().manual_seed(7)) for i in range(3)]
    first = [verify(batch, again, proposal)[0][0].token for _ in range(20)]
    again = [SampleRow(i, params, torch.Generator().manual_seed(7)) for i in range(3)]
    assert first == [verify(batch, again, proposal)[0][0].token for _ in range(20)]


# ---------------------------------------------------------------------------------- memory core
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_rollback_returns_the_blocks_of_rejected_tokens(block_size):
    kv = KVCacheManager(64, block_size)
    tokens = list(range(10))
    kv.allocate_prompt("a", tokens)
    kv.mark_computed("a", 10)
    tokens.append(10)  # the sampled token
    free_before = kv.num_free_blocks
    kv.allocate_slots("a", 1 + 6)  # the last token and 6 proposals, across a block boundary
    assert kv.num_free_blocks < free_before
    tokens += [11, 12]  # two proposals accepted (+ the target's own token, uncomputed)
    kv.mark_computed("a", 1 + 2)
    kv.rollback("a")
    kv.check_integrity()
    assert len(kv.block_table("a")) == -(-13 // block_size)
    assert kv.num_free_blocks == 64 - -(-13 // block_size)
    # a fork shares the blocks; the child's proposal slots come from copies, not the parent's blocks
    kv.fork("a", "b", list(tokens))
    kv.allocate_slots("b", 5)
    kv.rollback("b")
    kv.check_integrity()
    assert kv.block_table("a")[:-1] == kv.block_table("b")[:-1]
    kv.free("a")
    kv.free("b")
    kv.check_integrity()
    assert kv.num_used_blocks == 0


# ---------------------------------------------------------------------------------- greedy equality
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_ngram_greedy_outputs_equal_plain_decoding(target, block_size):
    prompts = copy_heavy_prompts(0, [10, 25, 40, 7, 60])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    options = dict(block_size=block_size, num_kv_blocks=6000 // block_size)
    expected, _ = run(target, prompts, params, **options)
    got, stats = run(target, prompts, params, speculative_config=NGRAM, **options)
    assert got == expected
    assert stats.spec_num_drafts > 10 and 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert stats.kv.rolled_back_blocks > 0 or block_size == 64


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_draft_model_greedy_outputs_equal_plain_decoding(target, draft, block_size):
    prompts = copy_heavy_prompts(1, [5, 30, 17, 50])
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    options = dict(block_size=block_size, num_kv_blocks=6000 // block_size)
    expected, _ = run(target, prompts, params, **options)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    got, stats = run(target, prompts, params, speculative_config=spec, **options)
    assert got == expected
    assert stats.spec_num_drafts > 10 and stats.spec_accepted_tokens > 0


def test_a_draft_that_is_the_target_is_always_accepted(target):
    prompts = copy_heavy_prompts(2, [9, 33])
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4}
    expected, _ = run(target, prompts, params, block_size=4)
    got, stats = run(target, prompts, params, block_size=4, speculative_config=spec)
    assert got == expected
    assert stats.spec_acceptance_rate == 1.0 and stats.spec_mean_accepted_length > 4.0


def test_forks_penalties_logprobs_and_stops_are_unchanged(target):
    prompts = copy_heavy_prompts(3, [12, 31, 20])
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=3),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.4, logprobs=2),
              SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[7, 8, 9, 10, 11, 12])]
    for p in params:
        llm_off = LLM(str(target), block_size=4, num_kv_blocks=500)
        llm_on = LLM(str(target), block_size=4, num_kv_blocks=500, debug_integrity=True, speculative_config=NGRAM)
        off, on = llm_off.generate(prompts, p), llm_on.generate(prompts, p)
        for a, b in zip(off, on):
            assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
            assert [c.finish_reason for c in a.outputs] == [c.finish_reason for c in b.outputs]
            if p.logprobs:
                for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                    assert x.keys() == y.keys()
                    assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
        assert llm_on.stats().kv.used_blocks == 0
        assert llm_on.stats().spec_num_drafts > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_fault_injection_with_speculation(target, draft, mode):
    prompts = copy_heavy_prompts(4, [5, 30, 14, 22, 9, 41, 3, 18])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    options = dict(block_size=4, num_kv_blocks=60, max_num_batched_tokens=48, swap_space=0.0003,
                   preemption_mode=mode)
    expected, _ = run(target, prompts, params, **{**options, "num_kv_blocks": 600})
    preemptions = 0
    for spec in (NGRAM, {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}):
        for faults in (None, "seed=1,rate=0.15", "seed=4,rate=0.15"):
            got, stats = run(target, prompts, params, speculative_config=spec, fault_injection=faults, **options)
            assert got == expected, (spec["method"], faults)
            assert stats.spec_num_drafts > 0 and stats.kv.host_used_blocks == 0
            preemptions += stats.preemptions_recompute + stats.preemptions_swap
    assert preemptions > 0  # memory pressure really preempted speculating requests


def test_hybrid_sliding_window_model(tmp_path):
    folder = make_hf_checkpoint(tmp_path, "gemma3", seed=5, num_hidden_layers=4, sliding_window=6,
                                sliding_window_pattern=3, head_dim=24)
    prompts = copy_heavy_prompts(5, [8, 30, 21])
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected, _ = run(folder, prompts, params, block_size=4)
    got, stats = run(folder, prompts, params, block_size=4, speculative_config=NGRAM)
    assert got == expected and stats.spec_num_drafts > 0


def test_a_failing_draft_model_only_costs_its_proposals(target, draft, caplog):
    prompts = copy_heavy_prompts(6, [10, 20])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected, _ = run(target, prompts, params, block_size=4)
    llm = LLM(str(target), block_size=4, num_kv_blocks=500, debug_integrity=True,
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    proposer = llm.engine.speculative.draft
    calls = {"n": 0}
    real = proposer.runner.execute

    def flaky(chunks):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("injected draft failure")
        return real(chunks)

    proposer.runner.execute = flaky
    outs = llm.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in outs] == expected
    assert proposer.failures > 0 and not proposer.lists and llm.stats().kv.used_blocks == 0
    assert proposer.kv.num_used_blocks == 0


# ---------------------------------------------------------------------------------- sampling
def test_speculative_sampling_matches_plain_sampling_in_distribution(target):
    """Two-sample chi-square over 500 seeds: the second and third sampled tokens (top_k keeps a
    few candidates) with speculation on have the distribution they have without it. The draft is
    the target itself, so its proposal (the argmax) is accepted often and rejected often."""
    prompt = copy_heavy_prompts(7, [6])[0]

    def draws(spec):
        llm = LLM(str(target), block_size=4, speculative_config=spec)
        ps = [SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, seed=s) for s in range(500)]
        outs = llm.generate([prompt] * len(ps), ps)
        return Counter(tuple(o.outputs[0].token_ids[1:3]) for o in outs), llm.stats()

    off, _ = draws(None)
    on, stats = draws({"method": "draft_model", "model": str(target), "num_speculative_tokens": 2})
    assert stats.spec_num_drafts >= 500 and 0.2 < stats.spec_acceptance_rate < 0.9
    assert contingency_p(off, on) > 1e-3
    # and the test can tell distributions apart: plain sampling against a shifted one
    shifted = Counter(off)
    shifted[max(shifted, key=shifted.get)] += 120
    assert contingency_p(off, shifted) < 1e-3


def test_seeded_sampling_is_reproducible_with_speculation(target):
    prompt = copy_heavy_prompts(8, [10])[0]
    params = [SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True, seed=s) for s in range(6)]
    a = LLM(str(target), block_size=4, speculative_config=NGRAM).generate([prompt] * 6, params)
    b = LLM(str(target), block_size=4, speculative_config=NGRAM).generate([prompt] * 6, params[::-1])
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b][::-1]


# ---------------------------------------------------------------------------------- control
def test_per_request_opt_out(target):
    prompts = copy_heavy_prompts(9, [20, 30])
    llm = LLM(str(target), block_size=4, speculative_config=NGRAM)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, speculative=False))
    assert llm.stats().spec_num_drafts == 0
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert llm.stats().spec_num_drafts > 0
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="no")


def test_backoff_pauses_and_shortens_after_rejections():
    config = SpeculativeConfig("ngram", num_speculative_tokens=4)
    spec = SpeculativeDecoder(config, max_model_len=1000)

    class Seq:
        num_tokens, num_output_tokens, speculative = 50, 10, None

    class Group:
        max_tokens = 100

    seq = Seq()
    assert spec._length(Group, seq) == 4
    pauses = []
    for _ in range(7):
        spec.record(seq, 4, 0)
        pauses.append(seq.speculative.resume_at - seq.num_tokens)
    assert pauses == [1, 2, 4, 8, 16, 32, 32]
    assert spec._length(Group, seq) == 0  # paused
    seq.num_tokens = seq.speculative.resume_at
    assert spec._length(Group, seq) == 2  # resumes with short proposals: ceil(0.7**7 * 4) + 1
    for _ in range(12):
        spec.record(seq, 4, 4)
    assert seq.speculative.misses == 0 and spec._length(Group, seq) == 4
    seq.num_output_tokens = 98  # room for two more tokens: one proposal and the target's own
    assert spec._length(Group, seq) == 1
    seq.num_output_tokens = 99  # room for one: nothing to propose
    assert spec._length(Group, seq) == 0
    c = spec.counters()
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens) == (19, 76, 48)
    assert c.acceptance_rate == pytest.approx(48 / 76) and c.mean_accepted_length == pytest.approx(1 + 48 / 19)
    assert isinstance(SpeculativeState(), SpeculativeState)


def test_stats_and_metrics_report_speculation(target):
    llm = LLM(str(target), block_size=4,
              speculative_config={"method": "draft_model", "model": str(target), "num_speculative_tokens": 3})
    llm.generate(copy_heavy_prompts(10, [20]), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    s = llm.stats()
    assert s.spec_draft_tokens >= s.spec_accepted_tokens > 0
    assert s.spec_acceptance_rate == pytest.approx(s.spec_accepted_tokens / s.spec_draft_tokens)
    assert sum(s.spec_accepted_per_position) == s.spec_accepted_tokens
    assert math.isclose(s.spec_mean_accepted_length, 1 + s.spec_accepted_tokens / s.spec_num_drafts)
    from pagedkv.engine.stats import cache_report
    line = cache_report(s).splitlines()[-1]
    assert line.startswith("speculative decoding: ") and f"{s.spec_accepted_tokens}/{s.spec_draft_tokens}" in line
    from pagedkv.server.metrics import ServerMetrics
    text = ServerMetrics("m").render(s).decode()
    for name in ("pagedkv_spec_decode_num_drafts_total", "pagedkv_spec_decode_num_draft_tokens_total",
                 "pagedkv_spec_decode_num_accepted_tokens_total", "pagedkv_spec_decode_acceptance_rate",
                 "pagedkv_spec_decode_num_accepted_tokens_per_pos_total", "pagedkv_kv_rolled_back_blocks_total"):
        assert name in text, name
    # vLLM's names too, with the same figures
    assert f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {float(s.spec_draft_tokens)}' in text
    assert f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} ' \
           f'{float(s.spec_accepted_per_position[0])}' in text


def test_the_prefix_cache_holds_only_accepted_tokens(target):
    """After the same greedy requests, the prefix cache holds exactly the blocks it holds without
    speculation: no block of a rejected proposal was ever hashed."""
    prompts = copy_heavy_prompts(11, [14, 26, 40])
    params = SamplingParams(temperature=0, max_tokens=37, ignore_eos=True)
    caches = []
    for spec in (None, NGRAM):
        llm = LLM(str(target), block_size=4, num_kv_blocks=800, speculative_config=spec)
        llm.generate(prompts, params)
        caches.append(set(llm.engine.kv.pool.cached))
        if spec:
            assert llm.stats().spec_draft_tokens > llm.stats().spec_accepted_tokens > 0
    assert caches[0] == caches[1] and len(caches[0]) > 20


def test_server_speculates_and_a_request_opts_out(tmp_path):
    import httpx

    from pagedkv_testing.server import ServerThread, tiny_engine
    from pagedkv_testing.tiny_model import write_tiny_model

    folder = write_tiny_model(tmp_path / "tiny")
    prompt = "the quick brown fox jumps over the lazy dog. " * 4
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = tiny_engine(folder, num_kv_blocks=200, block_size=4)
    spec = tiny_engine(folder, num_kv_blocks=200, block_size=4, speculative_config=json.dumps(NGRAM))
    texts = []
    for engine in (plain, spec):
        with ServerThread(engine, served_model_names=["tiny"]) as server:
            r = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
            if engine is spec:
                drafts = server.wait_idle().spec_num_drafts
                assert drafts > 0
                r = httpx.post(f"{server.base_url}/completions", json={**body, "speculative": False}, timeout=60)
                assert r.json()["choices"][0]["text"] == texts[0]
                assert server.wait_idle().spec_num_drafts == drafts  # the opted-out request proposed nothing
                metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
                assert "pagedkv_spec_decode_num_accepted_tokens_total" in metrics
                r = httpx.post(f"{server.base_url}/completions", json={**body, "speculative": "no"}, timeout=60)
                assert r.status_code == 400
    assert texts[0] == texts[1]


def test_a_stream_with_several_tokens_per_step_equals_the_whole_answer(tmp_path):
    """Accepted proposals reach a streaming client as one delta per step: the deltas add up to
    the non-streamed text and the usage counts every token."""
    import httpx

    from pagedkv_testing.server import ServerThread, tiny_engine
    from pagedkv_testing.tiny_model import write_tiny_model

    folder = write_tiny_model(tmp_path / "tiny")
    spec = json.dumps({"method": "draft_model", "model": str(folder), "num_speculative_tokens": 4})
    engine = tiny_engine(folder, num_kv_blocks=200, block_size=4, speculative_config=spec)
    body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    with ServerThread(engine, served_model_names=["tiny"]) as server:
        whole = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()["choices"][0]["text"]
        deltas, usage = [], None
        with httpx.stream("POST", server.base_url + "/completions", timeout=60,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    deltas += [c["text"] for c in chunk["choices"]]
                    usage = chunk.get("usage") or usage
        assert server.wait_idle().spec_accepted_tokens > 40  # most steps emitted several tokens
    assert "".join(deltas) == whole and usage["completion_tokens"] == 40
    assert len(deltas) < 20
