"""One workload definition: the benchmarks' token workloads come from the shapes the simulator and
the sizing tool use, they still draw the requests the documented throughput figures were measured
on, and the workload module stays free of torch."""

from __future__ import annotations

import dataclasses
import math
import random
import subprocess
import sys

import pytest

from pagedkv.benchmark import VOCAB_LOW, build_workload
from pagedkv.workloads import BENCHMARK_CASES, NAMED_SHAPES, SHAREGPT, resolve_shape

VOCAB = 49152


def test_benchmark_sharegpt_is_the_simulator_shape() -> None:
    case = BENCHMARK_CASES["sharegpt"]
    assert case.shape is SHAREGPT is NAMED_SHAPES["sharegpt"]
    assert resolve_shape("sharegpt") == SHAREGPT  # what `pagedkv simulate` / `size` use
    # Replay the benchmark's random stream with the shape's own samplers: same lengths.
    for seed in (0, 3):
        rng = random.Random(f"sharegpt-{seed}")
        expected = []
        for _ in range(case.num_requests):
            n = SHAREGPT.prompt.sample(rng, case.max_model_len - 1)
            out = SHAREGPT.output.sample(rng, case.max_model_len - n)
            for _ in range(n):
                rng.randrange(VOCAB_LOW, VOCAB)
            expected.append((n, out))
        w = build_workload("sharegpt", VOCAB, seed)
        assert [(len(p), o) for p, o in zip(w.prompts, w.new_tokens)] == expected


def _old_definitions(vocab: int, seed: int) -> dict[str, tuple[list[list[int]], list[int]]]:
    """The benchmark workloads as first written (the README's throughput figures were measured on
    these): kept here verbatim so any change to the shared definitions that moves them fails."""
    def tokens(rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(VOCAB_LOW, vocab) for _ in range(n)]

    out = {}
    rng = random.Random(f"case_a-{seed}")
    out["case_a"] = ([tokens(rng, 128)], [128])
    rng = random.Random(f"case_b-{seed}")
    out["case_b"] = ([tokens(rng, rng.randint(32, 256)) for _ in range(32)], [128] * 32)
    rng = random.Random(f"case_c-{seed}")
    shared = tokens(rng, 512)
    out["case_c"] = ([shared + tokens(rng, 32) for _ in range(64)], [128] * 64)
    rng = random.Random(f"case_d-{seed}")  # added with issue 30: a 2,048-token shared prefix
    shared = tokens(rng, 2048)
    out["case_d"] = ([shared + tokens(rng, 32) for _ in range(32)], [128] * 32)
    rng = random.Random(f"sharegpt-{seed}")
    prompts, news = [], []
    for _ in range(64):
        n = int(min(max(4, rng.lognormvariate(math.log(100), 0.8)), 1000))
        new = rng.randint(64, 256)
        prompts.append(tokens(rng, min(n, 2048 - new)))
        news.append(new)
    out["sharegpt"] = (prompts, news)
    return out


@pytest.mark.parametrize("seed", [0, 1, 99])
def test_benchmark_workloads_are_the_documented_ones(seed: int) -> None:
    old = _old_definitions(VOCAB, seed)
    assert set(old) == set(BENCHMARK_CASES)
    for name, (prompts, news) in old.items():
        w = build_workload(name, VOCAB, seed)
        assert (w.name, w.prompts, w.new_tokens) == (name, prompts, news), name


def test_benchmark_refuses_what_a_run_cannot_realize() -> None:
    base = BENCHMARK_CASES["sharegpt"]
    for change in ({"n": 2}, {"rate": 0.5}, {"turns": 2}, {"num_prefixes": 2}, {"clients": 4}):
        with pytest.raises(ValueError, match="benchmark"):
            build_workload("x", VOCAB, config=dataclasses.replace(base, **change))
    small = build_workload("x", VOCAB, config=dataclasses.replace(base, num_requests=5, max_model_len=300))
    assert all(len(p) + o <= 300 for p, o in zip(small.prompts, small.new_tokens))


def test_workload_module_does_not_import_torch() -> None:
    code = ("import sys, pagedkv.workloads, pagedkv.sim.workload, pagedkv.benchmark; "
            "pagedkv.benchmark.build_workload('sharegpt', 1000); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]


def test_simulator_runs_a_benchmark_case(capsys: pytest.CaptureFixture[str]) -> None:
    """``pagedkv simulate --case case_d`` replays the benchmark's own definition: its requests,
    shared prefix and context length (2,080-token prompts need more than the default 2,048)."""
    import json

    from pagedkv.cli import main

    assert main(["simulate", "--case", "case_d", "--quiet", "--json", "--policies", "paged+prefix",
                 "--block-sizes", "16", "--kv-tokens", "12000"]) == 0
    out = json.loads(capsys.readouterr().out)
    case = BENCHMARK_CASES["case_d"]
    assert out["workload"]["num_requests"] == case.num_requests == 32
    assert out["workload"]["mean_prompt_len"] == case.prefix_len + 32
    assert out["max_model_len"] == case.max_model_len
    assert out["workload"]["trace"].startswith("case_d")
