"""Load: rounds of 500 concurrent short streams, about a third dropped mid-stream by their client.

The server runs as its own process (128 sequences at once, a KV pool small enough for requests to
queue and be preempted), and one client opens 500 streams at once on both endpoints, each asking
for 4 to 16 tokens with ``ignore_eos`` and logprobs, so every token arrives with exactly one
logprobs entry. In each of 3 rounds:

* nothing lost: every stream its client did not drop ends with one ``data: [DONE]`` after exactly
  one ``finish_reason`` ("length"), with as many tokens as it asked for (counted from the streamed
  logprobs and from the usage chunk); a completion's text offsets match the text already sent;
* nothing duplicated: no stream gets more tokens than it asked for, a second finish reason, a
  second ``[DONE]`` or anything after it; all chunks of a stream share one id, unique over all
  streams of all rounds;
* the server agrees: once idle, no KV block is in use, no request was answered with an error,
  requests finished by "length" grew by the completed streams (plus the dropped ones the engine
  had already finished), none finished otherwise, and the generated tokens lie between what the
  clients received and what they asked for.

The server's resident memory (VmRSS) after the third round is within 1% of that after the second;
the first round warms up. (The engine builds the LM head's oneDNN primitive for every row bucket up
to --max-num-seqs at start, ``PackedLinear.warm_up``: built lazily, the rare buckets turned up in
later rounds as about 1% of growth a round.)
Nothing the server writes may be a traceback.
Timings and RSS of every round are printed (run with -s to see them).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server_soak import rss_bytes, wait_idle

from pagedkv_testing.server import free_port, spawn_server, stop_server
from pagedkv_testing.tiny_model import write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420), pytest.mark.serial]

STREAMS = 500
ROUNDS = 3
MAX_NUM_SEQS = 128


@dataclass
class Stream:
    """What one client saw of its stream."""

    index: int
    chat: bool
    max_tokens: int
    dropped: bool = False  # its client left before the end
    status: int = 0
    ids: set[str] = field(default_factory=set)
    choice_indexes: set[int] = field(default_factory=set)
    tokens: int = 0  # logprobs entries received, one per generated token
    text: str = ""
    finishes: list[str] = field(default_factory=list)
    dones: int = 0
    after_done: int = 0  # events after [DONE]
    usage_tokens: list[int] = field(default_factory=list)  # completion_tokens of each usage chunk
    bad_offsets: int = 0  # completion chunks whose text_offset is not the length of the text so far
    errors: list[str] = field(default_factory=list)

    def read(self, chunk: dict) -> None:
        if "error" in chunk:
            self.errors.append(json.dumps(chunk["error"]))
        if "id" in chunk:
            self.ids.add(chunk["id"])
        if chunk.get("usage"):
            self.usage_tokens.append(chunk["usage"]["completion_tokens"])
        for choice in chunk.get("choices", []):
            self.choice_indexes.add(choice["index"])
            if choice["finish_reason"] is not None:
                self.finishes.append(choice["finish_reason"])
            lp = choice["logprobs"]
            if lp is not None:
                if self.chat:
                    self.tokens += len(lp["content"])
                else:
                    self.tokens += len(lp["tokens"])
                    self.bad_offsets += bool(lp["text_offset"]) and lp["text_offset"][0] != len(self.text)
            self.text += choice["delta"].get("content", "") if self.chat else choice["text"]

    def problems(self) -> list[str]:
        """What is wrong with this stream (a dropped one is only checked for duplicates)."""
        out = []
        if self.status != 200:
            out.append(f"HTTP {self.status}")
        if self.errors:
            out.append(f"in-band errors {self.errors}")
        if len(self.ids) != 1:
            out.append(f"chunk ids {sorted(self.ids)}")
        if self.choice_indexes - {0}:
            out.append(f"choice indexes {sorted(self.choice_indexes)}")
        if self.tokens > self.max_tokens:
            out.append(f"{self.tokens} tokens for max_tokens={self.max_tokens}")
        if len(self.finishes) > 1 or self.dones > 1 or self.after_done:
            out.append(f"finishes {self.finishes}, {self.dones} [DONE], {self.after_done} events after it")
        if self.bad_offsets:
            out.append(f"{self.bad_offsets} chunks with a text_offset off the text sent")
        if not self.dropped:
            if self.finishes != ["length"] or self.dones != 1:
                out.append(f"ended with finishes {self.finishes} and {self.dones} [DONE]")
            if self.tokens != self.max_tokens or self.usage_tokens != [self.max_tokens]:
                out.append(f"{self.tokens} tokens, usage {self.usage_tokens}, for max_tokens={self.max_tokens}")
        return [f"stream {self.index} ({'chat' if self.chat else 'completion'}): {p}" for p in out]


def counters(url: str) -> dict[tuple[str, str], float]:
    """The samples of /metrics by (name, label values joined), e.g. ('pagedkv_requests_finished_total',
    'tiny,length'); the model label is dropped from the key."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(v for k, v in sorted(s.labels.items()) if k != "model_name")
            out[(s.name, labels)] = s.value
    return out


def grew(before: dict, after: dict, name: str, labels: str | None = None) -> float:
    """How much a counter grew: one label set, or all of them summed (a missing sample is 0)."""
    keys = {k for k in before.keys() | after.keys() if k[0] == name and (labels is None or k[1] == labels)}
    return sum(after.get(k, 0.0) - before.get(k, 0.0) for k in keys)


async def one_round(url: str, round_no: int) -> list[Stream]:
    rng = random.Random(1000 + round_no)
    limits = httpx.Limits(max_connections=STREAMS + 10, max_keepalive_connections=STREAMS + 10)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def stream(i: int) -> Stream:
            st = Stream(index=i, chat=rng.random() < 0.5, max_tokens=rng.randrange(4, 17))
            drop_after = rng.randrange(1, st.max_tokens + 1) if rng.random() < 1 / 3 else None
            body = {"max_tokens": st.max_tokens, "stream": True, "ignore_eos": True, "seed": 7919 * round_no + i,
                    "temperature": 0.8, "stream_options": {"include_usage": True}}
            text = f"round {round_no} stream {i}: " + "paged attention " * rng.randrange(0, 8)
            if st.chat:
                body |= {"messages": [{"role": "user", "content": text}], "logprobs": True}
            else:
                body |= {"prompt": text, "logprobs": 1}
            path = "/v1/chat/completions" if st.chat else "/v1/completions"
            events = 0
            async with client.stream("POST", path, json=body) as r:
                st.status = r.status_code
                if r.status_code != 200:
                    st.errors.append((await r.aread()).decode(errors="replace"))
                    return st
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    events += 1
                    if st.dones:
                        st.after_done += 1
                    if line == "data: [DONE]":
                        st.dones += 1
                    else:
                        st.read(json.loads(line[len("data: "):]))
                    if drop_after is not None and events >= drop_after and not st.dones:
                        st.dropped = True
                        return st  # leaving the block closes the connection mid-stream
            return st

        results = await asyncio.gather(*(stream(i) for i in range(STREAMS)), return_exceptions=True)
    failed = [f"stream {i}: {r!r}" for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} streams failed: {failed[:10]}"
    return list(results)


def test_500_concurrent_streams_with_disconnects(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "tiny")
    port = free_port()
    proc, _ = spawn_server([str(model_dir), "--port", str(port), "--served-model-name", "tiny",
                            "--num-kv-blocks", "256", "--max-model-len", "256",
                            "--max-num-seqs", str(MAX_NUM_SEQS)])
    url = f"http://127.0.0.1:{port}"
    log: list[str] = []  # the server's output, read all along so that it never blocks on a full pipe
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    try:
        seen_ids: set[str] = set()
        rss = []
        before = counters(url)
        for round_no in range(ROUNDS):
            start = time.monotonic()
            streams = asyncio.run(one_round(url, round_no))
            elapsed = time.monotonic() - start
            problems = [p for st in streams for p in st.problems()]
            assert not problems, f"{len(problems)} problems in round {round_no}: {problems[:20]}"
            ids = [next(iter(st.ids)) for st in streams]
            assert len(set(ids)) == STREAMS and not seen_ids & set(ids), "a response id was reused"
            seen_ids |= set(ids)

            wait_idle(url)
            after = counters(url)
            assert after[("pagedkv_kv_blocks_used", "")] == 0  # no block leaked
            completed = [st for st in streams if not st.dropped]
            dropped = [st for st in streams if st.dropped]
            assert grew(before, after, "pagedkv_request_errors_total") == 0
            # An aborted stream is not counted; one the engine finished before the drop was seen is.
            length = grew(before, after, "pagedkv_requests_finished_total", "length")
            assert len(completed) <= length <= len(completed) + len(dropped)
            assert grew(before, after, "pagedkv_requests_finished_total") == length  # no stop, no abort
            generated = grew(before, after, "pagedkv_generation_tokens_total")
            received = sum(st.tokens for st in streams)
            assert received <= generated <= sum(st.max_tokens for st in streams)
            preempted = grew(before, after, "pagedkv_preemptions_total")
            before = after

            rss.append(rss_bytes(proc.pid))
            print(f"round {round_no}: {len(completed)} complete, {len(dropped)} dropped in {elapsed:.1f}s, "
                  f"{received:.0f}/{generated:.0f} tokens received/generated, {preempted:.0f} preemptions, "
                  f"RSS {rss[-1] / 2**20:.1f} MiB")
        growth = (rss[2] - rss[1]) / rss[1]
        print(f"RSS growth from round 1 to round 2: {growth:+.2%}")
        assert rss[2] <= rss[1] * 1.01, growth
        assert not [line for line in log if "Traceback" in line], "".join(log[-50:])
    finally:
        stop_server(proc)
