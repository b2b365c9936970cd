"""Serving benchmark: Poisson load on loopback against ``pagedkv serve``.

Starts a server (or targets ``--url``), sends ``--num-requests`` streaming completions at each
request rate in ``--rates`` (requests per second; ``inf`` sends all at once) and reports, per rate,
time to first token (TTFT), time per output token (TPOT), end-to-end latency percentiles and
throughput. Each rate is bounded by ``--max-seconds``; unfinished requests then count as failed.
The last line printed is one JSON object with every figure.

    python bench/serve.py --model tiny --num-requests 32 --rates 2,8,inf
    python bench/serve.py --url http://127.0.0.1:8000 --rates 1,4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

# The test helpers (a tiny model folder, a server process on a free port) live beside the tests,
# outside the shipped package.

_WORDS = ("the quick brown fox jumps over a lazy dog while paged attention keeps every key and value "
          "in small blocks so that many requests share one cache").split()


@dataclass(slots=True)
class Result:
    ok: bool
    ttft: float = math.nan
    e2e: float = math.nan
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else math.nan


def percentiles(values: list[float]) -> dict[str, float | None]:
    clean = sorted(v for v in values if not math.isnan(v))
    if not clean:
        return {"p50": None, "p90": None, "p99": None, "mean": None}

    def pick(q: float) -> float:
        return round(clean[min(len(clean) - 1, max(0, math.ceil(q * len(clean)) - 1))], 5)

    return {"p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99), "mean": round(sum(clean) / len(clean), 5)}


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]) -> Result:
    start = time.perf_counter()
    ttft = math.nan
    tokens = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                return Result(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Result(False, error=str(event["error"]))
                if math.isnan(ttft) and any(c.get("text") for c in event.get("choices", [])):
                    ttft = time.perf_counter() - start
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except (TimeoutError, httpx.HTTPError) as exc:
        return Result(False, error=f"{type(exc).__name__}: {exc}")
    return Result(True, ttft=ttft, e2e=time.perf_counter() - start, output_tokens=tokens)


async def run_rate(url: str, rate: float, run: int, args: argparse.Namespace,
                   headers: dict[str, str]) -> dict[str, Any]:
    # Prompts start with the run number so no run reuses another's cached prefix blocks.
    rng = random.Random(args.seed + run)
    arrivals = random.Random(args.seed + 1000 + run)
    limits = httpx.Limits(max_connections=args.num_requests + 8, max_keepalive_connections=args.num_requests)
    results: list[Result] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.max_seconds), limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for i in range(args.num_requests):
            words = [rng.choice(_WORDS) for _ in range(args.input_len)]
            body = {"prompt": f"run {run} request {i}: " + " ".join(words), "max_tokens": args.output_len,
                    "stream": True,
                    "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True}}
            tasks.append(asyncio.create_task(one_request(client, url, body, headers)))
            if math.isfinite(rate):
                await asyncio.sleep(arrivals.expovariate(rate))
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, args.max_seconds - (time.perf_counter() - start)))
        for t in pending:
            t.cancel()
        results = [t.result() for t in done] + [Result(False, error="timed out") for _ in pending]
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    errors = sorted({r.error for r in results if not r.ok})
    return {
        "rate": "inf" if math.isinf(rate) else rate,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": round(duration, 3),
        "request_throughput": round(len(ok) / duration, 4),
        "output_token_throughput": round(out_tokens / duration, 2),
        "ttft_s": percentiles([r.ttft for r in ok]),
        "tpot_s": percentiles([r.tpot for r in ok]),
        "e2e_s": percentiles([r.e2e for r in ok]),
        "errors": errors[:3],
    }


_SERVER_COUNTERS = ("pagedkv_prompt_tokens_total", "pagedkv_generation_tokens_total",
                    "pagedkv_prefix_cache_hits_total", "pagedkv_preemptions_total", "pagedkv_engine_steps_total")


async def server_counters(url: str) -> dict[str, float]:
    """The server's own counters from /metrics (summed over labels), to report per-rate deltas."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.get(f"{url}/metrics")
    if r.status_code != 200:
        return {}
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name in _SERVER_COUNTERS:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    model = args.model
    if model == "tiny":
        from pagedkv_testing.tiny_model import write_tiny_model

        model = str(write_tiny_model(Path(tempfile.mkdtemp(prefix="pagedkv-bench-")) / "tiny"))
    from pagedkv_testing.server import free_port, spawn_server

    port = free_port()
    cmd = ["--port", str(port), "--log-level", "error"]
    if model not in (None, "default"):
        cmd.insert(0, model)
    cmd += args.server_args.split() if args.server_args else []
    try:
        proc, _ = spawn_server(cmd, timeout=args.startup_timeout)
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc: subprocess.Popen[str]) -> None:
    from pagedkv_testing.server import stop_server as stop

    stop(proc, timeout=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="target a running server instead of starting one")
    p.add_argument("--model", default="tiny", help="'tiny' (random model, built on the fly), 'default' "
                   "(bundled SmolLM2-135M) or a model path; ignored with --url")
    p.add_argument("--server-args", default="", help="extra flags for pagedkv serve, e.g. '--max-num-seqs 32'")
    p.add_argument("--api-key", default=os.environ.get("PAGEDKV_API_KEY"))
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--rates", default="2,8,inf", help="comma-separated request rates (req/s); inf = burst")
    p.add_argument("--input-len", type=int, default=32, help="prompt length in words")
    p.add_argument("--output-len", type=int, default=32, help="max_tokens per request (EOS ignored)")
    p.add_argument("--max-seconds", type=float, default=120.0, help="bound on each rate's run")
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rates = [math.inf if r.strip() in ("inf", "") else float(r) for r in args.rates.split(",")]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    try:
        asyncio.run(one_request_warmup(url, headers))
        reports = []
        for run, rate in enumerate(rates):
            before = asyncio.run(server_counters(url))
            report = asyncio.run(run_rate(url, rate, run, args, headers))
            after = asyncio.run(server_counters(url))
            report["server"] = {k.removeprefix("pagedkv_").removesuffix("_total"): after[k] - before.get(k, 0.0)
                                for k in after}
            reports.append(report)
            print(f"rate {report['rate']:>5} req/s: {report['completed']}/{args.num_requests} ok in "
                  f"{report['duration_s']:.1f}s, {report['output_token_throughput']:.1f} tok/s, "
                  f"TTFT p50/p90/p99 {_fmt(report['ttft_s'])}, TPOT {_fmt(report['tpot_s'])}, "
                  f"E2E {_fmt(report['e2e_s'])}", flush=True)
    finally:
        if proc is not None:
            stop_server(proc)
    summary = {"bench": "serve", "url": url if args.url else None, "model": None if args.url else args.model,
               "num_requests": args.num_requests, "input_len_words": args.input_len,
               "output_len": args.output_len, "results": reports}
    print(json.dumps(summary))
    return 0 if all(r["failed"] == 0 for r in reports) else 1


async def one_request_warmup(url: str, headers: dict[str, str]) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(f"{url}/v1/completions", json={"prompt": "warm up", "max_tokens": 2},
                              headers=headers)
        r.raise_for_status()


def _fmt(p: dict[str, float | None]) -> str:
    return "/".join("-" if (v := p[k]) is None else f"{v * 1000:.0f}ms" for k in ("p50", "p90", "p99"))


if __name__ == "__main__":
    sys.exit(main())
