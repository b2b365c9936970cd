"""Per-tenant KV quotas in the memory core (``memory/tenant_ledger.py``) and the scheduler."""

from __future__ import annotations

import pytest

from pagedkv.memory import KVCacheManager
from pagedkv.memory.tenant_ledger import TenantQuotaError, parse_quotas

B = 4


def _cache_prompt(kv: KVCacheManager, seq_id: str, tokens: list[int], tenant: str) -> int:
    """Run a whole prompt through the cache (allocate, compute, free) as the engine would; returns
    the prompt tokens that were hits."""
    cached = kv.allocate_prompt(seq_id, tokens, salt=tenant, tenant=tenant)
    kv.mark_computed(seq_id, len(tokens) - cached)
    kv.free(seq_id)
    kv.check_integrity()
    return cached


def _quiet_hits(quotas: dict[str, float] | None) -> int:
    kv = KVCacheManager(64, B, tenant_quotas=quotas)
    quiet = list(range(1000, 1033))  # 8 full blocks + 1 token
    _cache_prompt(kv, "q0", quiet, "quiet")
    for i in range(40):  # the noisy tenant floods distinct long prompts (12 blocks each)
        _cache_prompt(kv, f"n{i}", [i * 100 + j for j in range(48)], "noisy")
    return _cache_prompt(kv, "q1", quiet, "quiet")


def test_a_noisy_tenant_over_its_quota_evicts_its_own_blocks_first() -> None:
    assert _quiet_hits(None) == 0  # without quotas the flood evicts the quiet tenant's prefix
    assert _quiet_hits({"noisy": 0.5}) == 32  # with one, every block of it is still there


def test_new_prompts_wait_over_the_quota_but_one_alone_always_runs() -> None:
    kv = KVCacheManager(40, B, default_tenant_quota=0.25)  # 10 blocks each
    kv.allocate_prompt("a0", list(range(32)), tenant="a")  # 8 blocks in use
    with pytest.raises(TenantQuotaError, match="tenant 'a' is at its KV quota: holds 8 of 10 blocks"):
        kv.allocate_prompt("a1", list(range(100, 116)), tenant="a")  # 4 more: over
    assert "a1" not in kv
    kv.allocate_prompt("b0", list(range(200, 300)), tenant="b")  # 25 blocks, over its 10, but alone
    kv.check_integrity()
    assert kv.stats().tenants["a"] == (8, 0, 10) and kv.stats().tenants["b"] == (25, 0, 10)
    assert kv.tenancy.ledger.quota_waits == {"a": 1}


def test_growth_past_the_quota_never_takes_another_tenants_cache() -> None:
    kv = KVCacheManager(12, B, default_tenant_quota=0.5)  # 6 blocks each
    _cache_prompt(kv, "q", list(range(25)), "quiet")  # quiet: 6 cached-free blocks (and one freed)
    kv.allocate_prompt("n", list(range(100, 124)), tenant="noisy")  # noisy: its 6 blocks
    tokens = kv.seqs["n"].token_ids
    kv.mark_computed("n", 24)
    tokens += [7] * 4
    with pytest.raises(TenantQuotaError):  # the only free blocks are quiet's cached ones
        kv.allocate_slots("n", 4)
    kv.check_integrity()
    assert kv.stats().tenants["quiet"][1] == 6


def test_quota_flags_parse() -> None:
    assert parse_quotas(["a=0.5", "team=b=0.25"]) == {"a": 0.5, "team=b": 0.25}
    for bad in (["a"], ["a=0"], ["a=1.5"], ["a=x"], ["a=0.1", "a=0.2"]):
        with pytest.raises(ValueError, match="tenant_kv_quota"):
            parse_quotas(bad)


# ---------------------------------------------------------------------------- the engine
from pagedkv import SamplingParams  # noqa: E402
from pagedkv.engine import LLMEngine  # noqa: E402
from pagedkv_testing.hf_checkpoints import make_hf_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("tenancy"), "llama", seed=3)


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 250 + 1 for i in range(n)]


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out.outputs[0].token_ids
    return done


def test_a_waiting_request_preempts_lower_priority_work_worst_first(folder) -> None:
    engine = LLMEngine.from_options(str(folder), block_size=4, num_kv_blocks=24, max_num_seqs=3,
                                    preemption_mode="recompute", debug_integrity=True)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for rid, prio in (("p1", 1), ("p5", 5), ("p3", 3)):
        engine.add_request(rid, _prompt(len(rid) + prio, 16), long, priority=prio)
    engine.step()
    assert {g.request_id for g in engine.scheduler.running} == {"p1", "p5", "p3"}
    engine.add_request("same", _prompt(9, 16), long, priority=5)  # no better than the worst: waits
    engine.step()
    assert engine.scheduler.preemptions["recompute"] == 0
    engine.add_request("urgent", _prompt(10, 16), long, priority=0)
    engine.step()
    # seats are full: the worst running request (p5) gives way, and urgent runs at once
    assert engine.scheduler.groups["p5"].num_preemptions == 1
    assert engine.scheduler.groups["urgent"].status.name == "RUNNING"
    assert {g.request_id for g in engine.scheduler.running} == {"p1", "p3", "urgent"}
    outputs = _run(engine)
    assert set(outputs) == {"p1", "p5", "p3", "same", "urgent"}
    assert engine.scheduler.groups == {} and engine.stats().kv.used_blocks == 0


def test_engine_quota_keeps_a_quiet_tenants_prefix_cached(folder) -> None:
    quiet = _prompt(1, 33)

    def quiet_hits(**quota) -> int:
        engine = LLMEngine.from_options(str(folder), block_size=4, num_kv_blocks=48, max_num_batched_tokens=256,
                                        kv_offloading_size=0, debug_integrity=True, **quota)  # no host tier
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        engine.add_request("q0", quiet, params, tenant="quiet")
        _run(engine)
        for i in range(12):  # the noisy tenant's burst of long prompts, all queued at once
            engine.add_request(f"n{i}", _prompt(100 + i, 40), params, tenant="noisy")
        _run(engine)
        engine.add_request("q1", quiet, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                           tenant="quiet")
        engine.step()
        hits = engine.scheduler.groups["q1"].num_cached_tokens
        _run(engine)
        assert engine.stats().kv.used_blocks == 0
        return hits

    assert quiet_hits() == 0
    assert quiet_hits(tenant_kv_quota=["noisy=0.5"]) == 32


def test_quotas_tenants_and_pins_under_fault_injection_keep_outputs(folder) -> None:
    prompts = [_prompt(i, n) for i, n in enumerate([5, 30, 14, 22, 9, 41, 3, 18])]

    def run(**options) -> dict[str, list[int]]:
        engine = LLMEngine.from_options(str(folder), block_size=4, max_num_batched_tokens=40, debug_integrity=True,
                                        **options)
        for i, p in enumerate(prompts):
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=12 + i, ignore_eos=True)
            engine.add_request(f"r{i}", p, params, tenant=("a", "b", "c")[i % 3], priority=i % 2,
                               conversation_id=f"chat-{i % 4}" if i % 2 else None)
        out = _run(engine)
        stats = engine.stats()
        assert stats.kv.used_blocks == stats.kv.pinned_blocks and set(stats.kv.tenants) <= {"a", "b", "c"}
        assert stats.kv.pins + stats.kv.pins_replaced + stats.kv.pins_released_under_pressure >= 2
        return out

    expected = run(num_kv_blocks=400)
    for seed in range(4):
        got = run(num_kv_blocks=40, tenant_kv_quota=["a=0.3"], default_tenant_kv_quota=0.4, swap_space=0.0002,
                  fault_injection=f"seed={seed},rate=0.15")
        assert got == expected, f"fault seed {seed} changed an output"


# ---------------------------------------------------------------------------- conversation pins
def test_a_pinned_conversation_survives_other_traffic_until_its_ttl(folder, monkeypatch) -> None:
    import pagedkv.engine.scheduler as scheduler_module

    clock = [1000.0]
    monkeypatch.setattr(scheduler_module.time, "monotonic", lambda: clock[0])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def next_turn_hits(pin: bool, wait_s: float) -> tuple[int, int]:
        engine = LLMEngine.from_options(str(folder), block_size=4, num_kv_blocks=40, kv_offloading_size=0,
                                        debug_integrity=True, max_pin_ttl_s=60)
        first = _prompt(1, 21)
        engine.add_request("t1", first, params, conversation_id="chat-1" if pin else None,
                           pin_ttl_s=30 if pin else None)
        history = first + _run(engine)["t1"]
        clock[0] += wait_s
        for i in range(8):  # other traffic that would evict it: 8 x 6 blocks through a 40-block pool
            engine.add_request(f"o{i}", _prompt(50 + i, 21), params)
            _run(engine)
        engine.add_request("t2", history + _prompt(9, 5), params, conversation_id="chat-1" if pin else None)
        engine.step()
        hits = engine.scheduler.groups["t2"].num_cached_tokens
        _run(engine)
        stats = engine.stats().kv
        assert stats.used_blocks == stats.pinned_blocks  # only the new turn's pin is left
        return hits, (len(history) - 1) // 4 * 4

    hits, full = next_turn_hits(pin=True, wait_s=5)
    assert hits == full == 24  # the whole earlier turn, prompt and output
    assert next_turn_hits(pin=False, wait_s=5)[0] == 0
    assert next_turn_hits(pin=True, wait_s=31)[0] == 0  # past its TTL the pin is gone


def test_pins_never_starve_running_work(folder) -> None:
    engine = LLMEngine.from_options(str(folder), block_size=4, num_kv_blocks=24, kv_offloading_size=0,
                                    debug_integrity=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(4):  # four conversations pin 6 blocks each (24 computed tokens): the whole pool
        engine.add_request(f"c{i}", _prompt(i, 21), params, conversation_id=f"chat-{i}")
        _run(engine)
    assert engine.stats().kv.pins == 4 and engine.stats().kv.pinned_blocks == 24
    engine.add_request("big", _prompt(99, 60), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert set(_run(engine)) == {"big"}  # it ran: the oldest pins gave way, and that is counted
    kv = engine.stats().kv
    assert kv.pins_released_under_pressure >= 1 and kv.pins < 4
    with pytest.raises(ValueError, match="pin_ttl_s must be"):
        engine.add_request("bad", _prompt(1, 8), params, conversation_id="x", pin_ttl_s=10_000)


def test_when_all_tenants_are_busy_each_gets_its_share(folder) -> None:
    """Tenant a fills the pool before b arrives; with 0.5 quotas b's waiting requests preempt a's
    work (a is over its quota, b under) until both hold about half while both still wait."""

    def held_while_both_wait(quota: float) -> list[tuple[int, int]]:
        engine = LLMEngine.from_options(str(folder), block_size=4, num_kv_blocks=40, kv_offloading_size=0,
                                        max_num_batched_tokens=64, debug_integrity=True,
                                        default_tenant_kv_quota=quota)
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        for i in range(8):
            engine.add_request(f"a{i}", _prompt(i, 12), params, tenant="a")
        for _ in range(6):
            engine.step()
        for i in range(8):
            engine.add_request(f"b{i}", _prompt(100 + i, 12), params, tenant="b")
        samples = []
        while engine.has_unfinished_requests():
            engine.step()
            if {g.tenant for g in engine.scheduler.waiting} == {"a", "b"}:  # both busy: the blocks each holds
                held = engine.stats().kv.tenants
                samples.append((held.get("a", (0,))[0], held.get("b", (0,))[0]))
        assert engine.stats().kv.used_blocks == 0
        return samples

    fair = held_while_both_wait(0.5)
    assert len(fair) > 20
    assert all(a >= 15 and b >= 15 for a, b in fair[20:]), str(fair)  # each about its 20 blocks
    unfair = held_while_both_wait(1.0)  # quotas that never bind: a keeps the pool it filled first
    assert max(b for _, b in unfair) < 15, unfair


def test_cache_report_sums_up_tenants_misses_and_pins(folder) -> None:
    from pagedkv.engine.stats import cache_report

    engine = LLMEngine.from_options(str(folder), block_size=4, num_kv_blocks=40, tenant_kv_quota=["a=0.5"])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("r0", _prompt(1, 21), params, tenant="a", conversation_id="c")
    _run(engine)
    engine.add_request("r1", _prompt(1, 21), params, tenant="a")
    _run(engine)
    report = cache_report(engine.stats())
    assert "prefix cache: 20/42 prompt tokens hit (47.6%)" in report
    assert "first miss per request: none 1, never_seen 1" in report
    assert "tenant a: 6 blocks held" in report and "quota 20" in report
    assert "conversation pins: 1 holding 6 blocks" in report


def test_a_tenants_only_request_larger_than_its_quota_finishes(folder) -> None:
    """Other tenants' cached blocks fill the pool, each tenant within its quota; tenant a's one
    request needs more than a's quota: it is admitted alone and grows into the others' cache rather
    than being preempted and re-admitted for ever."""
    engine = LLMEngine.from_options(str(folder), block_size=4, num_kv_blocks=40, kv_offloading_size=0,
                                    default_tenant_kv_quota=0.25, debug_integrity=True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for t in "bcde":
        for i in range(2):
            engine.add_request(f"{t}{i}", _prompt(ord(t) * 10 + i, 18), params, tenant=t)
    _run(engine)
    assert engine.stats().kv.used_blocks == 0 and engine.stats().kv.evictable_blocks >= 36
    before = engine.stats().preemptions_recompute
    engine.add_request("big", _prompt(7, 60), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                       tenant="a")
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert not engine.has_unfinished_requests(), "the request never finished"
    assert engine.stats().preemptions_recompute == before  # it was never preempted
