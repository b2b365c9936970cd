"""The KV tiers under a device pool too small to keep a shared prefix between waves of requests.

Case c of ``../shared/BENCHMARKS.md`` (64 requests: one shared 512-token prefix + 32 distinct
tokens, 128 new tokens each, greedy, ``ignore_eos``) in ``--waves`` waves. Between two waves,
untimed filler prompts (distinct tokens, one new token each) fill the device pool, so the prefix
is evicted from it: the next wave finds it in a lower tier or recomputes it. Three engines, run
alternately (A B C A B C ...), each ``--repeat`` times:

- ``off``: no tier below the device (``kv_offloading_size=0``);
- ``host``: the host tier (``--host-gib``);
- ``host_disk``: the same host tier and a disk tier in a fresh directory (``--dir``).

Throughput counts the waves' output tokens over the waves' time (fillers excluded); TTFT is per
request, from its wave's submission. Then the restart: an engine on a directory a previous engine
closed (warm) against one on an empty directory (cold), alternately, timing the first wave only.

    .venv/bin/python bench/tiers.py [--repeat 2] [--threads 1] [--num-kv-blocks 224]

Last line: one JSON object with ``tiered_vs_off_throughput`` (host_disk tok/s / off tok/s, median
over repeats), ``host_vs_off_throughput``, ``restart_ttft_speedup`` (median first-wave TTFT cold /
warm), per-engine medians (``<engine>_tok_s``, ``<engine>_ttft_s``), the restart TTFTs, the
costs the host+disk engine measured (``measured_*``: prefill tokens/s, seconds per block of host
copies and disk reads), the settings and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pagedkv.benchmark import build_workload
from pagedkv.engine import LLMEngine
from pagedkv.sampling_params import SamplingParams


def make_engine(args, tier: str, kv_dir: Path | None) -> LLMEngine:
    options = dict(num_kv_blocks=args.num_kv_blocks, block_size=16, max_num_seqs=64,
                   max_num_batched_tokens=2048, threads=args.threads, preemption_mode="recompute")
    if tier == "off":
        options["kv_offloading_size"] = 0
    else:
        options["kv_offloading_size"] = args.host_gib
    if tier == "host_disk":
        options["kv_offload_dir"] = str(kv_dir)
    return LLMEngine.from_options(args.model, **options)


def run_wave(engine: LLMEngine, prompts: list[list[int]], new_tokens: list[int], tag: str) -> tuple[float, list[float]]:
    """Submit a wave at once and step it to the end: (seconds, each request's TTFT)."""
    start = time.perf_counter()
    first: dict[str, float] = {}
    for i, (prompt, n) in enumerate(zip(prompts, new_tokens)):
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    while engine.has_unfinished_requests():
        now_outputs = engine.step()
        now = time.perf_counter()
        for out in now_outputs:
            if out.request_id not in first and out.outputs and out.outputs[0].token_ids:
                first[out.request_id] = now - start
    return time.perf_counter() - start, [first[f"{tag}-{i}"] for i in range(len(prompts))]


def fill(engine: LLMEngine, args, rng: random.Random, vocab: int, tag: str) -> None:
    """Untimed: distinct prompts that take every device block, evicting the cached prefix."""
    tokens_needed = (args.num_kv_blocks + 16) * 16
    n = -(-tokens_needed // args.filler_len)
    for i in range(n):
        engine.add_request(f"{tag}-fill-{i}", [rng.randrange(1000, vocab) for _ in range(args.filler_len)],
                           SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step(only_finished=True)


def run_engine(args, tier: str, workload, vocab: int, kv_dir: Path | None) -> dict:
    engine = make_engine(args, tier, kv_dir)
    try:
        per_wave = -(-len(workload.prompts) // args.waves)
        rng = random.Random(1)
        seconds, tokens, ttfts = 0.0, 0, []
        for w in range(args.waves):
            if w:
                fill(engine, args, rng, vocab, f"w{w}")
            lo = w * per_wave
            prompts, outs = workload.prompts[lo:lo + per_wave], workload.new_tokens[lo:lo + per_wave]
            took, ttft = run_wave(engine, prompts, outs, f"w{w}")
            seconds += took
            tokens += sum(outs)
            ttfts += ttft
        stats = engine.stats()
        return {"tok_s": tokens / seconds, "ttft_s": statistics.median(ttfts), "seconds": seconds,
                "hit_tokens": stats.kv.tier_hit_tokens, "evictions": stats.kv.evictions,
                "costs": stats.tier_costs}
    finally:
        engine.close()


def first_wave_ttft(args, workload, kv_dir: Path, vocab: int) -> float:
    """Median TTFT of the first wave on a fresh engine over ``kv_dir``, after the same untimed
    warm-up for every engine (one unrelated prompt: first-step costs are not a tier's)."""
    engine = make_engine(args, "host_disk", kv_dir)
    try:
        rng = random.Random(99)
        engine.add_request("warm-up", [rng.randrange(1000, vocab) for _ in range(64)],
                           SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        per_wave = -(-len(workload.prompts) // args.waves)
        # 4 new tokens each: every request is still running when the last first token comes
        _, ttft = run_wave(engine, workload.prompts[:per_wave], [4] * per_wave, "restart")
        return statistics.median(ttft)
    finally:
        engine.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the bundled model)")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--waves", type=int, default=4)
    p.add_argument("--num-kv-blocks", type=int, default=224,
                   help="device blocks: one wave fits, the prefix does not survive a filler")
    p.add_argument("--host-gib", type=float, default=0.05, help="host tier size (GiB)")
    p.add_argument("--filler-len", type=int, default=900)
    p.add_argument("--requests", type=int, default=64, help="case c's 64, or fewer for a quick run")
    p.add_argument("--output-len", type=int, default=None, help="new tokens per request (case c: 128)")
    p.add_argument("--dir", default=None, help="where the disk tier directories go (default: a temp dir)")
    p.add_argument("--restart-only", action="store_true",
                   help="only the restart comparison (the warm directory is written by one first wave)")
    args = p.parse_args()

    root = Path(args.dir or tempfile.mkdtemp(prefix="pagedkv-tiers-"))
    root.mkdir(parents=True, exist_ok=True)
    probe = LLMEngine.from_options(args.model, num_kv_blocks=16, kv_offloading_size=0)
    vocab = probe.runner.config.vocab_size
    del probe
    workload = build_workload("case_c", vocab)
    prompts, outs = workload.prompts[:args.requests], workload.new_tokens[:args.requests]
    if args.output_len is not None:
        outs = [args.output_len] * len(prompts)
    workload = type(workload)(workload.name, prompts, outs)

    engines = ("off", "host", "host_disk")
    results: dict[str, list[dict]] = {e: [] for e in engines}
    if args.restart_only:
        warm_dir = root / f"run-{args.repeat - 1}"
        shutil.rmtree(warm_dir, ignore_errors=True)
        first_wave_ttft(args, workload, warm_dir, vocab)  # closes: the prefix reaches the directory
    for r in range(0 if args.restart_only else args.repeat):
        for tier in engines:
            kv_dir = root / f"run-{r}"
            shutil.rmtree(kv_dir, ignore_errors=True)
            res = run_engine(args, tier, workload, vocab, kv_dir)
            results[tier].append(res)
            print(f"repeat {r} {tier:9s} {res['tok_s']:7.1f} tok/s  median TTFT {res['ttft_s']:.3f} s  "
                  f"hits {res['hit_tokens']}  load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)

    warm_dir = root / f"run-{args.repeat - 1}"  # closed by the last host_disk engine: holds the prefix
    cold, warm = [], []
    for r in range(args.repeat):
        cold_dir = root / f"cold-{r}"
        shutil.rmtree(cold_dir, ignore_errors=True)
        cold.append(first_wave_ttft(args, workload, cold_dir, vocab))
        warm.append(first_wave_ttft(args, workload, warm_dir, vocab))
        print(f"restart {r}: first-wave median TTFT cold {cold[-1]:.3f} s, warm disk {warm[-1]:.3f} s",
              file=sys.stderr, flush=True)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)

    def med(tier: str, key: str) -> float:
        return statistics.median(x[key] for x in results[tier])

    out: dict = {"restart_ttft_speedup": round(statistics.median(c / w for c, w in zip(cold, warm)), 3)}
    if not args.restart_only:
        ratios = [h["tok_s"] / o["tok_s"] for h, o in zip(results["host_disk"], results["off"])]
        host_ratios = [h["tok_s"] / o["tok_s"] for h, o in zip(results["host"], results["off"])]
        out.update({
            "tiered_vs_off_throughput": round(statistics.median(ratios), 3),
            "host_vs_off_throughput": round(statistics.median(host_ratios), 3),
            **{f"{t}_tok_s": round(med(t, "tok_s"), 2) for t in engines},
            **{f"{t}_ttft_s": round(med(t, "ttft_s"), 4) for t in engines},
            **{f"measured_{k}": v for k, v in results["host_disk"][-1]["costs"].items()
               if k.endswith(("_s_per_block", "tokens_per_s")) and v is not None}})
    out.update({
        "restart_cold_ttft_s": round(statistics.median(cold), 4),
        "restart_warm_ttft_s": round(statistics.median(warm), 4),
        "requests": len(workload.prompts), "waves": args.waves, "num_kv_blocks": args.num_kv_blocks,
        "host_gib": args.host_gib, "repeat": args.repeat, "threads": args.threads,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    })
    print(json.dumps(out))


if __name__ == "__main__":
    main()
