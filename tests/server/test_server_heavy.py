"""Issue 27, items 6 and 7: valid but heavy requests stall no one, and /metrics tells no tenant
what another one sent.

Each heavy probe runs against a ``pagedkv serve`` process (its RSS is its own) with /health and
/metrics polled beside it (every answer 200 within 1 s) and victim streams (time to first token
<= 10 s, longest gap <= 5 s); the server's RSS after the probe is within 5% of before (or 64 MB on
this small server: ``Server.assert_rss_returned``).

- a chat body of 100,000 messages: decoded off the loop, refused by the character pre-check (400);
- a 15 MB /tokenize with return_token_strs: refused by the same pre-check before tokenizing;
- echo + logprobs with n: 128 on a 2,040-token prompt: the 40 MB body built off the loop;
- the /metrics oracle: a right and a wrong guess of another tenant's prompt move no metric
  differently (the first-miss counter has the caller's view only); --metrics-api-key guards it.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from pagedkv_testing.latency_probe import HealthProbe, rss_bytes, victim_streams
from pagedkv_testing.server import free_port, spawn_server, stop_server
from pagedkv_testing.tiny_model import write_tiny_model

pytestmark = [pytest.mark.timeout(180), pytest.mark.serial]

MAX_MODEL_LEN = 2304
PER_TOKEN = 7  # the tiny tokenizer's max_chars_per_token (checked below)


class Server:
    def __init__(self, proc, port: int) -> None:
        self.proc, self.url = proc, f"http://127.0.0.1:{port}"

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def assert_rss_returned(self, before: int) -> None:
        """RSS within 5% of ``before`` (the issue's bound, for a server of a few GB), or 64 MB on this
        ~450 MB tiny server: objects the engine keeps (prefix-cache history, hashes) allocated beside a
        big request's pin some of Python's 1 MB object arenas; that plateaus, it does not accumulate."""
        after = self.settled_rss()
        assert after - before <= max(0.05 * before, 64 << 20), (before >> 20, after >> 20)

    def settled_rss(self) -> int:
        """RSS once memory stops being handed back (trimming runs after a request ends, at most
        once a second)."""
        time.sleep(1.5)
        last = self.rss()
        for _ in range(20):
            time.sleep(0.25)
            now = self.rss()
            if abs(now - last) < 1 << 20:
                return now
            last = now
        return last


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny-heavy"), max_position_embeddings=4096)
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps({"key-a": "team-a", "key-b": "team-b"}))
    port = free_port()
    proc, _ = spawn_server([str(model_dir), "--port", str(port), "--served-model-name", "tiny",
                            "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "1024", "--block-size", "16",
                            "--max-num-seqs", "160", "--api-keys-file", str(keys),
                            "--metrics-api-key", "metrics-key"])
    try:
        yield Server(proc, port)
    finally:
        stop_server(proc)


A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}


@contextmanager
def watched(server: Server) -> Iterator[None]:
    """/health and /metrics polled every 0.1 s and victim streams, one after another, while the
    block runs; on exit, asserts every answer was a 200 within 1 s and each victim's time to first
    token <= 10 s and longest gap between tokens <= 5 s."""
    health = HealthProbe(server.url, interval=0.1, paths=("/health", "/metrics"),
                         headers={"Authorization": "Bearer metrics-key"})
    with victim_streams(server.url, health, headers=A):
        yield


def test_the_tiny_tokenizer_bound(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from pagedkv.models.tokenizer import max_chars_per_token
    model_dir = write_tiny_model(tmp_path)
    assert max_chars_per_token(Tokenizer.from_file(str(model_dir / "tokenizer.json"))) == PER_TOKEN


def test_a_chat_of_100000_messages(server: Server) -> None:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}] * 100_000,
                       "max_tokens": 1}).encode()
    # (the first such request beside a stream grows the allocator's pools once, by ~80 MB; later
    # ones must not grow them further)
    with watched(server):
        r = httpx.post(server.url + "/v1/chat/completions", content=body, headers=A, timeout=60)
    assert r.status_code == 400
    before = server.settled_rss()
    with watched(server):
        for _ in range(3):
            t0 = time.monotonic()
            r = httpx.post(server.url + "/v1/chat/completions", content=body, headers=A, timeout=60)
            took = time.monotonic() - t0
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
            assert str(MAX_MODEL_LEN) in r.json()["error"]["message"] and took < 20
    server.assert_rss_returned(before)


def test_a_15mb_tokenize_with_token_strs(server: Server) -> None:
    fits = "paged attention " * 50
    r = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": fits, "return_token_strs": True},
                   headers=A, timeout=60)
    assert r.status_code == 200 and r.json()["count"] == len(r.json()["token_strs"]) > 50
    rng = random.Random(0)
    huge = "".join(rng.choice("abcdefgh ") for _ in range(1 << 20)) * 15
    body = json.dumps({"model": "tiny", "prompt": huge, "return_token_strs": True}).encode()
    with watched(server):
        assert httpx.post(server.url + "/tokenize", content=body, headers=A, timeout=60).status_code == 400
    before = server.settled_rss()
    with watched(server):
        for _ in range(3):  # the finding: three such requests, RSS 2.7 -> 7.9 GB
            t0 = time.monotonic()
            r = httpx.post(server.url + "/tokenize", content=body, headers=A, timeout=60)
            assert time.monotonic() - t0 < 20
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": huge[: 1 << 20]}]}
    r = httpx.post(server.url + "/tokenize", json=chat, headers=A, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    del huge, body
    server.assert_rss_returned(before)


def test_echo_and_logprobs_with_n_128(server: Server) -> None:
    rng = random.Random(1)
    prompt = [rng.randrange(5, 384) for _ in range(2040)]
    body = {"model": "tiny", "prompt": prompt, "n": 128, "max_tokens": 4, "echo": True, "logprobs": 5,
            "ignore_eos": True}
    with watched(server):
        warm = httpx.post(server.url + "/v1/completions", json=body, headers=A, timeout=150)
    assert warm.status_code == 200, warm.text[:300]
    del warm
    before = server.settled_rss()
    with watched(server):
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", json=body, headers=A, timeout=150)
        took = time.monotonic() - t0
    assert r.status_code == 200, r.text[:300]
    assert took < 120
    choices = r.json()["choices"]
    assert len(choices) == 128
    assert all(len(c["logprobs"]["tokens"]) == 2044 and len(c["logprobs"]["top_logprobs"]) == 2044
               for c in choices)
    del r, choices
    server.assert_rss_returned(before)


# item 7 -------------------------------------------------------------------------------------------
_TIMING = re.compile(r"_(seconds|latency|time)|_created\b|iteration_tokens|request_(prompt|generation)_tokens")


def _metrics(server: Server) -> dict[str, float]:
    """/metrics as {series: value}, timing series left out (they differ run to run)."""
    text = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer metrics-key"}, timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            if not _TIMING.search(series.split("{")[0]):
                out[series] = float(value)
    return out


def _idle(server: Server) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = _metrics(server)
        if m.get('pagedkv_num_requests_running{model_name="tiny"}') == 0 and \
                m.get('pagedkv_num_requests_waiting{model_name="tiny"}') == 0:
            return
        time.sleep(0.05)
    raise TimeoutError


def test_metrics_reveal_no_other_tenants_prompt(server: Server) -> None:
    """Tenant B guesses tenant A's prompt: the /metrics change its guess causes is the same whether
    A sent it (a right guess) or not (a wrong one)."""
    def send(headers: dict, prompt: str, salt: str) -> dict:
        r = httpx.post(server.url + "/v1/completions", headers=headers, timeout=60,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0,
                             "return_cache_details": True, "cache_salt": salt})
        assert r.status_code == 200, r.text
        _idle(server)
        return r.json()["usage"]["prompt_tokens_details"]["cache_details"]

    secret = "alpha plan: the release ships on friday " * 3
    wrong = "omega plan: the release ships on monday " * 3  # as many tokens, nothing in common
    send(A, secret, "a")  # A's prompt: its blocks cached under A's tenant
    deltas = []
    for guess, salt in ((secret, "guess-1"), (wrong, "guess-2")):  # (a salt each: B's own cache apart)
        before = _metrics(server)
        told = send(B, guess, salt)
        after = _metrics(server)
        deltas.append(({k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)
                        if after.get(k, 0) != before.get(k, 0)}, told))
    (right, told_right), (wrong_delta, told_wrong) = deltas
    assert told_right == told_wrong  # the caller's own view is the same, too
    assert right == wrong_delta and right  # the same series moved by the same amounts
    text = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer metrics-key"}, timeout=30).text
    assert "different_tenant" not in text


def test_metrics_api_key(server: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer key-a"}, {"Authorization": "metrics-key"}):
        r = httpx.get(server.url + "/metrics", headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer metrics-key"}, timeout=30)
    assert r.status_code == 200 and "pagedkv_kv_blocks_total" in r.text
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # probes need no key
