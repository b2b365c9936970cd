"""Two replicas behind a round-robin router, with the remote KV tier they share against without it.

Two replicas of the default model, each in its own process with one thread, one local Redis server
(``pagedkv_testing/redis_server.py``: a free port, no persistence). 64 requests over 4 prefixes of
1,024 tokens (each request: a prefix + 32 tokens of its own, 64 new tokens, greedy, ``ignore_eos``)
from ``--concurrency`` clients in a closed loop (each sends its next request when its last one
finished); the router sends request i to replica i % 2, in turn, with no affinity. The requests'
order makes each prefix reach one replica first: replica 0 gets the prefixes in the order 0, 1, 2, 3
(8 requests each), replica 1 in the order 2, 3, 0, 1. Without a shared tier each replica computes
all four prefixes; with it, each computes two and loads the two the other replica computed (written
to the server as their blocks became cached).

Two configurations, alternately (shared, local, shared, local, ...), ``--repeat`` times each:
``shared`` (``kv_remote_url`` on a flushed server) and ``local`` (the same replicas without it).

    .venv/bin/python bench/shared_tier.py [--repeat 2] [--concurrency 32]

Last line: one JSON object with ``remote_ttft_speedup`` (median TTFT, local / shared, of each
replica's first request on a prefix whose first request went to the other replica: 4 per run),
``shared_vs_local_throughput`` (output tokens over the whole run, from the first request sent to
the last token, shared / local, median over the pairs), the medians behind them, what the shared
runs read from the server, the settings and the load average.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import random
import statistics
import sys
import time
from typing import Any

PREFIXES = 4
ORDER = ((0, 1, 2, 3), (2, 3, 0, 1))  # the prefixes each replica sees, in turn


def workload(args: argparse.Namespace, vocab: int) -> list[tuple[int, int, list[int]]]:
    """The clients' requests in arrival order: (replica, prefix, prompt), round-robin over replicas."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(1000, vocab) for _ in range(args.prefix_len)] for _ in range(PREFIXES)]
    per = args.requests // (2 * PREFIXES)  # requests per prefix and replica
    streams = [[p for p in order for _ in range(per)] for order in ORDER]
    out = []
    for k in range(len(streams[0])):
        for replica in (0, 1):
            prefix = streams[replica][k]
            own = [rng.randrange(1000, vocab) for _ in range(args.own_len)]
            out.append((replica, prefix, prefixes[prefix] + own))
    return out


def replica(args: argparse.Namespace, which: int, url: str | None, inbox: Any, events: Any) -> None:
    """One replica: load and warm up, say ready; then take requests from ``inbox`` as they come
    (checked before every step), step, and report each request's first token and finish to
    ``events`` as ``(kind, replica, request index, time)``; ``None`` in the inbox ends it."""
    from pagedkv.engine import LLMEngine
    from pagedkv.sampling_params import SamplingParams

    options: dict[str, Any] = dict(threads=args.threads, block_size=16, max_num_seqs=64,
                                   max_num_batched_tokens=2048, kv_offloading_size=args.host_gib)
    if url is not None:
        options["kv_remote_url"] = url
    engine = LLMEngine.from_options(args.model, **options)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    # warm-up: the same untimed request for every configuration (a prompt no workload shares)
    engine.add_request("warm", list(range(1000, 1100)), SamplingParams(temperature=0.0, max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv.clear_prefix_cache()
    events.put(("ready", which, -1, time.time()))
    started: set[str] = set()
    open_inbox = True
    while open_inbox or engine.has_unfinished_requests():
        block = open_inbox and not engine.has_unfinished_requests()
        while open_inbox:
            try:
                item = inbox.get(timeout=0.5) if block else inbox.get_nowait()
            except queue.Empty:
                break
            block = False
            if item is None:
                open_inbox = False
                break
            index, prompt = item
            engine.add_request(str(index), prompt, params)
        if not engine.has_unfinished_requests():
            continue
        for out in engine.step():
            now = time.time()
            if out.request_id not in started and out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)
                events.put(("first", which, int(out.request_id), now))
            if out.finished:
                events.put(("done", which, int(out.request_id), now, len(out.outputs[0].token_ids)))
    kv = engine.kv.stats()
    engine.close()
    events.put(("stats", which, -1, time.time(),
                {"remote_hit_tokens": kv.remote_hit_tokens, "remote_blocks_read": kv.remote_blocks_read,
                 "remote_blocks_written": kv.remote_blocks_written, "remote_errors": kv.remote_errors,
                 "prefix_hit_tokens": kv.prefix_hit_tokens}))


def run(args: argparse.Namespace, reqs: list[tuple[int, int, list[int]]], url: str | None) -> dict[str, Any]:
    """The clients (``--concurrency`` of them, closed loop) and the round-robin router against
    two replicas; the run's throughput and each replica's first-on-other-prefix TTFTs."""
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    inboxes = [ctx.Queue(), ctx.Queue()]
    procs = [ctx.Process(target=replica, args=(args, r, url, inboxes[r], events)) for r in (0, 1)]
    for p in procs:
        p.start()
    deadline = time.time() + args.timeout

    def next_event() -> tuple:
        """The replicas' next event; raises if one died or nothing came for ``--timeout`` seconds."""
        while True:
            try:
                return events.get(timeout=2.0)
            except queue.Empty:
                dead = [p.exitcode for p in procs if not p.is_alive() and p.exitcode]
                if dead or time.time() > deadline:
                    for p in procs:
                        p.kill()
                    raise RuntimeError(f"a replica failed (exit codes {dead})" if dead else
                                       f"no event from the replicas for {args.timeout} s") from None

    ready = 0
    while ready < 2:
        ready += next_event()[0] == "ready"
    sent: dict[int, float] = {}
    first: dict[int, float] = {}
    tokens, last = 0, 0.0
    stats: list[dict[str, int]] = []
    nxt = 0

    def send() -> None:
        nonlocal nxt
        replica_of, _, prompt = reqs[nxt]  # (the router's turn: request i to replica i % 2)
        sent[nxt] = time.time()
        inboxes[replica_of].put((nxt, prompt))
        nxt += 1

    start = time.time()
    while nxt < min(args.concurrency, len(reqs)):
        send()
    done = 0
    while done < len(reqs):
        event = next_event()
        deadline = time.time() + args.timeout
        if event[0] == "first":
            first[event[2]] = event[3]
        elif event[0] == "done":
            done += 1
            tokens += event[4]
            last = max(last, event[3])
            if nxt < len(reqs):
                send()
    for inbox in inboxes:
        inbox.put(None)
    while len(stats) < 2:
        event = next_event()
        if event[0] == "stats":
            stats.append(event[4])
    for p in procs:
        p.join()
    # each replica's first request on a prefix whose first request went to the other replica
    owner: dict[int, int] = {}
    for replica_of, prefix, _ in reqs:
        owner.setdefault(prefix, replica_of)
    other_first: list[float] = []
    seen: set[tuple[int, int]] = set()
    for i, (replica_of, prefix, _) in enumerate(reqs):
        if (replica_of, prefix) not in seen:
            seen.add((replica_of, prefix))
            if owner[prefix] != replica_of:
                other_first.append(first[i] - sent[i])
    ttfts = [first[i] - sent[i] for i in sent]
    return {"tok_s": tokens / (last - start), "seconds": last - start, "other_first_ttft": other_first,
            "ttft_median": statistics.median(ttfts),
            **{k: sum(st[k] for st in stats) for k in stats[0]}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the bundled model)")
    p.add_argument("--repeat", type=int, default=2, help="pairs of runs (shared, local)")
    p.add_argument("--threads", type=int, default=1, help="threads per replica")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--own-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32,
                   help="clients, each sending its next request when its last one finished")
    p.add_argument("--host-gib", type=float, default=0.5, help="host tier of each replica (GiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args()
    if args.requests % (2 * PREFIXES):
        p.error(f"--requests must be a multiple of {2 * PREFIXES}")

    from pagedkv.engine import LLMEngine
    from pagedkv_testing.redis_server import RedisServer

    probe = LLMEngine.from_options(args.model, num_kv_blocks=16, kv_offloading_size=0)
    vocab = probe.runner.config.vocab_size
    probe.close()
    del probe
    reqs = workload(args, vocab)
    shared: list[dict[str, Any]] = []
    local: list[dict[str, Any]] = []
    with RedisServer() as server:
        for r in range(args.repeat):
            for name, url, into in (("shared", server.url, shared), ("local", None, local)):
                server.client().flushall()
                res = run(args, reqs, url)
                into.append(res)
                print(f"repeat {r} {name:6s} {res['tok_s']:6.1f} tok/s in {res['seconds']:.1f} s, first-on-other "
                      f"TTFT {statistics.median(res['other_first_ttft']):.3f} s, remote hits "
                      f"{res['remote_hit_tokens']}, load {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)

    def med(runs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(x[key] for x in runs)

    ttft_shared = statistics.median(t for x in shared for t in x["other_first_ttft"])
    ttft_local = statistics.median(t for x in local for t in x["other_first_ttft"])
    out = {
        "remote_ttft_speedup": round(ttft_local / ttft_shared, 3),
        "shared_vs_local_throughput": round(statistics.median(s["tok_s"] / lo["tok_s"]
                                                              for s, lo in zip(shared, local)), 3),
        "shared_tok_s": round(med(shared, "tok_s"), 2), "local_tok_s": round(med(local, "tok_s"), 2),
        "shared_first_on_other_ttft_s": round(ttft_shared, 4), "local_first_on_other_ttft_s": round(ttft_local, 4),
        "shared_ttft_median_s": round(med(shared, "ttft_median"), 4),
        "local_ttft_median_s": round(med(local, "ttft_median"), 4),
        "shared_remote_hit_tokens": med(shared, "remote_hit_tokens"),
        "shared_remote_blocks_written": med(shared, "remote_blocks_written"),
        "shared_remote_errors": med(shared, "remote_errors"),
        "requests": args.requests, "prefix_len": args.prefix_len, "own_len": args.own_len,
        "output_len": args.output_len, "concurrency": args.concurrency, "repeat": args.repeat,
        "threads_per_replica": args.threads, "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
