"""Memory-policy comparison scenarios for ``pagedkv simulate``, and the simulator's own speed.

Scenarios (seeded, same KV capacity for every policy within a scenario):

    sharegpt   500 ShareGPT-like requests, 65,536 slots: contiguous vs buddy vs paged@16
    samples    Alpaca-like, n=4, four shared 256-token system prompts, 32,768 slots:
               paged with and without prefix caching and copy-on-write
    beams      ShareGPT-like, beam width 4, 65,536 slots

Prints a table per scenario, the simulated decode tokens per wall-clock second, and, last, one
JSON line with every figure.

    .venv/bin/python bench/simulate.py [--num-requests 500] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from pagedkv.sim.policies import parse_policies
from pagedkv.sim.report import simulate_table
from pagedkv.sim.simulator import SimConfig, simulate
from pagedkv.sim.workload import generate_workload
from pagedkv.workloads import ALPACA, SHAREGPT, WorkloadConfig

SCENARIOS: dict[str, tuple[dict[str, Any], int, str]] = {  # workload options, capacity, policies
    "sharegpt": (dict(shape=SHAREGPT), 65536,
                 "contiguous-max,contiguous-oracle,buddy,paged@16"),
    "samples": (dict(shape=ALPACA, n=4, prefix_len=256, num_prefixes=4), 32768,
                "contiguous-oracle,paged@16,paged+prefix@16,paged+cow@16,paged+prefix+cow@16"),
    "beams": (dict(shape=SHAREGPT, beam_width=4), 65536,
              "contiguous-oracle,paged@16,paged+cow@16"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out: dict[str, object] = {}
    for name, (workload, capacity, policies) in SCENARIOS.items():
        reqs = generate_workload(WorkloadConfig(num_requests=args.num_requests, seed=args.seed,
                                                **workload))
        config = SimConfig(capacity=capacity, max_model_len=2048, seed=args.seed)
        results, tokens, seconds = [], 0, 0.0
        for spec in parse_policies(policies, (16,)):
            t0 = time.perf_counter()
            results.append(simulate(reqs, spec, config))
            if spec.kind == "paged":
                seconds += time.perf_counter() - t0
                tokens += sum(r.output_len * r.num_seqs for r in reqs)
        print(f"\n== {name}: {len(reqs)} requests, {capacity:,} KV slots")
        print(simulate_table(results))
        rate = tokens / seconds if seconds else 0.0
        print(f"simulated paged decode tokens per second: {rate:,.0f}")
        out[name] = {"policies": [r.as_dict() for r in results], "paged_tokens_per_s": rate}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
