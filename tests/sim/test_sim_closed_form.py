"""The simulator's waste figures against closed forms, and its paged numbers against the manager.

With memory large enough that every request runs from step 0, a request of prompt P and output O
is sampled at lengths P, P+1, ..., P+O-1 (admitted at step 0, released in the step it completes),
so every policy's time-averaged waste has an exact formula over the drawn lengths.
"""

from __future__ import annotations

import math

import pytest

from pagedkv.sim.policies import PolicySpec
from pagedkv.sim.simulator import SimConfig, simulate
from pagedkv.sim.workload import Request, generate_workload
from pagedkv.workloads import WorkloadConfig, resolve_shape


def _requests(prompt: str, output: str, count: int, **kw: object) -> list[Request]:
    shape = resolve_shape("custom", prompt, output)
    return generate_workload(WorkloadConfig(shape, num_requests=count, seed=7, **kw))


def _run(reqs: list[Request], spec: PolicySpec, capacity: int, check: bool = True):
    config = SimConfig(capacity=capacity, max_model_len=2048, watermark=0.0, check_integrity=check)
    return simulate(reqs, spec, config)


def _lengths(reqs: list[Request]) -> list[int]:
    return [r.prompt_len + g for r in reqs for g in range(r.output_len)]


def test_contiguous_max_fixed_lengths() -> None:
    reqs = _requests("fixed:100", "fixed:50", 10)
    result = _run(reqs, PolicySpec("contiguous-max"), capacity=10 * 2048)
    assert result.waste == pytest.approx(1 - (100 + 49 / 2) / 2048)
    assert result.internal_frag == pytest.approx((2048 - 150) / 2048)
    assert result.peak_concurrency == 10 and result.preemptions == 0
    assert result.completed == 10 and result.steps == 51


def test_contiguous_waste_on_uniform_lengths() -> None:
    reqs = _requests("uniform:50-150", "uniform:20-80", 40)
    lengths = _lengths(reqs)
    result = _run(reqs, PolicySpec("contiguous-max"), capacity=40 * 2048)
    assert result.waste == pytest.approx(1 - sum(lengths) / (2048 * len(lengths)))
    oracle = _run(reqs, PolicySpec("contiguous-oracle"), capacity=40 * 2048)
    reserved = sum(r.final_len for r in reqs for _ in range(r.output_len))
    assert oracle.waste == pytest.approx(1 - sum(lengths) / reserved)
    assert oracle.internal_frag == 0.0


def test_buddy_rounding_waste() -> None:
    reqs = _requests("fixed:100", "fixed:29", 8)  # final 129 -> 256-slot chunks
    result = _run(reqs, PolicySpec("buddy"), capacity=8 * 256)
    assert result.internal_frag == pytest.approx((256 - 129) / 256)
    assert result.waste == pytest.approx(1 - (100 + 14) / 256)
    assert result.peak_concurrency == 8


@pytest.mark.parametrize("block_size", [1, 7, 16, 64])
def test_paged_waste_closed_form(block_size: int) -> None:
    reqs = _requests("uniform:20-400", "uniform:10-200", 30)
    lengths = _lengths(reqs)
    slots = [math.ceil(n / block_size) * block_size for n in lengths]
    # (block size 1 skips the per-step integrity walk over 16k blocks, for speed)
    result = _run(reqs, PolicySpec("paged", block_size), capacity=1 << 14, check=block_size > 1)
    assert result.waste == pytest.approx(1 - sum(lengths) / sum(slots))
    assert result.preemptions == 0


def test_paged_internal_waste_is_half_a_block_per_sequence() -> None:
    reqs = _requests("uniform:20-400", "uniform:50-300", 60)
    lengths = _lengths(reqs)
    B = 16
    result = _run(reqs, PolicySpec("paged", B), capacity=1 << 16)
    allocated = sum(math.ceil(n / B) * B for n in lengths)
    empty_per_seq = result.waste * allocated / len(lengths)
    assert empty_per_seq == pytest.approx((B - 1) / 2, abs=0.5)


def test_oracle_shows_external_fragmentation_paged_none() -> None:
    # A, B, C (final 30 each) fill 90 of 100 slots; A ends first, leaving holes of 30 + 10 that a
    # 35-slot request cannot use.
    reqs = [Request(0, list(range(1, 21)), 10), Request(1, list(range(21, 41)), 10),
            Request(2, list(range(41, 61)), 10), Request(3, list(range(61, 86)), 10)]
    reqs[0].output_len = 5
    reqs[0].prompt = list(range(1, 26))  # final 30, done after 5 steps
    oracle = _run(reqs, PolicySpec("contiguous-oracle"), capacity=100)
    assert oracle.external_frag > 0
    paged = _run(reqs, PolicySpec("paged", 5), capacity=100)
    assert paged.external_frag == 0


@pytest.mark.parametrize("spec", [PolicySpec("paged", 16), PolicySpec("paged", 8, prefix=True),
                                  PolicySpec("paged", 16, cow=True),
                                  PolicySpec("paged", 4, prefix=True, cow=True)])
def test_paged_usage_matches_manager_stats_every_step(spec: PolicySpec) -> None:
    """check_integrity=True makes the simulator compare its usage with KVCacheManager.stats()
    (allocated and filled slots), the live sequences and their tokens after every step, and run
    the manager's own check_integrity()."""
    shape = resolve_shape("alpaca")
    for extra in ({"n": 3}, {"beam_width": 3}, {"turns": 3, "prefix_len": 40, "num_prefixes": 2}):
        reqs = generate_workload(WorkloadConfig(shape, num_requests=40, seed=1, **extra))
        config = SimConfig(capacity=1200, max_model_len=2048, check_integrity=True,
                           beam_reshuffle=0.5)
        result = simulate(reqs, spec, config)
        assert result.completed + result.rejected == len(reqs)
        assert result.completed > 0
