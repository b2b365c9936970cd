"""Length distributions for simulated prompts and outputs (pure Python, seeded by the caller).

Each distribution draws integer lengths from a caller-owned ``random.Random`` so a whole workload is
reproducible from one seed. The named shapes are fitted to public datasets' published statistics:

- ``sharegpt``: log-normal, prompt median 100 tokens (sigma 1.0: mean ~165, p99 ~1,000), output
  median 200 (sigma 0.9: mean ~300, long tail past 1,500). ShareGPT in the vLLM paper: mean input 161,
  mean output 338.
- ``alpaca``: short instructions, log-normal prompt median 15 (mean ~18), output median 45 (mean ~60).
  Alpaca in the vLLM paper: mean input 19, mean output 58.
- ``uniform:LO-HI`` and ``fixed:N`` for closed-form checks.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LengthDist:
    """One integer length distribution. ``kind`` is ``lognormal``, ``uniform`` or ``fixed``.

    ``lognormal`` uses ``median`` and ``sigma`` (of the underlying normal); ``uniform`` draws from
    ``[low, high]`` inclusive; ``fixed`` always returns ``low``. Every draw is clipped to
    ``[1, cap]``.
    """

    kind: str
    low: int = 1
    high: int = 1
    median: float = 1.0
    sigma: float = 0.0

    def sample(self, rng: random.Random, cap: int) -> int:
        """Draw one length in ``[1, cap]``."""
        if self.kind == "fixed":
            value = self.low
        elif self.kind == "uniform":
            value = rng.randint(self.low, self.high)
        else:
            value = int(round(rng.lognormvariate(math.log(self.median), self.sigma)))
        return max(1, min(cap, value))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed {self.low}"
        if self.kind == "uniform":
            return f"uniform {self.low}-{self.high}"
        return f"lognormal median {self.median:g} sigma {self.sigma:g}"


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    """A prompt-length and an output-length distribution under one name."""

    name: str
    prompt: LengthDist
    output: LengthDist


SHAREGPT = WorkloadShape(
    "sharegpt",
    LengthDist("lognormal", median=100.0, sigma=1.0),
    LengthDist("lognormal", median=200.0, sigma=0.9),
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
