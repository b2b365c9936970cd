"""bench/throughput.py's step profiles (decode steps, the steps before decoding): every part measured,
nothing of the engine changed."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from pagedkv.benchmark import build_workload, run_pagedkv
from pagedkv.workloads import BENCHMARK_CASES
from pagedkv_testing.tiny_model import write_tiny_model

BENCH = Path(__file__).resolve().parents[1] / "bench" / "throughput.py"


def _throughput() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_throughput", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_profile_measures_every_part_and_leaves_the_engine_as_it_was(tmp_path: Path) -> None:
    from pagedkv.engine import LLMEngine
    from pagedkv.runner import model_runner
    from pagedkv.sampling.sampler import SampleBatch

    bench = _throughput()
    engine = LLMEngine.from_options(str(write_tiny_model(tmp_path / "tiny")), max_num_seqs=8,
                                    kv_cache_memory="16MiB", threads=1)
    vocab = engine.runner.config.vocab_size
    small = dataclasses.replace(BENCHMARK_CASES["case_c"], num_requests=3, prefix_len=16, max_model_len=128)
    work = dataclasses.replace(build_workload("p", vocab, config=small), new_tokens=[6, 6, 6])
    before = run_pagedkv(engine, work)
    call, sample = model_runner._StepAttention.__call__, SampleBatch.sample

    prompts = bench.profile_prompts(engine, work)  # the steps before decoding, per prompt token computed
    assert list(prompts) == [*bench.PROFILE_PARTS[:-1], "steps", "prompt tokens"]  # (no native-layers total)
    # the shared prefix is computed once: the first prompt whole, the others past the prefix
    assert prompts["prompt tokens"] == sum(len(p) for p in work.prompts) - 2 * 16 and prompts["steps"] >= 1
    assert prompts["model: layer matmuls"] > 0 and prompts["total step"] >= prompts["model: layer matmuls"]
    assert not engine.has_unfinished_requests()
    profile = bench.profile_decode(engine, work, steps=3)

    assert list(profile) == list(bench.PROFILE_PARTS)
    measured = [p for p in bench.PROFILE_PARTS if not p.startswith(("model: other", "engine: rest", "total"))]
    assert all(profile[p] > 0 for p in measured), profile  # each timer saw its calls
    assert profile["total step"] >= profile["model: layer matmuls"] + profile["model: attention (cache write "
                                                                               "+ paged attention)"]
    assert profile["total step, native layers"] > 0
    # the timers are gone: methods are the classes' again, the native layers back, and the engine runs as before
    assert model_runner._StepAttention.__call__ is call and SampleBatch.sample is sample
    assert all(p is not None for p in engine.runner.model.native_layers)
    assert all("forward" not in vars(m) for m in engine.runner.model.modules())
    assert not engine.has_unfinished_requests()
    after = run_pagedkv(engine, work)
    assert after.output_tokens == before.output_tokens and after.steps == before.steps
    # the run's time split: the last 5 steps (6 new tokens, the first from the prompt's step) decode
    prefill, decode = bench.decode_split(work, after.step_times)
    assert decode == pytest.approx(sum(after.step_times[-5:]))
    assert prefill == pytest.approx(sum(after.step_times[:-5])) and prefill > 0
    with pytest.raises(SystemExit):  # an unknown case is refused by name, before any engine is built
        import sys
        argv, sys.argv = sys.argv, ["throughput.py", "--cases", "case_z"]
        try:
            bench.main()
        finally:
            sys.argv = argv


def test_arithmetic_counts_each_computed_token_once_and_a_shared_prefix_once(tmp_path: Path) -> None:
    from pagedkv.benchmark import Workload
    from pagedkv.models.loader import load_model

    bench = _throughput()
    c = load_model(str(write_tiny_model(tmp_path / "tiny"))).config
    weights = c.num_hidden_layers * (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
                                     + 3 * c.hidden_size * c.intermediate_size)
    per_pair = 4 * c.num_attention_heads * c.head_dim * c.num_hidden_layers

    # one request, 3 prompt tokens and 2 new ones: positions 0, 1, 2 (the prompt) and 3 (the first new
    # token, fed back to make the second) go through the layers; position p attends p + 1 keys
    one = bench.arithmetic(Workload("one", [[5, 6, 7]], [2]), c)
    assert one["layers"] == pytest.approx(2 * weights * 4 / 1e9)
    assert one["attention"] == pytest.approx(per_pair * (1 + 2 + 3 + 4) / 1e9)
    assert one["head"] == pytest.approx(2 * c.vocab_size * c.hidden_size * 2 / 1e9)
    assert one["total"] == pytest.approx(one["layers"] + one["attention"] + one["head"])

    # three requests sharing 4 tokens: the prefix's positions are computed once, each request's own
    # tokens and decode steps on top of it (enumerated here position by position)
    prompts = [[1, 2, 3, 4, 10 + i, 20 + i] for i in range(3)]
    new = [3, 1, 2]
    positions = list(range(4)) + [p for prompt, n in zip(prompts, new) for p in range(4, len(prompt) + n - 1)]
    shared = bench.arithmetic(Workload("shared", prompts, new), c)
    assert shared["layers"] == pytest.approx(2 * weights * len(positions) / 1e9)
    assert shared["attention"] == pytest.approx(per_pair * sum(p + 1 for p in positions) / 1e9)
    assert shared["head"] == pytest.approx(2 * c.vocab_size * c.hidden_size * sum(new) / 1e9)
