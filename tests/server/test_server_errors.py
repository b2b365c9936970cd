"""Bad requests get OpenAI-format errors with the documented status, and never disturb others.

Documented statuses: 400 malformed JSON, invalid or mistyped fields (validation is 400, not 422)
and prompts over max_model_len; 401 missing/wrong API key; 404 unknown model; 429 queue full with
Retry-After; 503 while draining.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pagedkv_testing.server import ServerThread, tiny_engine
from pagedkv_testing.tiny_model import write_tiny_model

pytestmark = pytest.mark.timeout(120)

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerThread]:
    engine = tiny_engine(model_dir, block_size=16, num_kv_blocks=256, max_model_len=MAX_MODEL_LEN, seed=0)
    with ServerThread(engine, served_model_names=["tiny"], api_key=KEY) as s:
        yield s


@pytest.fixture()
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def assert_error(r: httpx.Response, status: int, *, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


GOOD = {"model": "tiny", "prompt": "hello", "max_tokens": 2}

BAD_COMPLETIONS = [
    pytest.param(b"{not json", None, id="malformed-json"),
    pytest.param(b"[1, 2]", None, id="not-an-object"),
    pytest.param(json.dumps({"model": "tiny"}).encode(), "prompt", id="missing-prompt"),
    pytest.param(json.dumps({**GOOD, "max_tokens": -1}).encode(), "max_tokens", id="negative-max-tokens"),
    pytest.param(json.dumps({**GOOD, "max_tokens": "8"}).encode(), "max_tokens", id="string-max-tokens"),
    pytest.param(json.dumps({**GOOD, "temperature": "hot"}).encode(), "temperature", id="string-temperature"),
    pytest.param(json.dumps({**GOOD, "temperature": -1}).encode(), "temperature", id="negative-temperature"),
    pytest.param(json.dumps({**GOOD, "top_p": 0}).encode(), "top_p", id="zero-top-p"),
    pytest.param(json.dumps({**GOOD, "n": 0}).encode(), "n", id="zero-n"),
    pytest.param(json.dumps({**GOOD, "prompt": 5}).encode(), "prompt", id="int-prompt"),
    pytest.param(json.dumps({**GOOD, "prompt": [-3]}).encode(), "prompt", id="negative-token-id"),
    pytest.param(json.dumps({**GOOD, "prompt": [999999]}).encode(), "prompt", id="token-id-not-in-vocab"),
    pytest.param(json.dumps({**GOOD, "prompt": []}).encode(), "prompt", id="empty-prompt-list"),
    pytest.param(json.dumps({**GOOD, "stop": 3}).encode(), "stop", id="int-stop"),
    pytest.param(json.dumps({**GOOD, "logprobs": 50}).encode(), "logprobs", id="too-many-logprobs"),
    pytest.param(json.dumps({**GOOD, "presence_penalty": 5}).encode(), "presence_penalty", id="penalty-range"),
    pytest.param(json.dumps({**GOOD, "tools": [{"type": "function"}]}).encode(), "tools", id="unsupported"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS)
def test_bad_completion_bodies(http: httpx.Client, body: bytes, param: str | None) -> None:
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    err = assert_error(r, 400, param=param)
    assert err["type"] == "invalid_request_error"
    assert http.post("/v1/completions", json=GOOD).status_code == 200  # still serving


def test_bad_chat_bodies(http: httpx.Client) -> None:
    assert_error(http.post("/v1/chat/completions", json={"model": "tiny", "messages": []}), 400, param="messages")
    bad_role = {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}
    assert_error(http.post("/v1/chat/completions", json=bad_role), 400)
    lp = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    assert_error(http.post("/v1/chat/completions", json=lp), 400, param="top_logprobs")


def test_prompt_too_long(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={**GOOD, "prompt": "hello world " * 400})
    err = assert_error(r, 400, param="prompt")
    assert str(MAX_MODEL_LEN) in err["message"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello world " * 400}]}
    assert str(MAX_MODEL_LEN) in assert_error(http.post("/v1/chat/completions", json=chat), 400)["message"]


def test_unknown_model_and_route(http: httpx.Client) -> None:
    err = assert_error(http.post("/v1/completions", json={**GOOD, "model": "gpt-9"}), 404, param="model")
    assert err["code"] == "model_not_found"
    assert_error(http.get("/v1/nothing-here"), 404)


def test_api_key(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        assert_error(anon.post("/v1/completions", json=GOOD), 401)
        assert_error(anon.get("/v1/models"), 401)
        wrong = anon.post("/v1/completions", json=GOOD, headers={"Authorization": "Bearer nope"})
        assert_error(wrong, 401)
        assert anon.get("/health").status_code == 200  # probes need no key
        assert anon.get("/metrics").status_code == 200
    bad_client = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.models.list()


def test_errors_do_not_disturb_a_running_stream(server: ServerThread, http: httpx.Client) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    result: dict = {}

    def stream() -> None:
        chunks = list(client.completions.create(model="tiny", prompt="steady", max_tokens=40, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        result["usage"] = chunks[-1].usage

    t = threading.Thread(target=stream)
    t.start()
    for body, _ in [p.values for p in BAD_COMPLETIONS]:
        assert http.post("/v1/completions", content=body).status_code == 400
    assert http.post("/v1/completions", json={**GOOD, "prompt": "x " * 600}).status_code == 400
    t.join(60)
    assert result["usage"].completion_tokens == 40
    assert server.wait_idle().kv.used_blocks == 0


def test_queue_full_gets_429(model_dir: Path) -> None:
    engine = tiny_engine(model_dir, block_size=16, num_kv_blocks=64, max_num_seqs=2, seed=0)
    with ServerThread(engine, max_queue=0) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        long = {"prompt": "hold", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json=long) as a, \
                http.stream("POST", "/v1/completions", json=long) as b:
            assert a.status_code == b.status_code == 200
            r = http.post("/v1/completions", json={"prompt": "one more", "max_tokens": 2})
            err = assert_error(r, 429)
            assert err["code"] == "queue_full" and r.headers["Retry-After"]
        # Both streams were dropped by the client: they are aborted and admission reopens.
        s.wait_idle()
        assert http.post("/v1/completions", json={"prompt": "now", "max_tokens": 2}).status_code == 200
        assert s.wait_idle().kv.used_blocks == 0


def test_failed_step_fails_only_requests_in_flight(server: ServerThread, http: httpx.Client) -> None:
    engine = server.engine
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():  # the third step raises once, then the engine steps normally again
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected step failure")
        return real_step()

    engine.step = flaky_step
    try:
        r = http.post("/v1/completions", json={**GOOD, "max_tokens": 20, "ignore_eos": True})
        err = assert_error(r, 500)
        assert "injected step failure" in err["message"]
        ok = http.post("/v1/completions", json={**GOOD, "max_tokens": 5, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
        assert http.get("/health").status_code == 200
    finally:
        del engine.step
    assert server.wait_idle().kv.used_blocks == 0


def test_draining_server_refuses_new_requests(server: ServerThread, http: httpx.Client) -> None:
    server.state.draining = True  # what SIGTERM sets (see test_server_cli for the process-level drain)
    try:
        err = assert_error(http.post("/v1/completions", json=GOOD), 503)
        assert err["code"] == "server_draining"
        assert http.get("/health").status_code == 503
    finally:
        server.state.draining = False
    assert http.post("/v1/completions", json=GOOD).status_code == 200
