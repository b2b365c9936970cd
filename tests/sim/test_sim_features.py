"""Prefix caching, copy-on-write forks, beams, chats, closed loops and edge cases in the simulator."""

from __future__ import annotations

from pagedkv.sim.policies import PolicySpec, parse_policies
from pagedkv.sim.simulator import SimConfig, simulate
from pagedkv.sim.workload import Request, generate_workload
from pagedkv.workloads import ALPACA, SHAREGPT, WorkloadConfig, resolve_shape


def test_shared_system_prompt_hits_the_prefix_cache() -> None:
    reqs = generate_workload(WorkloadConfig(ALPACA, num_requests=150, prefix_len=400,
                                            num_prefixes=2, seed=0))
    config = SimConfig(capacity=16384, max_model_len=2048)
    plain = simulate(reqs, PolicySpec("paged", 16), config)
    cached = simulate(reqs, PolicySpec("paged", 16, prefix=True), config)
    assert plain.prefix_hit_rate is None
    assert cached.prefix_hit_rate is not None and cached.prefix_hit_rate > 0.8
    assert cached.peak_concurrency > 2 * plain.peak_concurrency
    assert cached.steps < plain.steps


def test_multi_turn_chat_reuses_its_history() -> None:
    reqs = generate_workload(WorkloadConfig(SHAREGPT, num_requests=60, turns=4, clients=8,
                                            max_model_len=4096, seed=0))
    result = simulate(reqs, PolicySpec("paged", 16, prefix=True),
                      SimConfig(capacity=1 << 16, max_model_len=4096))
    assert result.completed == 60
    assert result.prefix_hit_rate is not None and result.prefix_hit_rate > 0.5


def test_copy_on_write_forks_share_the_prompt() -> None:
    shape = resolve_shape("custom", "fixed:512", "fixed:64")
    reqs = generate_workload(WorkloadConfig(shape, num_requests=40, n=4, seed=0))
    config = SimConfig(capacity=16384, max_model_len=2048)
    copies = simulate(reqs, PolicySpec("paged", 16), config)
    cow = simulate(reqs, PolicySpec("paged", 16, cow=True), config)
    # 4 samples of a 576-token sequence: 4 x 36 blocks copied, vs 32 shared + 4 x 4 own.
    assert cow.saturated_concurrency > 2 * copies.saturated_concurrency
    assert cow.cow_copies == 0  # 512 = 32 full blocks: the first write opens a fresh block
    assert copies.cow_copies == 0


def test_copy_on_write_copies_a_shared_partial_block() -> None:
    shape = resolve_shape("custom", "fixed:100", "fixed:8")  # 100 = 6 blocks + 4 tokens
    reqs = generate_workload(WorkloadConfig(shape, num_requests=5, n=3, seed=0))
    result = simulate(reqs, PolicySpec("paged", 16, cow=True),
                      SimConfig(capacity=4096, max_model_len=2048, check_integrity=True))
    assert result.cow_copies == 5 * 2  # two of three samples copy the shared last block


def test_beam_search_completes_under_pressure_for_every_policy() -> None:
    reqs = generate_workload(WorkloadConfig(ALPACA, num_requests=40, beam_width=4, seed=5))
    config = SimConfig(capacity=2048, max_model_len=2048, beam_reshuffle=0.5,
                       check_integrity=True)
    for spec in parse_policies("contiguous-oracle,buddy,paged@8,paged+cow@8,paged+prefix+cow@8",
                               (16,)):
        result = simulate(reqs, spec, config)
        assert result.completed == 40, spec.name
    cow = simulate(reqs, PolicySpec("paged", 8, cow=True), config)
    assert cow.cow_copies > 0


def test_too_large_requests_are_rejected_not_stuck() -> None:
    reqs = [Request(0, list(range(1, 101)), 10), Request(1, list(range(101, 2101)), 10),
            Request(2, list(range(3001, 3051)), 10)]
    config = SimConfig(capacity=1024, max_model_len=4096)
    for spec in parse_policies("contiguous-max,contiguous-oracle,buddy,paged@16", (16,)):
        result = simulate(reqs, spec, config)
        expected = 3 if spec.name == "contiguous-max" else 1  # 4096-slot reservations never fit
        assert result.rejected == expected, spec.name
        assert result.completed + result.rejected == 3


def test_request_that_outgrows_memory_is_dropped() -> None:
    reqs = [Request(0, list(range(1, 101)), 500)]  # fits as a prompt, not when grown
    result = simulate(reqs, PolicySpec("paged", 16), SimConfig(capacity=256, max_model_len=4096))
    assert (result.completed, result.rejected) == (0, 1)


def test_poisson_arrivals_idle_and_max_num_seqs() -> None:
    reqs = generate_workload(WorkloadConfig(ALPACA, num_requests=50, rate=0.02, seed=0))
    result = simulate(reqs, PolicySpec("paged", 16), SimConfig(capacity=1 << 15, max_model_len=2048))
    assert result.completed == 50 and result.steps >= reqs[-1].arrival_step
    assert result.mean_concurrency < 5  # light load
    capped = simulate(generate_workload(WorkloadConfig(ALPACA, num_requests=50, seed=0)),
                      PolicySpec("paged", 16),
                      SimConfig(capacity=1 << 15, max_model_len=2048, max_num_seqs=8))
    assert capped.peak_seqs == 8


def test_hybrid_model_releases_window_blocks_and_fits_more_sequences():
    """A Gemma-3-like hybrid cache (1 full + 5 sliding groups of window 256) on long sequences:
    paged memory with per-group tables holds several times the sequences of a contiguous
    reservation of every layer, with prefix caching, forks and integrity checked every step."""
    shape = resolve_shape("sharegpt", "fixed:1500", "fixed:300")
    reqs = generate_workload(WorkloadConfig(shape, num_requests=40, n=2, prefix_len=512, seed=3))
    windows = (None,) + (256,) * 5
    config = SimConfig(capacity=6 * 16384, max_model_len=4096, kv_group_windows=windows, check_integrity=True)
    paged = simulate(reqs, PolicySpec("paged", 16, prefix=True, cow=True), config)
    full = simulate(reqs, PolicySpec("contiguous-oracle"), config)
    assert paged.completed == full.completed == 40
    assert paged.mean_concurrency > 3 * full.mean_concurrency
    assert paged.prefix_hit_rate is not None and paged.prefix_hit_rate > 0
