"""Live defects found by probing the server as a hostile-but-fair client; each has a test here.

1. A huge request must not take the server's memory: bodies over --max-request-bytes are a 413
   before they are held in full; a prompt far longer than max_model_len tokens can be is refused
   before it is tokenized.
2. One request's sampling parameters must not fail the others (temperature 1e-40).
3. Completions' ``max_tokens: null`` is OpenAI's default, 16.
4. ``null`` is the default for every optional field.
5. Lone surrogates and pathological JSON are 400; an unexpected 500 keeps the connection open.
7. ``min_tokens > max_tokens`` is 400; echo + logprobs returns the prompt tokens' logprobs too;
   work and stop-string limits are 400 with OpenAI's error body.
(6, the drain on SIGTERM, is in test_server_cli.py.)
"""

from __future__ import annotations

import concurrent.futures
import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from pagedkv.server.limits import RequestLimits
from pagedkv_testing.server import ServerThread, tiny_engine
from pagedkv_testing.tiny_model import write_tiny_model

pytestmark = pytest.mark.timeout(120)

MAX_MODEL_LEN = 256
LIMITS = RequestLimits(max_request_bytes=64 * 1024, max_tokens_per_request=4096, max_stop_chars=64,
                       max_stop_token_ids=16)
GOOD = {"model": "tiny", "prompt": "hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    engine = tiny_engine(model_dir, block_size=16, num_kv_blocks=256, max_model_len=MAX_MODEL_LEN, seed=0)
    with ServerThread(engine, served_model_names=["tiny"], limits=LIMITS) as s:
        yield s


@pytest.fixture()
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def assert_error(r: httpx.Response, status: int, *, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


def still_serving(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json=GOOD)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


# 1 ----------------------------------------------------------------------------------------------
def test_oversized_body_is_413_before_it_is_read(http: httpx.Client) -> None:
    body = json.dumps({**GOOD, "prompt": "x" * LIMITS.max_request_bytes}).encode()
    assert_error(http.post("/v1/completions", content=body), 413, code="request_too_large")

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies while it streams in
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"y" * 4096
        yield b'"}'

    assert_error(http.post("/v1/chat/completions", content=chunks()), 413, code="request_too_large")
    still_serving(http)


def test_huge_prompt_is_refused_without_tokenizing_it(server: ServerThread, http: httpx.Client) -> None:
    tokenizer = server.engine.tokenizer
    per_token = tokenizer.max_chars_per_token
    assert per_token is not None
    seen: list[int] = []
    encode = tokenizer.encode

    def recording_encode(text: str, *args, **kwargs):
        seen.append(len(text))
        return encode(text, *args, **kwargs)

    tokenizer.encode = recording_encode
    try:
        prompt = "hello " * (MAX_MODEL_LEN * per_token // 6 + 10)  # just past the bound, under the body limit
        assert len(prompt) > MAX_MODEL_LEN * per_token
        err = assert_error(http.post("/v1/completions", json={**GOOD, "prompt": prompt}), 400,
                           param="prompt", code="context_length_exceeded")
        assert "characters" in err["message"] and str(MAX_MODEL_LEN) in err["message"]
        assert len(prompt) not in seen
        # A prompt that fits is tokenized as usual.
        still_serving(http)
        assert seen
    finally:
        del tokenizer.encode


# 2 ----------------------------------------------------------------------------------------------
def test_a_subnormal_temperature_fails_no_one(server: ServerThread, http: httpx.Client) -> None:
    others = [{**GOOD, "prompt": f"request {i}", "max_tokens": 8, "ignore_eos": True, "temperature": 0}
              for i in range(8)]
    bad = {**GOOD, "prompt": "x", "max_tokens": 4, "temperature": 1e-40}
    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        futures = [pool.submit(http.post, "/v1/completions", json=b) for b in [*others, bad]]
        results = [f.result() for f in futures]
    assert [r.status_code for r in results] == [200] * 9
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in results[:8])
    assert server.wait_idle().kv.used_blocks == 0


# 3, 4 ------------------------------------------------------------------------------------------
def test_null_max_tokens_is_the_default_16(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "count", "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16


NULLABLE = ["n", "stream", "echo", "presence_penalty", "frequency_penalty", "ignore_eos", "min_tokens",
            "priority", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
            "logprobs", "stream_options", "user", "logit_bias", "best_of", "cache_salt", "suffix",
            "response_format", "tools", "repetition_penalty", "model"]


def test_null_means_default_for_every_optional_field(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **dict.fromkeys(NULLABLE)})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1
    chat = {"messages": [{"role": "user", "content": "hi", "name": None}], "max_tokens": None,
            "max_completion_tokens": 3, "logprobs": None, "top_logprobs": None, "n": None,
            "stream": None, "add_generation_prompt": None, **dict.fromkeys(NULLABLE[3:10])}
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None


# 5 ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("raw", [
    b'{"prompt": "a\\ud800b", "max_tokens": 2}',
    b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}',
    b'{"messages": [{"role": "user", "content": "x\\udc00"}]}',
    b'{"prompt": "x", "user": "\\ud83d"}',
])
def test_lone_surrogates_are_400(http: httpx.Client, raw: bytes) -> None:
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    assert_error(http.post(path, content=raw), 400, code="invalid_unicode")
    still_serving(http)


def test_a_surrogate_pair_is_valid_text(http: httpx.Client) -> None:
    r = http.post("/v1/completions", content=b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}')
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("raw", [
    b"[" * 30_000 + b"]" * 30_000,
    b'{"prompt": "x", "tools": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
    b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}",
    b'{"prompt": "x", "temperature": NaN}',
    b'{"prompt": "x", "top_p": Infinity}',
])
def test_pathological_json_is_400(http: httpx.Client, raw: bytes) -> None:
    assert_error(http.post("/v1/completions", content=raw), 400)
    still_serving(http)


def _raw_request(sock: socket.socket, port: int, body: bytes) -> tuple[int, dict]:
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (port, len(body), body))
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, rest = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(rest) < length:
        rest += sock.recv(65536)
    return int(head.split()[1]), json.loads(rest[:length])


def test_unexpected_500_keeps_the_connection_open(server: ServerThread) -> None:
    engine = server.engine

    def broken_tokenize(prompt):
        raise KeyError("injected")

    engine.tokenize = broken_tokenize
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            status, body = _raw_request(sock, server.port, json.dumps(GOOD).encode())
            assert status == 500 and body["error"]["type"] == "internal_error"
            del engine.tokenize
            status, body = _raw_request(sock, server.port, json.dumps(GOOD).encode())  # same socket
            assert status == 200 and body["choices"]
    finally:
        engine.__dict__.pop("tokenize", None)
    assert server.wait_idle().kv.used_blocks == 0


# 7 ----------------------------------------------------------------------------------------------
def test_min_tokens_above_max_tokens_is_400(http: httpx.Client) -> None:
    assert_error(http.post("/v1/completions", json={**GOOD, "max_tokens": 3, "min_tokens": 5}), 400,
                 param="min_tokens")
    chat = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2, "min_tokens": 9}
    assert_error(http.post("/v1/chat/completions", json=chat), 400, param="min_tokens")


def test_echo_with_logprobs_gives_the_prompt_tokens_logprobs(server: ServerThread, http: httpx.Client) -> None:
    prompt = "the quick brown fox jumps"
    prompt_ids = server.engine.tokenizer.encode(prompt)
    body = {**GOOD, "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 3, "ignore_eos": True,
            "temperature": 0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(prompt)
    assert len(lp["tokens"]) == len(prompt_ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing predicts it
    assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:])
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    # Streaming sends the same numbers, the prompt's with the first chunk.
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = [v for c in chunks for ch in c["choices"] if ch["logprobs"] for v in ch["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]
    assert server.wait_idle().kv.used_blocks == 0


def test_work_and_stop_limits(http: httpx.Client) -> None:
    err = assert_error(http.post("/v1/completions", json={**GOOD, "n": 20, "max_tokens": 250}), 400,
                       param="max_tokens", code="request_too_large")
    assert str(LIMITS.max_tokens_per_request) in err["message"]
    chat = {"messages": [{"role": "user", "content": "x"}], "n": 20}  # no max_tokens: the rest of the context
    assert_error(http.post("/v1/chat/completions", json=chat), 400, code="request_too_large")
    assert_error(http.post("/v1/completions", json={**GOOD, "stop": ["a" * 40, "b" * 40]}), 400,
                 param="stop", code="request_too_large")
    assert http.post("/v1/completions", json={**GOOD, "stop": ["a" * 30, "b" * 30]}).status_code == 200
    assert_error(http.post("/v1/completions", json={**GOOD, "stop_token_ids": list(range(17))}), 400,
                 param="stop_token_ids", code="request_too_large")
    assert http.post("/v1/completions", json={**GOOD, "stop_token_ids": list(range(16))}).status_code == 200
    # Echoed prompt logprobs count too: 64 choices x ~100 prompt tokens.
    echo = {**GOOD, "prompt": "hello world " * 50, "echo": True, "logprobs": 5, "n": 64, "max_tokens": 1}
    err = assert_error(http.post("/v1/completions", json=echo), 400, code="request_too_large")
    assert "echoed prompt tokens" in err["message"]
