"""``pagedkv bench``: pagedkv's own throughput on one of the benchmark workloads.

For comparisons with transformers and vLLM in the same run, use ``bench/throughput.py``.
"""

from __future__ import annotations

import argparse
import json
import sys

from pagedkv.progress import interactive, phase


def add_bench_parser(subparsers) -> None:
    from pagedkv.engine.flags import add_engine_arguments
    from pagedkv.workloads import BENCHMARK_CASES

    p = subparsers.add_parser("bench", help="measure output throughput on a benchmark workload",
                              description=__doc__)
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: bundled model)")
    p.add_argument("--case", default="case_b", choices=list(BENCHMARK_CASES),
                   help="a workload of pagedkv.workloads.BENCHMARK_CASES")
    p.add_argument("--workload-seed", type=int, default=0)
    add_engine_arguments(p.add_argument_group("engine"))
    p.set_defaults(func=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from pagedkv.benchmark import build_workload, run_pagedkv
    from pagedkv.engine import EngineConfig, LLMEngine
    from pagedkv.engine.flags import engine_options
    from pagedkv.models.loader import resolve_model_path

    # One thread by default: on shared 2-core machines two-thread runs are erratic.
    options = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "threads": 1,
               **engine_options(args)}
    try:
        EngineConfig.from_options(args.model, **options)  # bad options and paths: one line, no phase
        resolve_model_path(args.model)
        with phase(f"bench: loading {args.model or 'the default model'}", done="loaded"):
            engine = LLMEngine.from_options(args.model, **options)
    except (ValueError, FileNotFoundError) as exc:
        print(f"pagedkv bench: {exc}", file=sys.stderr)
        return 2
    try:
        workload = build_workload(args.case, engine.runner.config.vocab_size, args.workload_seed)
        # A progress bar of output tokens on a terminal; the start and end lines everywhere.
        with phase(f"bench: running {workload.name}: {len(workload.prompts)} requests, "
                   f"{workload.output_tokens} output tokens", done="finished", ticker=False):
            r = run_pagedkv(engine, workload, progress=interactive())
    finally:
        engine.close()
    print(f"{workload.name}: {len(workload.prompts)} requests, {r.output_tokens} output tokens in "
          f"{r.seconds:.1f}s = {r.tok_s:.1f} tok/s; {r.steps} steps, peak {r.peak_used_blocks} "
          f"blocks, KV waste {r.kv_waste:.2%}, prefix hits {r.prefix_hit_rate:.1%}, "
          f"preemptions {r.preemptions}")
    print(json.dumps({"case": workload.name, "tok_s": round(r.tok_s, 2), "seconds": round(r.seconds, 2),
                      "kv_waste": round(r.kv_waste, 4), "peak_used_blocks": r.peak_used_blocks,
                      "threads": options["threads"]}))
    return 0
