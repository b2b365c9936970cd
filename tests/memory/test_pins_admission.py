"""Conversation pins never starve admission (issue 27, item 4): a waiting prompt that cannot be
admitted lets pins go (oldest first, other tenants' before its own) whether or not something runs;
pins count against their tenant's quota; a tenant's pins past ``max_tenant_pin_fraction`` of the
pool are refused at pin time, and the response's cache details say so.
"""

from __future__ import annotations

import time

import pytest

from pagedkv import SamplingParams
from pagedkv.engine import LLMEngine
from pagedkv.memory import KVCacheManager, OutOfBlocksError
from pagedkv.memory.tenant_ledger import TenantQuotaError
from pagedkv_testing.hf_checkpoints import make_hf_checkpoint

B = 4


def _tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 250 + 1 for i in range(n)]


def _pin_turn(kv: KVCacheManager, tenant: str, conversation: str, tokens: list[int], ttl: float = 1e9):
    """One finished turn of a conversation: computed, pinned, freed (as the scheduler does)."""
    seq_id = f"{tenant}/{conversation}"
    kv.allocate_prompt(seq_id, tokens, salt=tenant, tenant=tenant)
    kv.mark_computed(seq_id, len(tokens) - kv.num_computed(seq_id))
    outcome = kv.pin_prefix(seq_id, (tenant, conversation), ttl)
    kv.free(seq_id)
    kv.check_integrity()
    return outcome


# ---------------------------------------------------------------------------- the memory core
def test_a_waiting_prompt_takes_pins_while_work_runs_other_tenants_first() -> None:
    kv = KVCacheManager(33, B)
    running = _tokens(99, 8 * B)  # tenant b's stream holds 8 blocks and keeps running
    kv.allocate_prompt("stream", running, salt="b", tenant="b")
    for i in range(3):  # a's and b's pins, oldest first: a0 b0 a1 b1 a2 b2, 4 blocks each
        assert _pin_turn(kv, "a", f"c{i}", _tokens(i, 4 * B + 1)).blocks == 4
        assert _pin_turn(kv, "b", f"c{i}", _tokens(50 + i, 4 * B + 1)).blocks == 4
    assert kv.num_free_blocks == 1 and len(kv.tenancy.pins) == 6
    # b's new prompt needs 14 blocks while b's stream runs: before, it waited for the stream to end
    kv.allocate_prompt("new", _tokens(7, 14 * B - 1), salt="b", tenant="b")
    # a's pins went first (oldest first), then b's oldest: 1 + 12 + 4 blocks free, 14 taken
    assert sorted(kv.tenancy.pins.pins) == [("b", "c1"), ("b", "c2")]
    assert kv.tenancy.pins.released_under_pressure == 4 and kv.num_free_blocks == 17 - 14
    kv.check_integrity()


def test_pins_stay_when_even_all_of_them_would_not_admit_the_prompt() -> None:
    kv = KVCacheManager(33, B)
    kv.allocate_prompt("stream", _tokens(99, 20 * B), salt="b", tenant="b")
    for i in range(3):
        _pin_turn(kv, "a", f"c{i}", _tokens(i, 4 * B + 1))
    assert len(kv.tenancy.pins) == 3 and kv.num_free_blocks == 1
    with pytest.raises(OutOfBlocksError):  # 24 blocks needed; free 1 + pins 12: wait, keep them
        kv.allocate_prompt("big", _tokens(7, 24 * B), salt="c", tenant="c")
    assert len(kv.tenancy.pins) == 3 and kv.tenancy.pins.released_under_pressure == 0
    kv.free("stream")
    kv.allocate_prompt("big", _tokens(7, 24 * B), salt="c", tenant="c")  # now they give way
    assert len(kv.tenancy.pins) < 3
    kv.check_integrity()


def test_a_prompt_never_releases_the_pin_it_hits() -> None:
    kv = KVCacheManager(16, B)
    first = _tokens(1, 4 * B + 1)
    _pin_turn(kv, "a", "chat", first)
    _pin_turn(kv, "b", "other", _tokens(2, 4 * B + 1))
    kv.allocate_prompt("stream", _tokens(3, 6 * B), salt="c", tenant="c")
    assert kv.num_free_blocks == 2
    # the next turn of a's chat: its 4 pinned blocks are hits; b's pin gives way for the rest
    hits = kv.allocate_prompt("turn2", first + _tokens(4, 4 * B), salt="a", tenant="a")
    assert hits == 4 * B and list(kv.tenancy.pins.pins) == [("a", "chat")]
    kv.check_integrity()


def test_pins_count_against_the_quota_and_a_share_caps_them() -> None:
    kv = KVCacheManager(40, B, tenant_quotas={"a": 0.5}, max_tenant_pin_fraction=0.25)
    assert kv.tenancy.pin_limit == 10
    assert _pin_turn(kv, "a", "c0", _tokens(0, 5 * B + 1)).blocks == 5
    assert _pin_turn(kv, "a", "c1", _tokens(1, 5 * B + 1)).blocks == 5
    refused = _pin_turn(kv, "a", "c2", _tokens(2, 5 * B + 1))
    assert refused.blocks == 0 and "would hold 15 KV blocks" in refused.refused
    assert "max_tenant_pin_fraction" in refused.refused
    assert kv.tenancy.pins.blocks_of("a") == 10 and kv.tenancy.pins.refused == 1
    assert _pin_turn(kv, "a", "c1", _tokens(1, 5 * B + 3)).blocks == 5  # a newer turn replaces its own
    assert _pin_turn(kv, "b", "c0", _tokens(9, 5 * B + 1)).blocks == 5  # another tenant has its own share
    assert kv.stats().tenants["a"][0] >= 10  # a's pinned blocks are held by a, against its quota
    # a holds 10 pinned blocks of its 20-block quota (plus cached-free ones it gives up first): a
    # prompt of 12 fresh blocks fits only once its own pins give way, never b's
    kv.allocate_prompt("a-new", _tokens(20, 12 * B), salt="a", tenant="a")
    assert kv.tenancy.pins.blocks_of("a") == 5 and kv.tenancy.pins.blocks_of("b") == 5
    with pytest.raises(TenantQuotaError):  # the rest of its quota is in use: its last pin went, b's stays
        kv.allocate_prompt("a-more", _tokens(21, 12 * B), salt="a", tenant="a")
    assert kv.tenancy.pins.blocks_of("a") == 0 and kv.tenancy.pins.blocks_of("b") == 5
    kv.check_integrity()
    with pytest.raises(ValueError, match="max_tenant_pin_fraction"):
        KVCacheManager(40, B, max_tenant_pin_fraction=1.5)


# ---------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("pins"), "llama", seed=3)


def test_pins_and_a_stream_of_one_tenant_never_starve_another_tenants_prompt(folder) -> None:
    """As found, scaled down: one tenant's pinned conversations plus its long stream fill the
    pool; another tenant's long prompt waited until the stream ended (pins gave way for a new
    prompt only when nothing ran). Now it is admitted at once, beside the stream."""
    engine = LLMEngine.from_options(str(folder), block_size=B, num_kv_blocks=64, kv_offloading_size=0,
                                    debug_integrity=True)
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("stream", _tokens(99, 8), SamplingParams(temperature=0, max_tokens=150, ignore_eos=True),
                       tenant="a")
    engine.step()
    for i in range(12):  # 12 conversations of tenant a, pinned turn by turn while its stream runs
        engine.add_request(f"chat{i}", _tokens(i, 17), short, tenant="a", conversation_id=f"chat{i}",
                           pin_ttl_s=600)
        while f"chat{i}" in engine.scheduler.groups:
            engine.step()
    kv = engine.stats().kv
    assert kv.pins >= 8 and kv.free_blocks < 15, kv  # the pool is pins and the stream: the victim needs 15
    start = time.monotonic()
    engine.add_request("victim", _tokens(500, 60), short, tenant="b")
    steps_to_admit = 0
    while engine.scheduler.groups["victim"].num_cached_tokens < 0:  # (set at its first admission)
        engine.step()
        steps_to_admit += 1
        assert steps_to_admit < 1000 and time.monotonic() - start < 30
    assert steps_to_admit == 1 and "stream" in engine.scheduler.groups  # beside the stream, at once
    done = {}
    while "victim" not in done:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["victim"].error is None and len(done["victim"].outputs[0].token_ids) == 3
    assert time.monotonic() - start < 30
    while engine.has_unfinished_requests():
        engine.step()
    steps = engine.stats().num_steps
    for _ in range(3):  # nothing runs or waits: the step counter stays
        assert engine.step() == []
    assert engine.stats().num_steps == steps


def test_a_refused_pin_is_a_warning_in_the_cache_details(folder) -> None:
    engine = LLMEngine.from_options(str(folder), block_size=B, num_kv_blocks=40, kv_offloading_size=0,
                                    max_tenant_pin_fraction=0.25, debug_integrity=True)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = {}
    for i in range(3):  # 5 pinned blocks each; the share is 10
        engine.add_request(f"r{i}", _tokens(i, 18), params, tenant="a", conversation_id=f"c{i}")
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out
    assert [len(outs[f"r{i}"].cache_details.warnings) for i in range(3)] == [0, 0, 1]
    warning = outs["r2"].cache_details.for_caller()["warnings"][0]
    assert warning.startswith("conversation not pinned") and "max_tenant_pin_fraction" in warning
    assert "warnings" not in outs["r0"].cache_details.for_caller()
    kv = engine.stats().kv
    assert kv.pins == 2 and kv.pinned_blocks == 10 and kv.pins_refused == 1


@pytest.mark.parametrize("seed", range(3))
def test_random_pins_turns_and_prompts_keep_integrity(seed) -> None:
    """Random turns pinned by three tenants, expiries, running prompts that grow and new prompts
    that need more than is free: every structure agrees after each operation, no tenant's pins
    pass the share, and a prompt is refused only when even every pin it may release would not
    admit it."""
    import random

    rng = random.Random(seed)
    kv = KVCacheManager(48, B, max_tenant_pin_fraction=0.25)
    running: list[str] = []
    clock = 0.0
    for step in range(300):
        clock += 1.0
        op = rng.random()
        tenant = rng.choice("abc")
        if op < 0.35:  # a turn that pins its prefix
            try:
                _pin_turn(kv, tenant, f"c{rng.randrange(6)}", _tokens(rng.randrange(40), rng.randrange(5, 30)),
                          ttl=clock + rng.randrange(1, 40))
            except OutOfBlocksError:
                pass
        elif op < 0.6:  # a new prompt (no prefix hits), left running
            seq_id = f"s{step}"
            tokens = _tokens(1000 + step, rng.randrange(2, 60))
            free, releasable = kv.num_free_blocks, kv.tenancy.pins.releasable()
            try:
                kv.allocate_prompt(seq_id, tokens, salt=tenant, tenant=tenant)
                running.append(seq_id)
            except OutOfBlocksError:
                need = -(-len(tokens) // B)
                assert free + releasable < need or not kv.tenancy.pins, (free, releasable, need)
        elif op < 0.75 and running:  # a running sequence grows
            seq_id = rng.choice(running)
            try:
                kv.allocate_slots(seq_id, rng.randrange(1, 9))
            except OutOfBlocksError:
                pass
        elif op < 0.9 and running:
            kv.free(running.pop(rng.randrange(len(running))))
        else:
            kv.expire_pins(clock)
        kv.check_integrity()
        assert all(kv.tenancy.pins.blocks_of(t) <= kv.tenancy.pin_limit for t in "abc")
    pins = kv.tenancy.pins
    assert pins.refused and pins.released_under_pressure and pins.expired  # each path taken
