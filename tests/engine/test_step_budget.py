"""The step budget in seconds (engine/step_cost.py): the estimate, its fit to measured steps, and
the scheduler's chunks beside streams (issue 27, item 2). The real-model checks are slow-marked."""

from __future__ import annotations

import os
import random
import time

import pytest

from pagedkv.engine.scheduler import Scheduler, SchedulerConfig
from pagedkv.engine.scheduler_output import StepResult
from pagedkv.engine.sequence import Sequence, SequenceGroup
from pagedkv.engine.step_cost import (
    FEATURES,
    GROWTH,
    WAITING_SHARE,
    StepCostModel,
    StepWork,
    prior_coefficients,
)
from pagedkv.memory import KVCacheManager
from pagedkv.sampling_params import SamplingParams

# Its real-model checks time steps: they run in the serial phase, with the CPU to themselves.
pytestmark = pytest.mark.serial

B = 16
# overhead 1 ms, 1 ms per token, 1 us per attended pair, 2 ms per row, 1 ms per processed row
COEF = (1e-3, 1e-3, 1e-6, 2e-3, 1e-3)


def _work(tokens: int, attended: int, rows: int, processed: int) -> StepWork:
    return StepWork(tokens, attended, rows, processed)


def test_attended_pairs_of_a_chunk() -> None:
    w = StepWork()
    w.add(0, 4)  # positions 0..3 attend 1, 2, 3, 4 keys
    assert w.attended == 10
    w.add(100, 1)  # a decode at position 100 attends 101
    assert (w.tokens, w.attended) == (5, 111)
    w.add(10, 3, rows=2, processed=2)  # 11 + 12 + 13
    assert (w.tokens, w.attended, w.rows, w.processed) == (8, 147, 2, 2)


def test_max_tokens_is_the_largest_chunk_within_the_seconds() -> None:
    model = StepCostModel(COEF)
    for start in (0, 500, 7000):
        for seconds in (0.01, 0.3, 2.0):
            n = model.max_tokens(start, seconds, rows=1)
            assert model.chunk_seconds(start, n, rows=1) <= seconds + 1e-12
            assert model.chunk_seconds(start, n + 1, rows=1) > seconds - 1e-9
    # the same seconds buy fewer tokens deeper into a prompt: attention grows with the context
    assert model.max_tokens(0, 2.0) > model.max_tokens(4000, 2.0) > model.max_tokens(7900, 2.0) > 0
    assert model.max_tokens(0, 0.001, rows=1) == 0  # not even the row fits


def test_the_fit_recovers_the_coefficients_of_measured_steps() -> None:
    """Steps timed by a known linear law (with 3% noise), from a prior 10x too slow and in the
    wrong proportions: the fit finds the coefficients (within 15% the large ones) and estimates
    within 10%."""
    rng = random.Random(0)
    model = StepCostModel(tuple(c * 10 * rng.uniform(0.3, 3) for c in COEF))
    truth = StepCostModel(COEF)
    for _ in range(300):
        decodes = rng.randrange(0, 40)
        chunk, start = rng.choice([(0, 0), (rng.randrange(16, 1024), rng.randrange(0, 6000))])
        w = StepWork()
        for _ in range(decodes):
            w.add(rng.randrange(10, 3000), 1, rows=1, processed=rng.random() < 0.3)
        w.add(start, chunk, rows=1 if chunk else 0)
        if w.tokens == 0:
            continue
        model.observe(w, truth.estimate(w) * rng.uniform(0.97, 1.03))
    # (the overhead and the processed rows, small parts of every step, are the least determined)
    loose = {"overhead": 0.6, "processed": 0.3}
    for name, fitted, want in zip(FEATURES, model.coef, COEF):
        assert fitted == pytest.approx(want, rel=loose.get(name, 0.15)), name
    w = _work(600, 600 * 3000, 1, 0)
    assert model.estimate(w) == pytest.approx(truth.estimate(w), rel=0.1)
    assert model.observed > 250 and model.error is not None and model.error > 1.0  # the early misses count


def test_a_feature_never_varied_keeps_the_prior_proportion() -> None:
    """No step ever processes a row: that coefficient follows the common scale of the others."""
    model = StepCostModel(COEF)
    for tokens in range(10, 400, 10):
        w = _work(tokens, tokens * tokens // 2, 1, 0)
        model.observe(w, 2 * StepCostModel(COEF).estimate(w))  # the machine is twice as slow
    assert model.coef[4] == pytest.approx(2 * COEF[4], rel=0.2)
    assert model.coef[1] == pytest.approx(2 * COEF[1], rel=0.2)


def test_prior_from_a_model_shape() -> None:
    class Shape:
        hidden_size, intermediate_size, num_hidden_layers = 576, 1536, 30
        num_attention_heads, num_key_value_heads, head_dim, vocab_size = 9, 3, 64, 49152

    prior = prior_coefficients(Shape())
    assert len(prior) == len(FEATURES) and all(p > 0 for p in prior)
    # the default model: ~2 x 106M FLOPs per token, 4 x 30 x 9 x 64 per attended pair
    assert prior[1] == pytest.approx(2 * 30 * (576 * (576 + 384) + 576 * 576 + 3 * 576 * 1536) / 2e10)
    assert prior[2] == pytest.approx(4 * 30 * 9 * 64 / 5e9)
    with pytest.raises(ValueError, match="prior"):
        StepCostModel((1.0, 0.0, 1.0, 1.0, 1.0))


# ---------------------------------------------------------------------- the scheduler's plans
def _group(rid: str, prompt: list[int], arrival: int, *, n: int = 1, max_tokens: int = 10_000,
           priority: int = 0) -> SequenceGroup:
    params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)
    g = SequenceGroup(rid, None, list(prompt), params, arrival, priority=priority, max_tokens=max_tokens)
    g.seqs.append(Sequence(f"{rid}#0", 0, len(prompt), list(prompt)))
    return g


def _step(sched: Scheduler):
    """One planned step whose sampled sequences each get a token (forks made as the engine does)."""
    out = sched.schedule()
    result = StepResult()
    for s in out.scheduled:
        if s.samples:
            if not s.group.forked:
                s.group.forked = True
                for i in range(1, s.group.params.n):
                    child = Sequence(f"{s.group.request_id}#{i}", i, s.seq.prompt_len, list(s.seq.token_ids) + [1])
                    s.group.seqs.append(child)
                    result.forks.append((s.seq, child))
            s.seq.token_ids.append(1)
    sched.update_from_output(out, result)
    return out


def _scheduler(seconds: float | None, *, max_num_seqs: int = 64, blocks: int = 1024) -> Scheduler:
    kv = KVCacheManager(blocks, B)  # (a known model: no exploring growth of the chunks)
    return Scheduler(SchedulerConfig(max_num_seqs, 2048, "recompute"), kv, StepCostModel(COEF, seconds, growth=None))


def _chunk_of(out, rid: str) -> int:
    return sum(s.num_tokens for s in out.scheduled if s.group.request_id == rid)


def test_a_long_prompt_is_chunked_by_seconds_beside_a_stream() -> None:
    """An 8,000-token prompt beside a decoding stream: the stream decodes every step, each
    step's estimate stays within the budget (plus the stream's decode row), and the chunks shrink
    as the context grows (the token budget alone takes 2,048 tokens a step whatever the context)."""
    budget = 0.5
    sched = _scheduler(budget)
    sched.add(_group("victim", list(range(3, 20)), 0))
    _step(sched)
    sched.add(_group("long", [7 + i % 50 for i in range(8000)], 1))
    chunks = []
    while sched.kv.num_computed("long#0") < 8000 if "long#0" in sched.kv else True:
        out = _step(sched)
        assert _chunk_of(out, "victim") == 1  # the stream never misses a step
        assert sched.costs.estimate(out.work) <= budget + 0.01
        chunks.append(_chunk_of(out, "long"))
        if sched.groups["long"].seqs[0].num_tokens > 8000:
            break
    assert sum(chunks) == 8000
    assert chunks[0] > chunks[len(chunks) // 2] > chunks[-2] > 0
    assert max(chunks) < 2048 and len(chunks) > 8000 / 2048


def test_without_a_time_budget_chunks_follow_the_token_budget() -> None:
    sched = _scheduler(None)
    sched.add(_group("long", [7 + i % 50 for i in range(5000)], 0))
    assert [_chunk_of(_step(sched), "long") for _ in range(3)] == [2048, 2048, 904]


def test_a_newcomer_is_admitted_beside_a_long_prefill() -> None:
    """A long prompt already prefilling leaves WAITING_SHARE of the step to a request that
    arrives: admitted in the very next step, its short prompt done in it."""
    budget = 0.5
    sched = _scheduler(budget)
    sched.add(_group("long", [7 + i % 50 for i in range(8000)], 0))
    for _ in range(3):
        _step(sched)
    sched.add(_group("new", list(range(100, 137)), 1))
    out = _step(sched)
    assert _chunk_of(out, "new") == 37 and sched.groups["new"].seqs[0].num_tokens == 38  # its first token
    long_chunk = _chunk_of(out, "long")
    start = sched.kv.num_computed("long#0") - long_chunk
    assert 0 < sched.costs.chunk_seconds(start, long_chunk) <= (1 - WAITING_SHARE) * budget
    # a newcomer of a lower priority (a higher value): the prefill ahead of it takes the step
    sched.add(_group("low", list(range(3, 40)), 2, priority=5))
    for _ in range(3):
        out = _step(sched)
        assert _chunk_of(out, "new") == 1 and _chunk_of(out, "low") == 0
        assert budget * 0.98 <= sched.costs.estimate(out.work) <= budget + 0.01


def test_requests_waiting_for_the_prefix_being_computed_leave_the_prompt_the_whole_step() -> None:
    """Case d's shape: requests that share a long prompt's prefix wait for it (then hit it), so the
    share a newcomer would get is no one's: the prompt takes the whole budget each step, and once
    its prefix is computed the followers are admitted on it, only their own tokens computed."""
    budget = 0.5
    sched = _scheduler(budget)
    prefix = [7 + i % 50 for i in range(2048)]
    sched.add(_group("first", prefix + list(range(100, 132)), 0))
    _step(sched)
    for i in range(3):
        sched.add(_group(f"f{i}", prefix + list(range(200 + 32 * i, 232 + 32 * i)), 1 + i))
    while sched.kv.num_computed("first#0") < 2080:
        out = _step(sched)
        assert not any(_chunk_of(out, f"f{i}") for i in range(3))
        if sched.kv.num_computed("first#0") < 2048:  # (the last chunk may be short: the prompt ends)
            assert sched.costs.estimate(out.work) >= 0.98 * budget
    out = _step(sched)
    assert [_chunk_of(out, f"f{i}") for i in range(3)] == [32, 32, 32]
    assert all(s.start == 2048 for s in out.scheduled if s.group.request_id != "first")


def test_decodes_do_not_spend_the_prefill_budget() -> None:
    """30 streams whose decodes alone exceed the budget: a long prompt beside them still gets the
    whole budget (a stream waits for every stream's decode anyway; charging them would only slow
    admissions beside a full batch)."""
    budget = 0.05
    sched = _scheduler(budget)
    for i in range(30):
        sched.add(_group(f"d{i}", list(range(3, 12)), i))
    for _ in range(40):  # (their prompts too are admitted as the seconds allow)
        _step(sched)
    assert len(sched.running) == 30 and not sched.waiting
    assert sched.costs.estimate(_step(sched).work) > budget
    sched.add(_group("long", [7 + i % 50 for i in range(3000)], 99))
    out = _step(sched)
    chunk = _chunk_of(out, "long")
    assert chunk == StepCostModel(COEF).max_tokens(0, budget - COEF[0]) > 0
    assert all(_chunk_of(out, f"d{i}") == 1 for i in range(30))


def test_fan_out_takes_turns_and_leaves_room_for_a_newcomer() -> None:
    """n = 128 with max_num_seqs = 64: a step computes at most 64 rows (the forks take turns, the
    least advanced first), and a newcomer is admitted beside it, not after it."""
    sched = _scheduler(None, max_num_seqs=64, blocks=4096)
    sched.add(_group("fan", list(range(3, 30)), 0, n=128))
    _step(sched)  # the prompt, and 128 forks sampled at once
    fan = sched.groups["fan"]
    assert fan.num_live == 128
    rows = [len(_step(sched).scheduled) for _ in range(4)]
    assert rows == [64] * 4
    assert len({s.num_tokens for s in fan.seqs}) == 1  # everyone had two turns
    sched.add(_group("new", list(range(100, 137)), 1))
    out = _step(sched)
    assert _chunk_of(out, "new") == 37 and len(out.scheduled) == 64


# ---------------------------------------------------------------------- the real default model
LONG_PROMPT_TOKENS = int(os.environ.get("PAGEDKV_LONG_PROMPT_TOKENS", "4000"))

@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_long_prompt_beside_streams_on_the_default_model() -> None:
    """Issue 27's probe: a long prompt of random token ids while a request streams, on `pagedkv
    serve` with the default model and flags. The stream's longest gap stays <= 5 s while the
    prompt is prefilled (42.7 s before the step budget, at 8,000 tokens), a stream that arrives
    meanwhile gets its first token within 10 s, /health answers within 1 s throughout, and the
    long request is answered. LONG_PROMPT_TOKENS (env PAGEDKV_LONG_PROMPT_TOKENS) is 4,000 to keep
    CI short; 8,000 is the issue's probe (about 100 s of prefill on a quiet 2-core machine)."""
    import threading

    import httpx

    from pagedkv_testing.latency_probe import HealthProbe, StreamProbe, rss_bytes
    from pagedkv_testing.server import free_port, spawn_server, stop_server

    port = free_port()
    proc, _ = spawn_server(["--port", str(port)], timeout=180)
    base = f"http://127.0.0.1:{port}"
    story = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": 4000,
             "ignore_eos": True, "temperature": 0}
    try:
        with HealthProbe(base) as health:
            victim = StreamProbe(base, story).start()
            victim.wait_tokens(3, timeout=60)
            assert len(victim.times) >= 3, victim.error
            rss_before = rss_bytes(proc.pid)
            ids = [random.Random(0).randrange(100, 40000) for _ in range(LONG_PROMPT_TOKENS)]
            answer: dict[str, object] = {}

            def long_request() -> None:
                r = httpx.post(f"{base}/v1/completions", json={"prompt": ids, "max_tokens": 1}, timeout=600)
                answer["status"], answer["at"] = r.status_code, time.monotonic()

            started = time.monotonic()
            heavy = threading.Thread(target=long_request, daemon=True)
            heavy.start()
            time.sleep(8)
            newcomer = StreamProbe(base, {**story, "prompt": "A second, shorter story.", "max_tokens": 20}).start()
            heavy.join(300)
            assert answer.get("status") == 200, answer
            newcomer.finished.wait(60)
            victim.stop()
            time.sleep(1)
            rss_after = rss_bytes(proc.pid)
        gap = victim.worst_gap(since=started, until=float(answer["at"]))
        print(f"long prompt answered in {float(answer['at']) - started:.1f} s; victim's longest gap "
              f"{gap:.2f} s over {len(victim.times)} tokens; newcomer TTFT {newcomer.ttft:.2f} s; "
              f"/health worst {health.worst:.2f} s; RSS {rss_before >> 20} -> {rss_after >> 20} MiB")
        assert gap <= 5.0
        assert newcomer.ttft <= 10.0, newcomer.error
        assert health.worst <= 1.0
        assert rss_after <= 1.05 * rss_before
    finally:
        stop_server(proc)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_estimate_tracks_measured_steps_on_the_default_model() -> None:
    """Every step's estimate, made before the step is observed, against its measured time: a
    stream beside prompts of 300 to 1,500 tokens (chunks from position 0 to ~1,500, decodes).
    After ten steps of fitting, the median ratio is within 1.5x and four steps in five within 2x
    (a step a busy machine slows down is a miss too)."""
    from pagedkv.engine import LLMEngine

    engine = LLMEngine.from_options()
    model = engine.step_costs
    pairs: list[tuple[float, float]] = []
    real = model.observe

    def observe(work: StepWork, seconds: float) -> None:
        pairs.append((model.estimate(work), seconds))
        real(work, seconds)

    model.observe = observe
    rng = random.Random(1)
    engine.add_request("s", "Tell me about the sea.", SamplingParams(max_tokens=4000, ignore_eos=True,
                                                                     temperature=0))
    for k, n in enumerate([300, 900, 1500, 400]):
        engine.add_request(f"p{k}", [rng.randrange(100, 40000) for _ in range(n)],
                           SamplingParams(max_tokens=3, ignore_eos=True, temperature=0))
        while f"p{k}" in engine.scheduler.groups:
            engine.step()
    for _ in range(5):
        engine.step()
    ratios = sorted(measured / estimate for estimate, measured in pairs[10:])
    print(f"{len(ratios)} steps: measured/estimated from {ratios[0]:.2f} to {ratios[-1]:.2f}, "
          f"median {ratios[len(ratios) // 2]:.2f}; fit {model.as_dict()}")
    assert 1 / 1.5 <= ratios[len(ratios) // 2] <= 1.5
    assert len(ratios) >= 15 and sum(1 for r in ratios if 0.5 <= r <= 2.0) >= 0.8 * len(ratios)
    engine.close()


def test_chunks_grow_geometrically_past_what_was_measured() -> None:
    """A new engine whose prior is 10x too optimistic: a chunk beyond a small share of the budget
    asks at most GROWTH times what was measured, so no step's true time passes twice the budget
    while the fit learns; without that guard the first chunk alone takes 8x the budget."""
    truth = StepCostModel(COEF)

    def first_steps(growth: float | None) -> list[float]:
        model = StepCostModel(tuple(c / 10 for c in COEF), 0.5, growth=growth)
        sched = Scheduler(SchedulerConfig(64, 2048, "recompute"), KVCacheManager(1024, B), model)
        sched.add(_group("long", [7 + i % 50 for i in range(8000)], 0))
        seconds = []
        for _ in range(8):
            out = _step(sched)
            seconds.append(truth.estimate(out.work))
            model.observe(out.work, seconds[-1])
        return seconds

    guarded = first_steps(GROWTH)
    assert max(guarded) <= 2 * 0.5 and min(guarded[3:]) > 0.25  # bounded, and soon near the budget
    assert first_steps(None)[0] > 8 * 0.5
