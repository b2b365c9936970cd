"""Block resizing under simulation (sim/resizing.py): the slots and copies of merge-on-fragmentation
and the variable-size tail block, by hand, and whole runs with the integrity check on."""

from __future__ import annotations

import pytest

from pagedkv.sim.memory_policy import SimSeq
from pagedkv.sim.policies import PolicySpec, parse_policies
from pagedkv.sim.resizing import ResizingPolicy
from pagedkv.sim.simulator import SimConfig, simulate
from pagedkv.sim.workload import WorkloadConfig, generate_workload
from pagedkv.workloads import SHAREGPT


def _seq(seq_id: int, n: int) -> SimSeq:
    return SimSeq(seq_id, list(range(n)), stream=seq_id, final_len=10_000)


def _grow_to(policy: ResizingPolicy, seq: SimSeq, n: int) -> None:
    while len(seq.tokens) < n:
        seq.tokens.append(0)
        assert policy.grow(seq)
        policy.check_integrity()


def test_variable_tail_holds_the_smallest_power_of_two_and_copies_it_up() -> None:
    policy = ResizingPolicy("vtail@16-64", "vtail", 4096, 16, 64, watermark=0.0)
    seq = _seq(1, 70)
    assert policy.admit(None, [seq])  # type: ignore[arg-type]  # the request is not read
    assert policy.held[1] == 64 + 16 and policy.copies == 0  # a prompt is written in place
    _grow_to(policy, seq, 90)  # tail 26 tokens: 16 -> 32, its 16 tokens copied
    assert policy.held[1] == 64 + 32 and policy.copies == 16
    _grow_to(policy, seq, 128)  # 32 -> 64 at 33 tokens (32 copied); full at 64, no copy
    assert policy.held[1] == 128 and policy.copies == 48
    _grow_to(policy, seq, 129)  # a new 16-slot tail
    assert policy.held[1] == 144 and policy.copies == 48
    assert policy.attended == sum(range(71, 130))


def test_merge_splits_underused_tails_past_10_percent_and_merges_them_back() -> None:
    policy = ResizingPolicy("merge@16-64", "merge", 4096, 16, 64, watermark=0.0)
    seq = _seq(1, 9)
    # The policy reads only the sequences here, not the manager: None stands in for it.
    assert policy.admit(None, [seq])  # type: ignore[arg-type]
    assert policy.held[1] == 64  # 55 of 64 slots empty
    _grow_to(policy, seq, 10)  # the defragmenter runs: 10 tokens copied into one 16-block
    assert policy.held[1] == 16 and policy.copies == 10 and policy.defrag_runs == 1
    _grow_to(policy, seq, 17)
    assert policy.held[1] == 32
    _grow_to(policy, seq, 64)  # four 16-blocks full: merged (64 copied) into one 64-block
    assert policy.held[1] == 64 and policy.copies == 10 + 64
    _grow_to(policy, seq, 65)  # a fresh 64-block, split again (1 token) as waste passes 10%
    assert policy.held[1] == 80 and policy.copies == 10 + 64 + 1
    policy.release([seq])
    assert policy.used == 0 and policy.filled == 0


def test_resizing_policy_names_and_refusals() -> None:
    specs = parse_policies("merge,vtail@8-64,paged@16", (16,))
    assert [s.name for s in specs] == ["merge@16-64", "vtail@8-64", "paged@16"]
    assert specs[1] == PolicySpec("vtail", 64, small=8)
    with pytest.raises(ValueError, match="merge@G-L with 1 <= G < L"):
        parse_policies("merge@64-16", (16,))
    with pytest.raises(ValueError, match="L must be G times a power of two"):
        ResizingPolicy("vtail@12-64", "vtail", 4096, 12, 64)


def test_resizing_runs_hold_their_accounts_and_sit_between_the_fixed_sizes() -> None:
    requests = generate_workload(WorkloadConfig(shape=SHAREGPT, num_requests=120, max_model_len=2048, seed=3))
    config = SimConfig(capacity=12288, max_model_len=2048, check_integrity=True)
    results = {spec.name: simulate(requests, spec, config)
               for spec in parse_policies("paged@16,paged@64,merge@16-64,vtail@16-64", (16,))}
    small, large = results["paged@16"], results["paged@64"]
    for name in ("merge@16-64", "vtail@16-64"):
        resized = results[name]
        assert resized.completed == len(requests)
        assert small.waste < resized.waste < large.waste, name
        assert resized.resize_copies > 0 and resized.copy_cost is not None and 0 < resized.copy_cost < 0.05
        assert resized.net_concurrency is not None and resized.saturated_concurrency is not None
        assert resized.net_concurrency < resized.saturated_concurrency
        assert resized.as_dict()["net_concurrency"] == resized.net_concurrency
