"""Operations per second of the pure-Python memory core.

Workload (block size 16): 1,024-token prompts, half of them sharing a 512-token prefix; decode
appends (allocate a slot, record the token, mark it computed); fork + copy-on-write of a
partly filled last block; free. Prints a table and, last, one JSON line.

    .venv/bin/python bench/memory_ops.py [--prompts 256] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pagedkv.memory import KVCacheManager


def bench_prompts(n: int, rng: random.Random) -> tuple[float, KVCacheManager]:
    kv = KVCacheManager(num_blocks=n * 64 + 64, block_size=16)
    shared = [rng.randrange(50000) for _ in range(512)]
    prompts = []
    for i in range(n):
        tail = [rng.randrange(50000) for _ in range(512 if i % 2 else 1024)]
        prompts.append(shared + tail if i % 2 else tail)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        cached = kv.allocate_prompt(i, p)
        kv.mark_computed(i, len(p) - cached)
    dt = time.perf_counter() - t0
    return dt / n, kv


def bench_decode(kv: KVCacheManager, steps: int) -> float:
    seqs = list(kv.seqs)
    tokens = {s: kv.seqs[s].token_ids for s in seqs}  # each sequence's list (this script owns it)
    t0 = time.perf_counter()
    for step in range(steps):
        for s in seqs:
            tokens[s].append(step)
            kv.allocate_slots(s, 1)
            kv.mark_computed(s, 1)
    return (time.perf_counter() - t0) / (steps * len(seqs))


def bench_fork_cow(kv: KVCacheManager) -> float:
    seqs = list(kv.seqs)
    t0 = time.perf_counter()
    for s in seqs:
        child = ("c", s)
        kv.fork(s, child, kv.seqs[s].token_ids + [1])
        kv.allocate_slots(child, 1)  # last block is partly filled: copy-on-write
        kv.mark_computed(child, 1)
    return (time.perf_counter() - t0) / len(seqs)


def bench_free(kv: KVCacheManager) -> float:
    seqs = list(kv.seqs)
    t0 = time.perf_counter()
    for s in seqs:
        kv.free(s)
    return (time.perf_counter() - t0) / len(seqs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    runs: dict[str, list[float]] = {"prompt_alloc_us": [], "decode_append_us": [],
                                    "fork_cow_us": [], "free_us": []}
    for r in range(args.repeat):
        rng = random.Random(args.seed + r)
        alloc, kv = bench_prompts(args.prompts, rng)
        decode = bench_decode(kv, args.decode_steps)
        fork = bench_fork_cow(kv)
        kv.check_integrity()
        free = bench_free(kv)
        for key, v in zip(runs, (alloc, decode, fork, free)):
            runs[key].append(v * 1e6)
    result = {k: round(statistics.median(v), 2) for k, v in runs.items()}
    labels = {"prompt_alloc_us": "allocate 1,024-token prompt (hash + blocks + cache)",
              "decode_append_us": "decode append (slot + token + computed)",
              "fork_cow_us": "fork + copy-on-write append",
              "free_us": "free a sequence (~64 blocks)"}
    print(f"{'operation':<55} {'median us':>10} {'ops/s':>10}")
    for k, v in result.items():
        print(f"{labels[k]:<55} {v:>10.2f} {1e6 / v:>10.0f}")
    print(json.dumps({**result, "repeat": args.repeat, "prompts": args.prompts}))


if __name__ == "__main__":
    main()
