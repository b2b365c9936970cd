"""Benchmark workloads as token ids, and pagedkv's own measurement of them.

The workloads are defined in ``pagedkv.workloads`` (``BENCHMARK_CASES``, see shared BENCHMARKS.md),
the same definitions the simulator uses; here each becomes a seeded list of (prompt token ids, new
tokens). ``run_pagedkv`` drives an ``LLMEngine`` step by step so it can also report KV waste
(fragmentation) and peak blocks used. ``pagedkv bench`` and ``bench/throughput.py`` (which adds the
transformers and vLLM baselines) both use this module.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

from pagedkv.sampling_params import SamplingParams
from pagedkv.workloads import BENCHMARK_CASES, WorkloadConfig

VOCAB_LOW = 100  # skip the special tokens at the start of the vocabulary


@dataclass(slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    new_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.new_tokens)


def build_workload(name: str, vocab: int, seed: int = 0, config: WorkloadConfig | None = None) -> Workload:
    """Token ids for the workload ``config`` (default: the benchmark case ``name``), seeded.

    Draws from a stream of its own per name, so no two workloads share prompt tokens by accident:
    the shared prefix first, then per request its prompt length, its output length and its prompt
    tokens (ids in ``[VOCAB_LOW, vocab)``). Only what a real run can realize is allowed: every
    request arrives at once with one sequence, and at most one shared prefix.
    """
    config = config or BENCHMARK_CASES[name]
    config.validate()
    if (config.rate != math.inf or config.clients or config.turns > 1 or config.num_prefixes > 1
            or config.n > 1 or config.beam_width > 1):
        raise ValueError(f"workload {name}: the benchmark runs single-turn requests that all arrive at "
                         f"once, one sequence each, with at most one shared prefix")
    rng = random.Random(f"{name}-{seed}")
    shared = _tokens(rng, config.prefix_len, vocab)
    prompts, outs = [], []
    for _ in range(config.num_requests):
        room = config.max_model_len - len(shared)
        n = config.shape.prompt.sample(rng, room - 1)
        outs.append(config.shape.output.sample(rng, room - n))
        prompts.append(shared + _tokens(rng, n, vocab))
    return Workload(name, prompts, outs)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, vocab) for _ in range(n)]


@dataclass(slots=True)
class RunResult:
    name: str
    seconds: float
    output_tokens: int
    steps: int
    peak_used_blocks: int = 0
    kv_waste: float = 0.0          # 1 - filled / allocated slots, summed over steps
    prefix_hit_rate: float = 0.0
    preemptions: int = 0
    step_times: list[float] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


def run_pagedkv(engine, workload: Workload, *, progress: bool = False) -> RunResult:
    """Run the workload to completion on ``engine`` (greedy, ignore_eos) and measure it.

    The prefix cache (device and host tier) is emptied first, so a workload run again
    (``--repeat``) hits only what it shares within itself, as it would on a fresh engine."""
    engine.reset_prefix_cache()
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.new_tokens)):
        engine.add_request(f"{workload.name}-{i}", prompt,
                           SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=workload.output_tokens, desc=workload.name, unit="tok", leave=False)
    kv0 = engine.stats()
    filled = allocated = peak = steps = 0
    times = []
    t0 = time.perf_counter()
    generated0 = kv0.generation_tokens_total
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        s = engine.stats()
        kv = s.kv
        filled += kv.filled_slots
        allocated += kv.allocated_slots
        peak = max(peak, kv.used_blocks)
        steps += 1
        if bar is not None:
            bar.n = s.generation_tokens_total - generated0
            bar.refresh()
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    end = engine.stats()
    # Stats are taken outside the timed steps' own clock but inside the wall time; they cost
    # well under 1% of a step.
    q = end.kv.prefix_query_tokens - kv0.kv.prefix_query_tokens
    hits = end.kv.prefix_hit_tokens - kv0.kv.prefix_hit_tokens
    return RunResult(workload.name, seconds, workload.output_tokens, steps, peak,
                     1.0 - filled / allocated if allocated else 0.0, hits / q if q else 0.0,
                     end.preemptions_recompute + end.preemptions_swap
                     - kv0.preemptions_recompute - kv0.preemptions_swap, times)
