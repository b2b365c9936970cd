"""Workload generation: distributions, seeding, shared prefixes, chats, arrivals and trace files."""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path

import pytest

from pagedkv.sim.workload import generate_workload, load_trace, output_token, prefix_tokens
from pagedkv.workloads import ALPACA, SHAREGPT, WorkloadConfig, parse_length_dist, resolve_shape


def test_sharegpt_shape_median_and_tail() -> None:
    rng = random.Random(0)
    prompts = [SHAREGPT.prompt.sample(rng, 100_000) for _ in range(20000)]
    # The benchmark mix of BENCHMARKS.md: log-normal median 100, sigma 0.8, clipped to 4..1000.
    assert 90 <= statistics.median(prompts) <= 110
    assert 125 <= statistics.mean(prompts) <= 150
    assert 550 <= sorted(prompts)[int(0.99 * len(prompts))] <= 750  # p99 ~640
    assert min(prompts) >= 4 and max(prompts) == 1000  # the tail is clipped at 1,000
    outputs = [SHAREGPT.output.sample(rng, 100_000) for _ in range(20000)]
    assert min(outputs) == 64 and max(outputs) == 256
    assert 150 <= statistics.mean(outputs) <= 170
    alpaca = [ALPACA.prompt.sample(rng, 100_000) for _ in range(5000)]
    assert statistics.mean(alpaca) < 25


def test_parse_length_dist_and_errors() -> None:
    assert parse_length_dist("fixed:7", "--x").sample(random.Random(0), 100) == 7
    d = parse_length_dist("uniform:3-5", "--x")
    assert {d.sample(random.Random(i), 100) for i in range(50)} == {3, 4, 5}
    assert parse_length_dist("lognormal:100,0", "--x").sample(random.Random(0), 50) == 50  # capped
    for bad in ("fixed:0", "uniform:5-3", "lognormal:-1,1", "zipf:2", "fixed"):
        with pytest.raises(ValueError, match="--prompt-len"):
            parse_length_dist(bad, "--prompt-len")
    with pytest.raises(ValueError, match="--dataset"):
        resolve_shape("nope")


def test_seeded_and_reproducible() -> None:
    cfg = WorkloadConfig(SHAREGPT, num_requests=50, rate=0.5, seed=3)
    a, b = generate_workload(cfg), generate_workload(cfg)
    assert [(r.prompt, r.output_len, r.arrival_step) for r in a] == \
           [(r.prompt, r.output_len, r.arrival_step) for r in b]
    c = generate_workload(WorkloadConfig(SHAREGPT, num_requests=50, rate=0.5, seed=4))
    assert [r.output_len for r in a] != [r.output_len for r in c]


def test_lengths_respect_max_model_len_and_poisson_rate() -> None:
    reqs = generate_workload(WorkloadConfig(SHAREGPT, num_requests=2000, max_model_len=512,
                                            rate=0.25, seed=1))
    assert all(r.final_len <= 512 and r.output_len >= 1 for r in reqs)
    steps = reqs[-1].arrival_step
    assert 2000 / steps == pytest.approx(0.25, rel=0.1)
    assert all(x.arrival_step <= y.arrival_step for x, y in zip(reqs, reqs[1:]))


def test_shared_prefix_and_multi_turn_history() -> None:
    reqs = generate_workload(WorkloadConfig(ALPACA, num_requests=12, turns=3, prefix_len=32,
                                            num_prefixes=2, think_steps=5, seed=2))
    for r in reqs:
        assert r.prefix_id in (0, 1)
        assert r.prompt[:32] == prefix_tokens(r.prefix_id, 32)
    first, second = reqs[0], reqs[1]
    history = first.prompt + [output_token(first.req_id, i) for i in range(first.output_len)]
    assert second.prompt[:len(history)] == history
    assert (second.after, second.delay) == (first.req_id, 5)
    assert reqs[3].after is None  # turn 0 of the next chat


def test_parallel_samples_and_beams() -> None:
    reqs = generate_workload(WorkloadConfig(ALPACA, num_requests=3, n=4, seed=0))
    assert all(r.num_seqs == 4 for r in reqs)
    beams = generate_workload(WorkloadConfig(ALPACA, num_requests=3, n=2, beam_width=5, seed=0))
    assert all(r.num_seqs == 5 for r in beams)


def test_closed_loop_chains_clients() -> None:
    reqs = generate_workload(WorkloadConfig(ALPACA, num_requests=10, clients=3, seed=0))
    assert [r.after for r in reqs] == [None, None, None, 0, 1, 2, 3, 4, 5, 6]
    assert all(r.arrival_step == 0 for r in reqs)


def test_config_errors_name_the_flag() -> None:
    for kwargs, flag in (({"num_requests": 0}, "--num-requests"), ({"rate": 0}, "--rate"),
                         ({"prefix_len": 5000}, "--prefix-len"), ({"n": 0}, "--n")):
        with pytest.raises(ValueError, match=flag):
            generate_workload(WorkloadConfig(SHAREGPT, **kwargs))


def test_trace_file(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    path.write_text("prompt_len,output_len,n,beam_width,prefix_id\n"
                    "# a comment\n"
                    "100,20\n"
                    "50,10,2\n"
                    "\n"
                    "60,5,1,3,7\n"
                    "80,9000,1,1,7\n")
    cfg = WorkloadConfig(SHAREGPT, max_model_len=1024, prefix_len=40)
    reqs = load_trace(path, cfg)
    assert [(r.prompt_len, r.output_len, r.num_seqs) for r in reqs] == \
           [(100, 20, 1), (50, 10, 2), (60, 5, 3), (80, 944, 1)]
    assert reqs[2].prompt[:40] == reqs[3].prompt[:40] == prefix_tokens(7, 40)
    assert reqs[0].prompt[0] != reqs[1].prompt[0]
    assert all(r.arrival_step == 0 for r in reqs) and math.isinf(cfg.rate)


def test_trace_errors_give_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("10,5\n10,x\n")
    with pytest.raises(ValueError, match=r"bad.csv:2"):
        load_trace(path, WorkloadConfig(SHAREGPT))
    path.write_text("10,0\n")
    with pytest.raises(ValueError, match=r"bad.csv:1"):
        load_trace(path, WorkloadConfig(SHAREGPT))
