"""The noisy-neighbour trace: a quiet tenant's prefix-cache hit rate alone, beside a noisy tenant's
bursts of long prompts without quotas, and with a quota on the noisy tenant.

The quiet tenant sends short questions after a shared system prompt (a chat product); the noisy
tenant sends bursts of long distinct prompts (a batch job) in the same rounds. Each round queues
both at once and runs the engine until they finish. Hit rates are fractions of prompt tokens
served from the device prefix cache (the host tier is off, ``kv_offloading_size=0``, so an
evicted block is a miss). The engine runs the real default model (or ``--model``); token ids are
random, the same in every configuration.

    .venv/bin/python bench/tenancy.py [--rounds 6] [--noisy-quota 0.5] [--num-kv-blocks 160]

Last line: one JSON object (rates 0..1, ratios, times in seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from pagedkv import SamplingParams
from pagedkv.engine import LLMEngine


def trace(args: argparse.Namespace, vocab: int) -> list[list[tuple[str, str, list[int]]]]:
    """Rounds of ``(request id, tenant, prompt)``: the quiet tenant's questions after its system
    prompt, then the noisy tenant's long prompts."""
    rng = random.Random(args.seed)
    system = [rng.randrange(10, vocab) for _ in range(args.system_tokens)]
    rounds = []
    for r in range(args.rounds):
        batch = [(f"q{r}.{i}", "quiet", system + [rng.randrange(10, vocab) for _ in range(args.question_tokens)])
                 for i in range(args.quiet_per_round)]
        batch += [(f"n{r}.{i}", "noisy", [rng.randrange(10, vocab) for _ in range(args.noisy_tokens)])
                  for i in range(args.noisy_per_round)]
        rounds.append(batch)
    return rounds


def run(args: argparse.Namespace, rounds, *, noisy: bool, quota: float | None) -> dict[str, float]:
    options = dict(num_kv_blocks=args.num_kv_blocks, block_size=16, kv_offloading_size=0,
                   max_num_batched_tokens=args.max_num_batched_tokens, threads=args.threads)
    if quota is not None:
        options["tenant_kv_quota"] = [f"noisy={quota}"]
    engine = LLMEngine.from_options(args.model, **options)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompt_tokens = {"quiet": 0, "noisy": 0}
    hit_tokens = {"quiet": 0, "noisy": 0}
    latency: dict[str, list[float]] = {"quiet": [], "noisy": []}
    start = time.perf_counter()
    for r, batch in enumerate(rounds):
        tenant_of = {}
        for rid, tenant, prompt in batch:
            if tenant == "noisy" and not noisy:
                continue
            engine.add_request(rid, prompt, params, tenant=tenant)
            tenant_of[rid] = tenant
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tenant = tenant_of[out.request_id]
                    latency[tenant].append(time.perf_counter() - t0)
                    if r > 0:  # round 0 warms the cache up
                        prompt_tokens[tenant] += len(out.prompt_token_ids)
                        hit_tokens[tenant] += out.num_cached_tokens
    stats = engine.stats()
    engine.close()
    assert stats.kv.used_blocks == 0
    return {
        "quiet_hit_rate": hit_tokens["quiet"] / max(prompt_tokens["quiet"], 1),
        "noisy_hit_rate": hit_tokens["noisy"] / max(prompt_tokens["noisy"], 1),
        "quiet_latency_s": statistics.median(latency["quiet"]),
        "noisy_latency_s": statistics.median(latency["noisy"]) if latency["noisy"] else 0.0,
        "quota_waits": sum(stats.kv.tenant_quota_waits.values()),
        "preemptions": stats.preemptions_recompute + stats.preemptions_swap,
        "wall_s": time.perf_counter() - start,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model (default: the bundled default model)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--system-tokens", type=int, default=384)
    ap.add_argument("--question-tokens", type=int, default=24)
    ap.add_argument("--quiet-per-round", type=int, default=2)
    ap.add_argument("--noisy-tokens", type=int, default=640)
    ap.add_argument("--noisy-per-round", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--num-kv-blocks", type=int, default=160, help="device KV pool (16-token blocks)")
    ap.add_argument("--noisy-quota", type=float, default=0.5, help="the noisy tenant's --tenant-kv-quota")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    vocab = 49152
    rounds = trace(args, vocab)
    warm = argparse.Namespace(**{**vars(args), "rounds": 1})  # first-use costs (kernels, threads) outside
    run(warm, trace(warm, vocab), noisy=False, quota=None)
    load = os.getloadavg()[0]
    results = {}
    for name, noisy, quota in (("alone", False, None), ("noisy_no_quota", True, None),
                               ("noisy_quota", True, args.noisy_quota)):
        results[name] = res = run(args, rounds, noisy=noisy, quota=quota)
        print(f"{name:<15} quiet hit rate {res['quiet_hit_rate']:.3f}  noisy hit rate {res['noisy_hit_rate']:.3f}  "
              f"quiet latency {res['quiet_latency_s']:.2f}s  noisy latency {res['noisy_latency_s']:.2f}s  "
              f"quota waits {res['quota_waits']}  preemptions {res['preemptions']}  ({res['wall_s']:.1f}s)",
              flush=True)
    alone = results["alone"]["quiet_hit_rate"]
    print(json.dumps({
        "quiet_hit_rate_alone": round(alone, 4),
        "quiet_hit_rate_noisy_no_quota": round(results["noisy_no_quota"]["quiet_hit_rate"], 4),
        "quiet_hit_rate_noisy_quota": round(results["noisy_quota"]["quiet_hit_rate"], 4),
        "quota_keeps_fraction_of_alone": round(results["noisy_quota"]["quiet_hit_rate"] / alone, 4) if alone else 0.0,
        "noisy_hit_rate_no_quota": round(results["noisy_no_quota"]["noisy_hit_rate"], 4),
        "noisy_hit_rate_quota": round(results["noisy_quota"]["noisy_hit_rate"], 4),
        "quiet_latency_s_noisy_no_quota": round(results["noisy_no_quota"]["quiet_latency_s"], 3),
        "quiet_latency_s_noisy_quota": round(results["noisy_quota"]["quiet_latency_s"], 3),
        "noisy_latency_s_no_quota": round(results["noisy_no_quota"]["noisy_latency_s"], 3),
        "noisy_latency_s_quota": round(results["noisy_quota"]["noisy_latency_s"], 3),
        "noisy_quota": args.noisy_quota, "num_kv_blocks": args.num_kv_blocks, "load": round(load, 2),
    }))


if __name__ == "__main__":
    main()
