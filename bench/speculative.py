"""Speculative decoding (n-gram proposer) against plain decoding, in the same run, on the default model.

Workloads (greedy; the same prompts for both engines):

- copy-heavy: chat prompts that ask to repeat, or lightly edit, a given passage: functions of
  this repository's own source and paragraphs of ``tests/data/declaration_of_independence.txt``
  (``--copy-tokens`` new tokens each, stopping at EOS like a real request). Batch 1 runs
  ``--b1-requests`` of them one after another; batch 8 runs 8 at once.
- case a (``BENCHMARKS.md``): one request of 128 random prompt tokens -> 128 tokens (ignore_eos),
  greedy, and sampled at temperature 1 (seeded; where proposals are often rejected: the back-off's
  test).

Two engines stay resident (speculation off and on, ``num_speculative_tokens`` = ``--k``); the
runs alternate off, on, off, on, .. ``--repeat`` times; each speedup is the median of the
per-repeat ratios (tokens/s on over off). Every greedy run checks that both engines emitted the
same tokens (greedy speculation is exact) and the last line says so (``outputs_equal``).

    .venv/bin/python bench/speculative.py [--repeat 3] [--k 6] [--threads 2]

Last line: one JSON object: ``copy_speedup_b1``, ``copy_speedup_b8``, ``case_a_speedup``,
``case_a_sampled_speedup`` (ratios),
``acceptance_rate`` (accepted / proposed tokens, copy-heavy, batch 1), tokens/s per run, the mean
tokens per verification, and the load average before and after.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import time
from pathlib import Path

from pagedkv import SamplingParams
from pagedkv.benchmark import build_workload
from pagedkv.engine import LLMEngine

ROOT = Path(__file__).resolve().parent.parent
EDITS = [
    "Repeat the following text exactly, without any comment:\n\n{}",
    "Rewrite the following code, renaming the variable `seq` to `sequence` everywhere. Output only the code:\n\n{}",
    "Copy this passage word for word:\n\n{}",
    "Repeat the following Python code exactly, without any comment:\n\n{}",
]


def passages(count: int) -> list[str]:
    """Functions of pagedkv's source (200..1500 characters) and paragraphs of the Declaration,
    interleaved, deterministic."""
    code = []
    for path in sorted((ROOT / "pagedkv" / "memory").glob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef):
                src = ast.get_source_segment(text, node) or ""
                if 200 <= len(src) <= 1500:
                    code.append(src)
    prose = [p.strip() for p in (ROOT / "tests" / "data" / "declaration_of_independence.txt").read_text().split("\n\n")
             if 300 <= len(p.strip()) <= 1500]
    out = []
    for i in range(count):
        out.append(code[(7 * i) % len(code)] if i % 2 == 0 else prose[i % len(prose)])
    return out


def copy_prompts(engine: LLMEngine, count: int) -> list[list[int]]:
    prompts = []
    for i, passage in enumerate(passages(count)):
        alternate = (i // 2) % 2  # code: repeat or rename; prose: repeat or copy
        task = EDITS[(3, 1)[alternate]] if i % 2 == 0 else EDITS[(0, 2)[alternate]]
        prompts.append(engine.tokenizer.encode_chat([{"role": "user", "content": task.format(passage)}]))
    return prompts


def run(engine: LLMEngine, batches: list[list[list[int]]], params: SamplingParams) -> tuple[float, list, tuple]:
    """Run each batch to completion (its requests at once); tokens/s over all, the outputs, and
    the speculation counters' change (drafts, proposed, accepted)."""
    before = engine.stats()
    outputs = []
    tokens = 0
    start = time.perf_counter()
    for b, batch in enumerate(batches):
        for i, prompt in enumerate(batch):
            engine.add_request(f"{b}.{i}", prompt, params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step(only_finished=True):
                done[out.request_id] = out.outputs[0].token_ids
        for i in range(len(batch)):
            outputs.append(done[f"{b}.{i}"])
            tokens += len(done[f"{b}.{i}"])
    elapsed = time.perf_counter() - start
    after = engine.stats()
    spec = (after.spec_num_drafts - before.spec_num_drafts, after.spec_draft_tokens - before.spec_draft_tokens,
            after.spec_accepted_tokens - before.spec_accepted_tokens)
    return tokens / elapsed, outputs, spec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model (default: the bundled default model)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--k", type=int, default=6, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=5)
    ap.add_argument("--b1-requests", type=int, default=4)
    ap.add_argument("--copy-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    common = dict(threads=args.threads, max_num_seqs=16)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max}
    engines = {"off": LLMEngine.from_options(args.model, **common),
               "on": LLMEngine.from_options(args.model, speculative_config=spec, **common)}
    prompts = copy_prompts(engines["off"], max(8, args.b1_requests))
    case_a = build_workload("case_a", engines["off"].runner.config.vocab_size)
    copy = SamplingParams(temperature=0, max_tokens=args.copy_tokens)
    workloads = {
        "copy_b1": ([[p] for p in prompts[:args.b1_requests]], copy),
        "copy_b8": ([prompts[:8]], copy),
        "case_a": ([case_a.prompts], SamplingParams(temperature=0, max_tokens=case_a.new_tokens[0], ignore_eos=True)),
        # the back-off's test: sampled at temperature 1, proposals are often rejected
        "case_a_sampled": ([case_a.prompts], SamplingParams(temperature=1.0, seed=1, max_tokens=case_a.new_tokens[0],
                                                             ignore_eos=True)),
    }
    # warm-up: every engine runs a short request with proposals once (kernels built, caches touched)
    for engine in engines.values():
        run(engine, [[prompts[0]]], SamplingParams(temperature=0, max_tokens=16))
    rates: dict[str, dict[str, list[float]]] = {w: {"off": [], "on": []} for w in workloads}
    ratios: dict[str, list[float]] = {w: [] for w in workloads}
    counters: dict[str, list[int]] = {w: [0, 0, 0] for w in workloads}
    equal = True
    for r in range(args.repeat):
        for name, (batches, params) in workloads.items():
            got = {}
            for mode in ("off", "on"):
                rate, outputs, c = run(engines[mode], batches, params)
                rates[name][mode].append(rate)
                got[mode] = outputs
                if mode == "on":
                    counters[name] = [a + b for a, b in zip(counters[name], c)]
            if params.temperature == 0:
                equal &= got["on"] == got["off"]
            ratios[name].append(rates[name]["on"][-1] / rates[name]["off"][-1])
            print(f"repeat {r} {name}: off {rates[name]['off'][-1]:.1f} tok/s, on {rates[name]['on'][-1]:.1f} "
                  f"tok/s, x{ratios[name][-1]:.2f}", flush=True)
    result: dict[str, object] = {}
    for name in workloads:
        drafts, proposed, accepted = counters[name]
        label = {"copy_b1": "copy_speedup_b1", "copy_b8": "copy_speedup_b8", "case_a": "case_a_speedup",
                 "case_a_sampled": "case_a_sampled_speedup"}[name]
        result[label] = round(statistics.median(ratios[name]), 3)
        result[f"{name}_off_tok_s"] = round(statistics.median(rates[name]["off"]), 2)
        result[f"{name}_on_tok_s"] = round(statistics.median(rates[name]["on"]), 2)
        result[f"{name}_acceptance_rate"] = round(accepted / proposed, 3) if proposed else 0.0
        result[f"{name}_tokens_per_verification"] = round(1 + accepted / drafts, 3) if drafts else 0.0
    result["acceptance_rate"] = result["copy_b1_acceptance_rate"]
    result.update(outputs_equal=equal, num_speculative_tokens=args.k, repeat=args.repeat,
                  threads=args.threads or 0, load_before=round(load_before, 2),
                  load_after=round(os.getloadavg()[0], 2))
    for engine in engines.values():
        engine.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
