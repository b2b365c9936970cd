"""Named workloads: the one definition of every workload the benchmarks and the simulator run.

Pure Python (no torch): the simulator (``pagedkv simulate``), the sizing tool (``pagedkv size``)
and the benchmarks (``pagedkv bench``, ``bench/throughput.py``) all read their workloads here, so
"sharegpt" means the same requests everywhere. A workload is a ``WorkloadShape`` (prompt and
output length distributions) plus a ``WorkloadConfig`` (number of requests, shared prefix,
arrivals, samples and beams, seed). Each consumer turns it into requests its own way: token ids
for a real model (``pagedkv.benchmark``) or synthetic ids for the simulator (``pagedkv.sim.workload``).

Length shapes (``NAMED_SHAPES``, ``--dataset``):

- ``sharegpt``: a realistic chat mix, the benchmark workload of the shared BENCHMARKS.md. Prompts
  log-normal with median 100 tokens and sigma 0.8, clipped to 4..1,000 (mean ~136, p99 ~640);
  outputs uniform 64..256 (mean 160). Lighter than ShareGPT as the vLLM paper measured it (mean
  input 161, mean output 338); ``--prompt-len lognormal:100,1.0 --output-len lognormal:200,0.9``
  gives that heavier fit.
- ``alpaca``: short instructions, log-normal prompt median 15 (mean ~18), output median 45 (mean
  ~60). Alpaca in the vLLM paper: mean input 19, mean output 58.
- ``uniform:LO-HI``, ``fixed:N`` and ``lognormal:MEDIAN,SIGMA`` for custom and closed-form checks.

Benchmark cases (``BENCHMARK_CASES``, all requests at once, see BENCHMARKS.md): ``case_a`` 1 x 128
-> 128, ``case_b`` 32 x uniform 32..256 -> 128, ``case_c`` 64 x (one shared 512-token prefix + 32)
-> 128, ``case_d`` 32 x (one shared 2,048-token prefix + 32) -> 128, and ``sharegpt``: 64 requests
of the shape above. Every prompt token is a seeded random id (``pagedkv.benchmark``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LengthDist:
    """One integer length distribution. ``kind`` is ``lognormal``, ``uniform`` or ``fixed``.

    ``fixed`` always returns ``low``; ``uniform`` draws from ``[low, high]`` inclusive;
    ``lognormal`` draws ``median * exp(sigma * N(0, 1))``, truncated to an integer and clipped to
    ``[low, high]`` (``high`` None: no upper clip). Every draw is then clipped to ``[1, cap]``.
    ``fixed`` draws nothing from the caller's ``random.Random``; the others draw one variate.
    """

    kind: str
    low: int = 1
    high: int | None = None
    median: float = 1.0
    sigma: float = 0.0

    def sample(self, rng: random.Random, cap: int) -> int:
        """Draw one length in ``[1, cap]``."""
        if self.kind == "fixed":
            value = self.low
        elif self.kind == "uniform":
            assert self.high is not None
            value = rng.randint(self.low, self.high)
        else:
            value = max(self.low, int(rng.lognormvariate(math.log(self.median), self.sigma)))
            if self.high is not None:
                value = min(self.high, value)
        return max(1, min(cap, value))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed {self.low}"
        if self.kind == "uniform":
            return f"uniform {self.low}-{self.high}"
        clip = f" clipped {self.low}-{self.high}" if self.high is not None else ""
        return f"lognormal median {self.median:g} sigma {self.sigma:g}{clip}"


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    """A prompt-length and an output-length distribution under one name."""

    name: str
    prompt: LengthDist
    output: LengthDist


SHAREGPT = WorkloadShape(
    "sharegpt",
    LengthDist("lognormal", low=4, high=1000, median=100.0, sigma=0.8),
    LengthDist("uniform", low=64, high=256),
)
ALPACA = WorkloadShape(
    "alpaca",
    LengthDist("lognormal", median=15.0, sigma=0.6),
    LengthDist("lognormal", median=45.0, sigma=0.75),
)
NAMED_SHAPES: dict[str, WorkloadShape] = {"sharegpt": SHAREGPT, "alpaca": ALPACA}


def parse_length_dist(text: str, flag: str) -> LengthDist:
    """Parse ``fixed:N``, ``uniform:LO-HI`` or ``lognormal:MEDIAN,SIGMA``.

    Raises ``ValueError`` naming ``flag`` on anything else.
    """
    kind, _, arg = text.partition(":")
    try:
        if kind == "fixed":
            n = int(arg)
            if n < 1:
                raise ValueError
            return LengthDist("fixed", low=n, high=n)
        if kind == "uniform":
            lo_text, _, hi_text = arg.partition("-")
            lo, hi = int(lo_text), int(hi_text)
            if not 1 <= lo <= hi:
                raise ValueError
            return LengthDist("uniform", low=lo, high=hi)
        if kind == "lognormal":
            median_text, _, sigma_text = arg.partition(",")
            median, sigma = float(median_text), float(sigma_text)
            if median <= 0 or sigma < 0:
                raise ValueError
            return LengthDist("lognormal", median=median, sigma=sigma)
    except ValueError:
        pass
    raise ValueError(
        f"{flag}: expected fixed:N (N >= 1), uniform:LO-HI (1 <= LO <= HI) or "
        f"lognormal:MEDIAN,SIGMA (MEDIAN > 0, SIGMA >= 0), got {text!r}"
    )


def resolve_shape(name: str, prompt: str | None = None, output: str | None = None) -> WorkloadShape:
    """The named shape (``sharegpt``/``alpaca``), or ``custom`` built from ``prompt``/``output`` specs.

    A named shape's prompt or output distribution can be overridden one at a time.
    """
    if name in NAMED_SHAPES:
        base = NAMED_SHAPES[name]
    elif name == "custom":
        if prompt is None or output is None:
            raise ValueError("--dataset custom needs both --prompt-len and --output-len")
        base = WorkloadShape("custom", LengthDist("fixed"), LengthDist("fixed"))
    else:
        allowed = ", ".join([*NAMED_SHAPES, "custom"])
        raise ValueError(f"--dataset: expected one of {allowed}, got {name!r}")
    prompt_dist = parse_length_dist(prompt, "--prompt-len") if prompt else base.prompt
    output_dist = parse_length_dist(output, "--output-len") if output else base.output
    return WorkloadShape(base.name, prompt_dist, output_dist)


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """A whole workload: its shape, how many requests, how they share and how they arrive.

    Validated by ``validate()`` (``ValueError`` names the flag). ``rate`` is in requests per
    simulated step (``math.inf``: all arrive at step 0); ``clients`` > 0 switches to a closed loop
    of that many clients with ``think_steps`` between a completion and the client's next request.
    ``turns`` > 1 makes multi-turn chats whose turns arrive ``think_steps`` after the previous turn
    completes. ``prefix_len`` > 0 gives every conversation one of ``num_prefixes`` shared system
    prompts of that many tokens, before the prompt drawn from ``shape``.
    """

    shape: WorkloadShape
    num_requests: int = 500
    max_model_len: int = 2048
    rate: float = math.inf
    clients: int = 0
    think_steps: int = 0
    turns: int = 1
    prefix_len: int = 0
    num_prefixes: int = 1
    n: int = 1
    beam_width: int = 1
    seed: int = 0

    def validate(self) -> None:
        checks = [
            (self.num_requests >= 1, "--num-requests", ">= 1", self.num_requests),
            (self.max_model_len >= 2, "--max-model-len", ">= 2", self.max_model_len),
            (self.rate > 0, "--rate", "> 0 (inf: all at once)", self.rate),
            (self.clients >= 0, "--clients", ">= 0", self.clients),
            (self.think_steps >= 0, "--think-steps", ">= 0", self.think_steps),
            (self.turns >= 1, "--turns", ">= 1", self.turns),
            (0 <= self.prefix_len < self.max_model_len - 1, "--prefix-len",
             f"0 .. {self.max_model_len - 2}", self.prefix_len),
            (self.num_prefixes >= 1, "--num-prefixes", ">= 1", self.num_prefixes),
            (self.n >= 1, "--n", ">= 1", self.n),
            (self.beam_width >= 1, "--beam-width", ">= 1", self.beam_width),
        ]
        for ok, flag, allowed, value in checks:
            if not ok:
                raise ValueError(f"{flag}: must be {allowed}, got {value}")


def _fixed(n: int) -> LengthDist:
    return LengthDist("fixed", low=n, high=n)


BENCHMARK_CASES: dict[str, WorkloadConfig] = {
    "case_a": WorkloadConfig(WorkloadShape("case_a", _fixed(128), _fixed(128)), num_requests=1),
    "case_b": WorkloadConfig(WorkloadShape("case_b", LengthDist("uniform", low=32, high=256), _fixed(128)),
                             num_requests=32),
    "case_c": WorkloadConfig(WorkloadShape("case_c", _fixed(32), _fixed(128)), num_requests=64,
                             prefix_len=512),
    # a long shared context (agents, RAG, long system prompts): 2,080-token prompts + 128 new
    # tokens exceed the default 2,048, hence its own max_model_len
    "case_d": WorkloadConfig(WorkloadShape("case_d", _fixed(32), _fixed(128)), num_requests=32,
                             prefix_len=2048, max_model_len=4096),
    "sharegpt": WorkloadConfig(SHAREGPT, num_requests=64),
}
