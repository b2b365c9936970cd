"""The OpenAI-compatible API through the real ``openai`` client, against a tiny random Llama."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pagedkv_testing.server import ServerThread, tiny_engine
from pagedkv_testing.tiny_model import write_tiny_model

pytestmark = pytest.mark.timeout(120)

# Counted exactly: the random model may emit EOS at any step, so tests that count tokens ignore it.
EXACT = {"ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerThread]:
    engine = tiny_engine(model_dir, block_size=16, num_kv_blocks=512, max_model_len=512,
                         enable_prefix_caching=True, seed=0)
    with ServerThread(engine, served_model_names=["tiny"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def prompt_len(server: ServerThread, text: str) -> int:
    return len(server.engine.tokenizer.encode(text))


def test_models_and_health(server: ServerThread, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    import httpx

    r = httpx.get(f"{server.url}/health")
    assert r.status_code == 200


def test_completion_usage_and_finish(server: ServerThread, client: openai.OpenAI) -> None:
    prompt = "the quick brown fox"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=7, temperature=0, extra_body=EXACT)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == prompt_len(server, prompt)
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_stream_equals_full(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", prompt="a block table maps", max_tokens=12, temperature=0, extra_body=EXACT)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.text for ch in chunks for c in ch.choices)
    assert text == full.choices[0].text
    finish = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_chat_stream_equals_full(server: ServerThread, client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10,
                                          temperature=0, extra_body=EXACT)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    assert full.usage.completion_tokens == 10
    templated = server.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert full.usage.prompt_tokens == prompt_len(server, templated)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                            stream=True, extra_body=EXACT)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="hello", n=3, max_tokens=5, seed=7, extra_body=EXACT)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 15
    texts: dict[int, str] = {}
    for ch in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=2,
                                             max_tokens=4, seed=3, stream=True, extra_body=EXACT):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert sorted(texts) == [0, 1]


def test_batch_and_token_prompts(server: ServerThread, client: openai.OpenAI) -> None:
    ids = server.engine.tokenizer.encode("paged attention")
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=3, extra_body=EXACT)
    assert r.usage.prompt_tokens == len(ids)
    r = client.completions.create(model="tiny", prompt=["one", "two words"], n=2, max_tokens=2, extra_body=EXACT)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens == prompt_len(server, "one") + prompt_len(server, "two words")


def test_seed_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, temperature=1.0,
                                      seed=seed, extra_body=EXACT)
        return r.choices[0].text

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_stop_string(client: openai.OpenAI) -> None:
    kwargs = dict(model="tiny", prompt="hello world", max_tokens=24, temperature=0, extra_body=EXACT)
    text = client.completions.create(**kwargs).choices[0].text
    assert len(text) >= 8
    stop = text[4:7]
    r = client.completions.create(stop=[stop], **kwargs)
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(stop=stop, stream=True, **kwargs))
    assert "".join(c.text for ch in streamed for c in ch.choices) == text[: text.index(stop)]


def test_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="the lazy dog", max_tokens=4, logprobs=2, extra_body=EXACT)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                       logprobs=True, top_logprobs=2, extra_body=EXACT)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_echo(client: openai.OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt="echo me", max_tokens=3, echo=True, temperature=0,
                                  extra_body=EXACT)
    assert r.choices[0].text.startswith("echo me")


def test_prefix_cache_and_salt(client: openai.OpenAI) -> None:
    prompt = "paged attention keeps the key value cache in fixed size blocks " * 6  # several full blocks

    def cached(salt: str | None) -> int:
        extra = dict(EXACT, **({"cache_salt": salt} if salt else {}))
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    cached(None)
    assert cached(None) >= 16
    assert cached("tenant-a") == 0  # another tenant never reuses the unsalted blocks
    assert cached("tenant-a") >= 16
    assert cached("tenant-b") == 0


def test_no_leaked_blocks(server: ServerThread) -> None:
    assert server.wait_idle().kv.used_blocks == 0
