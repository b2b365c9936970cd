"""Heavy structured-output requests against ``pagedkv serve`` (default: the bundled model), each
with a victim stream and /health polled beside it (issue 27's probes).

For each probe: the status and time of its answer, the size of the body, the server's RSS before
and after, /health's slowest answer, and the victim's slowest first token and longest gap.

    .venv/bin/python bench/grammar_limits.py [--model PATH] [-- SERVE FLAGS...]

The last line printed is one JSON object (a list of the probes' rows).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ALL_OF = {"allOf": [{"type": "string", "pattern": f".*{chr(97 + i % 26)}{i // 26 or ''}.*"} for i in range(30)]}
SMALL = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
PROBES: list[tuple[str, dict[str, Any]]] = [
    ("small schema", {"guided_json": SMALL}),
    ("small schema again (cached)", {"guided_json": SMALL}),
    ("allOf of 30 patterns", {"guided_json": ALL_OF}),
    ("300k choices", {"guided_choice": [f"choice number {i}" for i in range(300_000)]}),
    ("5k choices", {"guided_choice": [f"choice number {i}" for i in range(5_000)]}),
    ("10k properties", {"guided_json": {"type": "object",
                                        "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}}}),
    ("regex [a-z]{1,400}, 60 tokens", {"guided_regex": "[a-z]{1,400}", "max_tokens": 60}),
]


def rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) >> 10
    return 0


def probe(url: str, pid: int, extra: dict[str, Any]) -> dict[str, Any]:
    health: list[tuple[int, float]] = []
    ttfts: list[float] = []
    gaps: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=10) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    status = c.get(url + "/health").status_code
                except httpx.HTTPError:
                    status = -1
                health.append((status, time.monotonic() - t0))
                time.sleep(0.1)

    def victim() -> None:
        body = {"prompt": "the victim", "max_tokens": 100, "ignore_eos": True, "stream": True, "temperature": 0}
        while not stop.is_set():
            start = last = time.monotonic()
            first = True
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        now = time.monotonic()
                        (ttfts if first else gaps).append(now - (start if first else last))
                        first, last = False, now

    threads = [threading.Thread(target=poll), threading.Thread(target=victim)]
    for t in threads:
        t.start()
    time.sleep(1)
    before = rss_mib(pid)
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 8, **extra}, timeout=600)
    took = time.monotonic() - t0
    time.sleep(1)
    stop.set()
    for t in threads:
        t.join()
    time.sleep(1)
    body = r.json()
    return {"status": r.status_code, "seconds": round(took, 2), "body_bytes": len(r.content),
            "rss_mib": [before, rss_mib(pid)], "health_max_s": round(max(h[1] for h in health), 2),
            "health_all_200": all(h[0] == 200 for h in health), "victim_ttft_max_s": round(max(ttfts), 2),
            "victim_gap_max_s": round(max(gaps, default=0.0), 2),
            "answer": (body["error"]["message"][:160] if r.status_code != 200
                       else [c["finish_reason"] for c in body["choices"]])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model for pagedkv serve (default: the bundled one)")
    parser.add_argument("serve_flags", nargs="*", help="more pagedkv serve flags (after --)")
    args = parser.parse_args()
    from pagedkv_testing.server import free_port, spawn_server, stop_server

    port = free_port()
    t0 = time.monotonic()
    proc, _ = spawn_server(([args.model] if args.model else []) + ["--port", str(port), "--max-model-len", "2048",
                                                                    *args.serve_flags], timeout=600)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True).start()  # stdout: a pipe
    print(f"server started in {time.monotonic() - t0:.1f} s, RSS {rss_mib(proc.pid)} MiB", flush=True)
    rows = []
    try:
        for name, extra in PROBES:
            row = {"probe": name, **probe(f"http://127.0.0.1:{port}", proc.pid, extra)}
            print(row, flush=True)
            rows.append(row)
    finally:
        stop_server(proc)
    print(f"longest server log line: {max((len(line) for line in lines), default=0)} characters")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
