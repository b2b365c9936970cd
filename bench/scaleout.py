"""Two replicas behind the SMG router: cache-aware routing against round robin, on prefix families.

Case c's shape, per family: ``--families`` prefixes of ``--prefix-tokens`` random tokens (sent
as their text: the router takes text),
each followed by ``--requests-per-family`` requests of their own ``--suffix-tokens`` -> ``--new-tokens``
(greedy, ignore_eos), shuffled, sent by ``--concurrency`` clients through the router. Two
replicas of ``pagedkv serve`` (default model, one thread each, no host tier) have KV pools sized
to hold their share of the families' prefixes (families / replicas of them) and little more, so a
family spread over both replicas costs hits. The policies alternate (cache_aware, round_robin,
..) ``--repeat`` times with fresh families each run; the replicas and their caches stay up.

Hit rate: prompt tokens served from the replicas' prefix caches over prompt tokens, from their
``/metrics``. Throughput: output tokens over the run's wall time.

    .venv/bin/python bench/scaleout.py [--repeat 2] [--families 2] [--requests-per-family 12]

With more families than replicas SMG may place them unevenly (4 families: 3 on one replica in
our runs), and the busier replica then bounds the throughput.

Last line: one JSON object: ``hit_rate_cache_aware``, ``hit_rate_round_robin``, ``hit_rate_ratio``,
``throughput_cache_aware`` / ``_round_robin`` (tok/s), ``throughput_ratio`` (cache_aware over
round_robin, median of per-repeat ratios), the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from typing import Any

import httpx

from pagedkv_testing.cluster import Cluster  # pagedkv_testing/cluster.py: replicas + router on loopback

BLOCK = 16


def workload(seed: int, args: argparse.Namespace, tokenizer) -> list[str]:
    """Text prompts (the router takes text or lists of texts, not token ids): random token ids
    decoded, a prefix per family and a suffix per request."""
    rng = random.Random(seed)

    def text(n: int) -> str:
        return tokenizer.decode([rng.randrange(100, tokenizer.vocab_size) for _ in range(n)])

    prompts = []
    for _ in range(args.families):
        prefix = text(args.prefix_tokens)
        prompts += [prefix + text(args.suffix_tokens) for _ in range(args.requests_per_family)]
    rng.shuffle(prompts)
    return prompts


def run(cluster: Cluster, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    before = [cluster.metrics(i) for i in range(cluster.n)]
    todo = list(enumerate(prompts))
    lock = threading.Lock()
    tokens = [0]
    errors: list[str] = []

    def client() -> None:
        with httpx.Client(timeout=600) as http:
            while True:
                with lock:
                    if not todo:
                        return
                    _, prompt = todo.pop(0)
                r = http.post(cluster.router_url + "/v1/completions",
                              json={"model": "m", "prompt": prompt, "max_tokens": args.new_tokens,
                                    "temperature": 0, "ignore_eos": True})
                if r.status_code != 200:
                    errors.append(r.text[:200])
                    continue
                with lock:
                    tokens[0] += r.json()["usage"]["completion_tokens"]

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    after = [cluster.metrics(i) for i in range(cluster.n)]

    def delta(name: str) -> float:
        return sum(a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before))

    count = "pagedkv_request_prompt_tokens_count"  # (a series appears with a replica's first request)
    served = [int(a.get(count, 0.0) - b.get(count, 0.0)) for a, b in zip(after, before)]
    return {"hit_rate": delta("pagedkv_prefix_cache_hits_total") / delta("pagedkv_prefix_cache_queries_total"),
            "throughput": tokens[0] / elapsed, "seconds": elapsed, "requests_per_replica": served}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--families", type=int, default=2)
    ap.add_argument("--requests-per-family", type=int, default=12)
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--suffix-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    replicas = 2
    share = -(-args.families // replicas)  # families per replica under cache-aware routing
    per_family = -(-(args.prefix_tokens + args.suffix_tokens + args.new_tokens) // BLOCK)
    blocks = share * per_family + 4 * args.concurrency  # + the requests' own blocks
    replica_args = ["--num-kv-blocks", str(blocks), "--block-size", str(BLOCK), "--kv-offloading-size", "0",
                    "--threads", "1", "--max-num-seqs", "8"]
    print(f"2 replicas, {blocks} KV blocks each ({share} families of {per_family} blocks + "
          f"{4 * args.concurrency})", flush=True)
    from pagedkv.models.loader import load_tokenizer, resolve_model_path
    tokenizer = load_tokenizer(resolve_model_path(None if args.model == "default" else args.model)[0])
    results: dict[str, list[dict[str, float]]] = {"cache_aware": [], "round_robin": []}
    # Two of SMG's safeguards are off. Its warm-up slice (for 60 s after a worker joins, a share of
    # cache misses goes to it): every run starts a router of its own, and the slice would scatter
    # the new families. Its overload veto (no request to a worker above 80% KV usage): pools this
    # small pass 80% whenever two families run at once, and the veto would spread them.
    router_args = ["--worker-warmup-secs", "0", "--disable-worker-overload-protection"]
    with Cluster(args.model, replicas=replicas, policy="cache_aware", replica_args=replica_args,
                 router_args=router_args, env={"OMP_NUM_THREADS": "1"}) as cluster:
        run(cluster, workload(10_000, args, tokenizer)[:2], args)  # warm-up (kernels built), not counted
        for r in range(args.repeat):
            for policy in ("cache_aware", "round_robin"):
                cluster.start_router(policy)
                res = run(cluster, workload(r * 10 + (policy == "round_robin"), args, tokenizer), args)
                results[policy].append(res)
                print(f"repeat {r} {policy}: hit rate {res['hit_rate']:.3f}, {res['throughput']:.1f} tok/s, "
                      f"{res['seconds']:.1f} s, requests per replica {res['requests_per_replica']}", flush=True)
    hit = {p: statistics.median(x["hit_rate"] for x in v) for p, v in results.items()}
    tput = {p: statistics.median(x["throughput"] for x in v) for p, v in results.items()}
    ratios = [a["throughput"] / b["throughput"] for a, b in zip(results["cache_aware"], results["round_robin"])]
    print(json.dumps({
        "hit_rate_cache_aware": round(hit["cache_aware"], 3), "hit_rate_round_robin": round(hit["round_robin"], 3),
        "hit_rate_ratio": round(hit["cache_aware"] / max(hit["round_robin"], 1e-9), 3),
        "throughput_cache_aware": round(tput["cache_aware"], 2),
        "throughput_round_robin": round(tput["round_robin"], 2),
        "throughput_ratio": round(statistics.median(ratios), 3), "families": args.families,
        "requests_per_family": args.requests_per_family, "prefix_tokens": args.prefix_tokens,
        "kv_blocks_per_replica": blocks, "repeat": args.repeat, "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
