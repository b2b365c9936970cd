"""``kv_recent_block``: the tail block of a sequence, while it fills, read at model precision from a
shadow block (``runner/kv_cache.RecentShadows``, ``ModelRunner(kv_recent_blocks=...)``).

- a block id that gets data another way (swap-in, copy-on-write copy) never reads a stale shadow:
  it reads exactly what a block that never had one reads;
- a copy-on-write copy of a shadowed block carries the shadow; a reused id's first write not at
  offset 0 drops it; a step that raises leaves no shadow of its blocks;
- teacher-forced decoding lies closer to the float32 pool's logits with the shadows than without;
- the engine: outputs across swap and recompute preemption under faults, forks (n > 1), beam
  search and a disk-tier restart, integrity checked every step.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.ops import native

needs_native = pytest.mark.skipif(not native.available(), reason="native kernels unavailable")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from pagedkv_testing.hf_checkpoints import make_hf_checkpoint

    return str(make_hf_checkpoint(tmp_path_factory.mktemp("recent"), "llama", seed=11))


@pytest.fixture(scope="module")
def loaded(folder):
    from pagedkv.models.loader import load_model

    return load_model(folder)


def _runner(loaded, **kw):
    from pagedkv.runner import ModelRunner

    options = dict(block_size=4, num_blocks=16, num_host_blocks=2, kv_cache_dtype="int8", kv_recent_blocks=4)
    return ModelRunner(loaded, **{**options, **kw})


@pytest.mark.parametrize("backend", ["native", "plain",
                                     pytest.param("triton", marks=pytest.mark.slow)])  # (interpreter on a CPU)
def test_a_reused_block_id_never_reads_a_stale_shadow(loaded, backend):
    """Blocks 1 and 6 hold shadowed tails (2 rows each); B's tail block (3) is swapped out and back
    into 1 and into 5 (never shadowed), then copied from 5 into 6: a decode of B's next token
    over each of 1, 5, 6 gives exactly the same logits (a stale shadow of 1 or 6 would follow
    on at offset 2 with A's or C's rows), the all-8-bit pool's after the same swap (the shadow
    was stored into its 8-bit block before the swap-out), and 1 and 6 lost their shadows."""
    from pagedkv.runner import SeqChunk

    if backend == "native" and not native.available():
        pytest.skip("native kernels unavailable")
    if backend == "triton":
        from pagedkv.ops.triton import usable_on

        if not usable_on("cpu"):
            pytest.skip("Triton's interpreter is unavailable")
    runner = _runner(loaded, attention_backend=backend)
    recent = runner._recent
    assert recent is not None and runner.num_blocks == 16 and runner.kv_full_blocks == 0
    assert runner.num_blocks * runner.bytes_per_block - runner.cache.device_bytes in range(16)  # shadows counted
    runner.execute([SeqChunk(list(range(10, 16)), 0, [0, 1]), SeqChunk(list(range(40, 46)), 0, [2, 3]),
                    SeqChunk(list(range(70, 76)), 0, [4, 6])])
    held = {b - recent.count for b in recent.of}  # callers' ids of the shadowed blocks
    assert held == {1, 3, 6} and all(s.filled == 2 for s in recent.of.values())
    runner.swap_out([(3, 0)])
    runner.swap_in([(0, 1), (0, 5)])
    runner.copy_blocks([(5, 6)])
    assert not recent.of  # every shadowed id got data another way
    logits = runner.execute([SeqChunk([50], 6, [2, t]) for t in (1, 5, 6)])
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    # and what they read is B's rows, stored 8-bit before the swap-out: an all-8-bit pool's reading
    plain = _runner(loaded, attention_backend=backend, kv_recent_blocks=0)
    plain.execute([SeqChunk(list(range(40, 46)), 0, [2, 3])])
    plain.swap_out([(3, 0)])
    plain.swap_in([(0, 5)])
    torch.testing.assert_close(logits[1], plain.execute([SeqChunk([50], 6, [2, 5])])[0], atol=0.01, rtol=0.01)
    # the reused ids' writes at offset 2 took no shadow; a write at offset 0 takes one
    assert not recent.of
    runner.execute([SeqChunk(list(range(80, 87)), 0, [7, 8])])
    assert {b - recent.count for b in recent.of} == {8}


@needs_native
def test_copy_carries_the_shadow_and_a_failed_step_drops_it(loaded):
    """Copy-on-write of a shadowed tail: the destination reads the same (full-precision) rows as the
    source; ids beyond the pool's are refused; a step that raises drops its blocks' shadows."""
    from pagedkv.runner import SeqChunk
    from pagedkv.runner.step_inputs import BatchError

    runner = _runner(loaded)
    recent = runner._recent
    assert recent is not None
    runner.execute([SeqChunk(list(range(10, 16)), 0, [0, 1])])
    runner.copy_blocks([(1, 9)])
    assert set(recent.of) == {1 + recent.count, 9 + recent.count}
    both = runner.execute([SeqChunk([50], 6, [0, 1]), SeqChunk([50], 6, [0, 9])])
    assert torch.equal(both[0], both[1])
    with pytest.raises(BatchError):
        runner.copy_blocks([(1, 16)])  # the callers' ids end at num_blocks (the shadows are the runner's)
    with pytest.raises(BatchError):
        runner.execute([SeqChunk([51], 7, [0, 1]), SeqChunk([52], 7, [2])])  # (the second's table is short)
    assert set(recent.of) == {9 + recent.count}


@needs_native
def test_teacher_forced_logits_lie_closer_to_float32(loaded):
    """The same text fed one token at a time after a short prompt: the int8 pool's logits with the
    recent block read from its shadow lie closer to the float32 pool's than without it (and the
    sequences' own ids are the same: callers see one pool)."""
    from pagedkv.runner import SeqChunk

    text = [(i * 37 + 11) % 250 + 3 for i in range(40)]
    table = list(range(10))

    def feed(runner):
        rows = [runner.execute([SeqChunk(text[:8], 0, table)])]
        rows += [runner.execute([SeqChunk([t], 8 + i, table)]) for i, t in enumerate(text[8:])]
        return torch.cat(rows)

    reference = feed(_runner(loaded, kv_cache_dtype="float32", kv_recent_blocks=0))
    errors = {n: float((feed(_runner(loaded, kv_recent_blocks=n)) - reference).norm() / reference.norm())
              for n in (0, 4)}
    assert 0 < errors[4] < errors[0], errors


def test_refusals(loaded, tmp_path):
    """kv_recent_blocks needs an 8-bit pool, and a model with one KV group and no latent (MLA)
    blocks; the engine option an 8-bit kv_cache_dtype."""
    from pagedkv.engine.config import EngineConfig
    from pagedkv.models.loader import load_model
    from pagedkv_testing.hf_checkpoints import make_hf_checkpoint
    from pagedkv_testing.moe_cases import make_deepseek

    with pytest.raises(ValueError, match="8-bit kv_cache_dtype"):
        _runner(loaded, kv_cache_dtype="float32")
    with pytest.raises(ValueError, match="MLA model"):
        _runner(load_model(str(make_deepseek(tmp_path / "mla", 2, seed=1))))
    with pytest.raises(ValueError, match="several KV groups"):
        _runner(load_model(str(make_hf_checkpoint(tmp_path / "hybrid", "gemma2", seed=1, sliding_window=8))))
    with pytest.raises(ValueError, match="kv_recent_block"):
        EngineConfig(kv_recent_block=True)
    EngineConfig(kv_recent_block=True, kv_cache_dtype="fp8")


@needs_native
def test_engine_beam_search_and_logprobs_under_swaps(folder):
    """An int8 engine with ``kv_recent_block`` (and a sink block): beam search (forks copy-on-write
    their shadowed tails) and greedy requests with logprobs give the same tokens when seeded
    swap preemptions, evictions and allocation failures disturb a small pool (integrity checked
    every step, no block leaks), and logprobs close to the undisturbed run's (a swapped-in tail
    block reads its 8-bit bytes)."""
    from pagedkv import SamplingParams
    from pagedkv.engine import LLMEngine
    prompts = [[(i * 7 + j * 13) % 250 + 3 for j in range(n)] for i, n in enumerate((6, 19, 11, 27))]
    options = dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=32, kv_offloading_size=0.001,
                   preemption_mode="swap", debug_integrity=True, kv_cache_dtype="int8", kv_sink_blocks=1,
                   kv_recent_block=True, max_num_seqs=8)

    def run(engine):
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True))
        engine.add_request("beam", prompts[1], SamplingParams(max_tokens=6, ignore_eos=True), beam_width=3)
        results = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = [(c.token_ids, [max(lp.values(), key=lambda x: x.logprob).logprob
                                                              for lp in c.logprobs or []]) for c in out.outputs]
        assert engine.runner._recent.written_through > 0
        return results

    expected = run(LLMEngine.from_options(folder, **{**options, "num_kv_blocks": 300}))
    engine = LLMEngine.from_options(folder, fault_injection="seed=1,rate=0.2,kinds=swap+evict+alloc", **options)
    got = run(engine)
    stats = engine.stats()
    assert stats.preemptions_swap > 0 and stats.kv.used_blocks == 0 and stats.kv.host_used_blocks == 0
    assert got.keys() == expected.keys()
    for rid, outs in expected.items():
        assert [t for t, _ in got[rid]] == [t for t, _ in outs], rid
        for (_, a), (_, b) in zip(got[rid], outs):
            assert a == pytest.approx(b, abs=0.01), rid


@needs_native
@pytest.mark.parametrize("parts", ["kv", "v"])
def test_without_sinks_host_blocks_and_payloads_are_an_8bit_pools(loaded, parts):
    """No sink blocks: the shadows never leave the device, so the host pool holds 8-bit blocks alone
    and a block's payload is the all-8-bit pool's bytes (a disk tier serves either pool); a
    payload round trip through the host pool and back reads the same logits."""
    from pagedkv.runner import SeqChunk

    runner, plain = (_runner(loaded, kv_quant_parts=parts, kv_recent_blocks=n) for n in (4, 0))
    assert runner.cache.host_kv.shape[2] == 0 and runner.payload_bytes == plain.payload_bytes
    for r in (runner, plain):
        r.execute([SeqChunk(list(range(10, 19)), 0, [0, 1, 2])])  # blocks 0, 1 full, 2 holds one row
    payloads = runner.block_payloads([0, 1, 2])
    assert [len(p) for p in payloads] == [plain.payload_bytes] * 3
    runner.load_host_blocks([(0, payloads[2])])
    runner.swap_in([(0, 5)])
    got = runner.execute([SeqChunk([50], 9, [0, 1, 2]), SeqChunk([50], 9, [0, 1, 5])])
    # block 2 read from its shadow, block 5 from the 8-bit bytes: close, not equal
    assert not torch.equal(got[0], got[1]) and torch.allclose(got[0], got[1], atol=0.05)
    plain.load_host_blocks([(1, payloads[2])])  # the all-8-bit pool takes the payload as its own


def test_shadow_rules():
    """RecentShadows alone: a write at offset 0 takes a shadow (a partly filled block first, the
    least recently used holder reclaimed; a block that fills within the step takes a free one
    only); a write that rewrites rows keeps it, one past its rows drops it."""
    from pagedkv.runner.kv_cache import RecentShadows

    shadows = RecentShadows(first=2, count=2)
    fresh, through = shadows.plan_writes([(10, 0, 4), (11, 0, 3), (12, 0, 2)], block_size=4)
    assert sorted(fresh) == [2, 3] and set(through) == {11, 12}  # the tails first; 10 fills: none free
    assert shadows.plan_writes([(11, 3, 4)], 4)[1] == [11]  # follows on
    assert shadows.plan_writes([(12, 1, 3)], 4)[1] == [12] and shadows.of[12].filled == 3  # rewrites row 1
    shadows.drop(11)
    assert shadows.plan_writes([(13, 0, 1)], 4)[1] == [13]  # the free one
    assert shadows.plan_writes([(14, 0, 1)], 4)[1] == [14] and 12 not in shadows.of  # 12: least recently used
    assert shadows.plan_writes([(13, 2, 3)], 4)[1] == [] and 13 not in shadows.of  # row 1 went another way
    assert shadows.read_id(14) in (2, 3) and shadows.read_id(13) == 13


@needs_native
def test_a_reclaimed_shadow_is_stored_first(loaded):
    """One shadow, two sequences: B's new tail block reclaims A's shadow, whose rows (written only
    to the shadow) go into A's 8-bit block first: A's next decode reads what an all-8-bit pool's
    does."""
    from pagedkv.runner import SeqChunk

    runs = []
    for n in (1, 0):
        runner = _runner(loaded, kv_recent_blocks=n)
        runner.execute([SeqChunk(list(range(10, 16)), 0, [0, 1])])
        runner.execute([SeqChunk([16], 6, [0, 1])])  # A's tail: 3 rows, in the shadow alone
        runner.execute([SeqChunk(list(range(40, 46)), 0, [2, 3])])  # B's tail takes the shadow
        if n:
            assert set(runner._recent.of) == {3 + n}
        runs.append(runner.execute([SeqChunk([17], 7, [0, 1])]))
    torch.testing.assert_close(runs[0], runs[1], atol=0.01, rtol=0.01)


@needs_native
def test_engine_speculative_steps_keep_the_shadow(folder):
    """n-gram speculation with ``kv_recent_block``: verification chunks rewrite rejected rows of a
    shadowed tail (the shadow is kept: test_shadow_rules), and the greedy tokens equal the engine's without
    speculation (a block's 8-bit bytes come from its full shadow: independent of how it was fed)."""
    from pagedkv import SamplingParams
    from pagedkv.engine import LLMEngine

    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    prompts = [[5, 6, 7, 8] * 3 + [5, 6], list(range(3, 30)), [9, 10] * 9]

    def run(**options):
        engine = LLMEngine.from_options(folder, block_size=4, num_kv_blocks=96, debug_integrity=True,
                                        kv_offloading_size=0, kv_cache_dtype="int8", kv_recent_block=True, **options)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return done, engine

    plain, _ = run()
    speculated, engine = run(speculative_config=ngram)
    assert engine.stats().spec_accepted_tokens > 0 and engine.runner._recent.written_through > 0
    assert speculated == plain
