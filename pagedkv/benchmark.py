"""Benchmark workloads (see shared BENCHMARKS.md) and pagedkv's own measurement of them.

Each workload is a seeded list of (prompt token ids, new tokens). ``run_pagedkv`` drives an
``LLMEngine`` step by step so it can also report KV waste (fragmentation) and peak blocks used.
``pagedkv bench`` and ``bench/throughput.py`` (which adds the transformers and vLLM baselines)
both use this module.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

from pagedkv.sampling_params import SamplingParams

VOCAB_LOW = 100  # skip the special tokens at the start of the vocabulary


@dataclass(slots=True)
class Workload:
    name: str
    prompts: list[list[int]]
    new_tokens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.new_tokens)


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, vocab) for _ in range(n)]


def _rng(name: str, seed: int) -> random.Random:
    """Each workload draws from its own stream, so no two share prompt tokens by accident."""
    return random.Random(f"{name}-{seed}")


def case_a(vocab: int, seed: int = 0) -> Workload:
    rng = _rng("case_a", seed)
    return Workload("case_a", [_tokens(rng, 128, vocab)], [128])


def case_b(vocab: int, seed: int = 0) -> Workload:
    rng = _rng("case_b", seed)
    prompts = [_tokens(rng, rng.randint(32, 256), vocab) for _ in range(32)]
    return Workload("case_b", prompts, [128] * 32)


def case_c(vocab: int, seed: int = 0) -> Workload:
    rng = _rng("case_c", seed)
    shared = _tokens(rng, 512, vocab)
    return Workload("case_c", [shared + _tokens(rng, 32, vocab) for _ in range(64)], [128] * 64)


def sharegpt_like(vocab: int, seed: int = 0, num_requests: int = 64, max_len: int = 2048) -> Workload:
    """Log-normal prompt lengths (median ~100, tail to ~1,000), outputs uniform in 64..256."""
    rng = _rng("sharegpt", seed)
    prompts, outs = [], []
    for _ in range(num_requests):
        n = int(min(max(4, rng.lognormvariate(math.log(100), 0.8)), 1000))
        out = rng.randint(64, 256)
        n = min(n, max_len - out)
        prompts.append(_tokens(rng, n, vocab))
        outs.append(out)
    return Workload("sharegpt", prompts, outs)


WORKLOADS = {"case_a": case_a, "case_b": case_b, "case_c": case_c, "sharegpt": sharegpt_like}


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
    """Run the workload to completion on ``engine`` (greedy, ignore_eos) and measure it."""
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
