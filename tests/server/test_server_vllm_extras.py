"""vLLM's extras on the OpenAI server: one chat prompt path (no second BOS), ``continue_final_message``,
``chat_template_kwargs``, ``include_stop_str_in_output``, ``skip_special_tokens``, and the
``/tokenize``, ``/detokenize`` and ``/version`` endpoints, through raw HTTP and the openai client."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pagedkv import LLM, __version__
from pagedkv.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedkv_testing.server import ServerThread, tiny_engine
from pagedkv_testing.tiny_model import write_tiny_model

pytestmark = [pytest.mark.timeout(120), pytest.mark.serial]

TEMPLATE = ("{{ bos_token }}{% if system_hint %}[{{ system_hint }}]{% endif %}"
            "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module", params=["add_bos_token", "post_processor"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a template that writes BOS itself and a tokenizer that also adds one:
    through ``add_bos_token`` (Llama 2 style) or its post-processor (Llama 3 style)."""
    folder = write_tiny_model(tmp_path_factory.mktemp(request.param))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    if request.param == "post_processor":
        config["add_bos_token"] = False
        tok = json.loads((folder / "tokenizer.json").read_text())
        bos = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<s>")
        tok["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [bos], "tokens": ["<s>"]}},
        }
        (folder / "tokenizer.json").write_text(json.dumps(tok))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerThread]:
    engine = tiny_engine(model_dir, block_size=16, num_kv_blocks=256, max_model_len=256, seed=0)
    with ServerThread(engine, served_model_names=["tiny"], api_key="sekrit") as s:
        yield s


def _post(server: ServerThread, path: str, body: dict, key: str | None = "sekrit") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


MESSAGES = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the quick"}]


def test_chat_prompt_has_one_bos_and_equals_llm_chat(server: ServerThread, model_dir: Path) -> None:
    tok = server.engine.tokenizer
    bos = tok.bos_token_id
    assert tok.encode("a")[0] == bos  # the tokenizer adds BOS to plain text
    r = _post(server, "/tokenize", {"model": "tiny", "messages": MESSAGES[:1]})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids[0] == bos and ids[1] != bos and ids.count(bos) == 1
    assert r.json()["count"] == len(ids) and r.json()["max_model_len"] == 256
    llm = LLM(str(model_dir), block_size=16, num_kv_blocks=64, max_model_len=256)
    try:
        out = llm.chat(MESSAGES[:1], __import__("pagedkv").SamplingParams(max_tokens=1))[0]
    finally:
        llm.close()
    assert out.prompt_token_ids == ids
    client = openai.OpenAI(base_url=server.base_url, api_key="sekrit", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES[:1], max_tokens=2)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)


def test_continue_final_message_and_template_kwargs(server: ServerThread) -> None:
    tok = server.engine.tokenizer
    body = {"messages": MESSAGES, "add_generation_prompt": False, "continue_final_message": True,
            "chat_template_kwargs": {"system_hint": "be brief"}}
    r = _post(server, "/tokenize", body)
    assert r.status_code == 200, r.text
    text = tok.decode(r.json()["tokens"], skip_special_tokens=False)
    assert text.endswith("<|assistant|>the quick") and "[be brief]" in text
    r = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2,
                                               "continue_final_message": True})
    assert r.status_code == 400 and "continue_final_message" in r.json()["error"]["message"]
    r = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2,
                                               "add_generation_prompt": False, "continue_final_message": True,
                                               "chat_template_kwargs": {"system_hint": "x"}})
    assert r.status_code == 200, r.text
    r = _post(server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2,
                                               "chat_template_kwargs": {"messages": []}})
    assert r.status_code == 400 and "chat_template_kwargs" in r.json()["error"]["message"]


def test_sampling_extras_reach_the_sampling_params() -> None:
    p = CompletionRequest(prompt="x", include_stop_str_in_output=True, skip_special_tokens=False,
                          stop=["."]).to_sampling_params()
    assert p.include_stop_str_in_output and not p.skip_special_tokens
    q = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).to_sampling_params()
    assert not q.include_stop_str_in_output and q.skip_special_tokens
    assert p.kv_cache_dtype is None  # the engine's KV format unless the request asks for its own
    full = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], kv_cache_dtype="float32")
    assert full.to_sampling_params().kv_cache_dtype == "float32"  # pagedkv's extension (docs/kv_quantization.md)


def test_skip_special_tokens_false_keeps_them_in_the_text(server: ServerThread) -> None:
    """A prompt of token ids ending where the model is steered to emit </s> is unreliable on a
    random model, so the text path is checked directly: the output processor decodes with the
    request's choice."""
    from pagedkv.engine.output_processor import OutputProcessor
    from pagedkv.engine.sequence import Sequence

    tok = server.engine.tokenizer
    ids = tok.encode("hello world", add_special_tokens=False) + [tok.bos_token_id]
    for skip, want in ((True, "hello world"), (False, "hello world<s>")):
        seq = Sequence("s", 0, 0, list(ids), finish_reason="length")
        assert OutputProcessor(tok, 256).decode(seq, skip) == want


def test_detokenize_version_and_the_api_key(server: ServerThread) -> None:
    tok = server.engine.tokenizer
    ids = tok.encode("the lazy dog")
    r = _post(server, "/detokenize", {"model": "tiny", "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "<s>the lazy dog"}
    r = _post(server, "/tokenize", {"prompt": "the lazy dog", "add_special_tokens": False, "return_token_strs": True})
    assert r.json()["tokens"] == ids[1:] and len(r.json()["token_strs"]) == len(ids) - 1
    assert _post(server, "/detokenize", {"tokens": [10 ** 6]}).status_code == 400
    assert _post(server, "/tokenize", {"prompt": "x", "messages": MESSAGES}).status_code == 400
    assert _post(server, "/tokenize", {"prompt": "x"}, key=None).status_code == 401
    assert _post(server, "/tokenize", {"prompt": "x", "model": "nope"}).status_code == 404
    assert httpx.get(server.url + "/version").json() == {"version": __version__}


def test_metrics_answer_during_a_long_step_and_have_vllms_series(server: ServerThread) -> None:
    """A scrape while a step is held is answered from the last step's snapshot, before the step
    ends; after a request, vLLM's request-phase and token histograms and cache_config_info are
    there, with latency buckets reaching hours."""
    import threading

    engine = server.engine
    real_step = engine.step
    hold, in_step, release = threading.Event(), threading.Event(), threading.Event()

    def held_step(*args, **kwargs):
        if hold.is_set():
            hold.clear()
            in_step.set()
            release.wait(60)
        return real_step(*args, **kwargs)

    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 6, "ignore_eos": True}
    done = threading.Thread(target=_post, args=(server, "/v1/completions", body))
    engine.step = held_step
    try:
        assert _post(server, "/v1/completions", body).status_code == 200  # a snapshot exists
        hold.set()
        done.start()
        assert in_step.wait(30)  # the request's step is held
        text = httpx.get(server.url + "/metrics", timeout=20).text  # a scrape waiting on the step times out
        assert not release.is_set() and "pagedkv_kv_blocks_total" in text
    finally:
        release.set()
        if done.is_alive():
            done.join(30)
        del engine.step
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert f'pagedkv_{name}_count{{model_name="tiny"}}' in text, name
    assert 'le="7200.0"' in text and 'pagedkv_cache_config_info{block_size="16"' in text


def test_serve_flags_as_vllm_spells_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from pagedkv.server.cli import add_serve_arguments, run_serve

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["m1", "--served-model-name", "a", "b", "--served-model-name", "c"])
    assert args.model == "m1" and args.served_model_name == ["a", "b", "c"]
    args = parser.parse_args(["--model", "m2", "--chat-template", "{{ messages }}"])
    assert args.model is None and args.model_flag == "m2"
    assert run_serve(parser.parse_args(["m1", "--model", "m2"])) == 2
    assert "two models given" in capsys.readouterr().err
    assert run_serve(parser.parse_args(["--chat-template", str(tmp_path / "missing.jinja")])) == 2
    assert "neither a file nor a jinja2 template" in capsys.readouterr().err


def test_a_chat_template_given_replaces_the_models(server: ServerThread) -> None:
    tok = server.engine.tokenizer
    saved = tok.chat_template
    try:
        tok.set_chat_template("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
        r = _post(server, "/tokenize", {"messages": MESSAGES[:1]})
        assert tok.decode(r.json()["tokens"], skip_special_tokens=False) == "[hello world]"
    finally:
        tok.set_chat_template(saved)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_inter_token_latency_and_iteration_tokens(server: ServerThread) -> None:
    before = httpx.get(server.url + "/metrics", timeout=10).text
    prompt = f"unique {uuid.uuid4().hex} prompt"  # nothing of it is cached: every prompt token is computed
    n_prompt = len(server.engine.tokenizer.encode(prompt))
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      headers={"Authorization": "Bearer sekrit"},
                      json={"model": "tiny", "prompt": prompt, "max_tokens": 6, "ignore_eos": True,
                            "stream": True}) as r:
        assert r.status_code == 200
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    after = httpx.get(server.url + "/metrics", timeout=10).text

    def delta(name: str) -> float:
        return _metric(after, name) - _metric(before, name)

    # five gaps between six tokens; the engine computed the prompt and the first five outputs
    assert delta("pagedkv_inter_token_latency_seconds_count") == 5
    assert delta("pagedkv_inter_token_latency_seconds_sum") > 0
    assert delta("pagedkv_iteration_tokens_total_sum") == n_prompt + 5
    assert delta("pagedkv_iteration_tokens_total_count") >= 6  # a prefill step and five decode steps


@pytest.mark.parametrize("field,value,neutral", [
    ("tool_choice", {"type": "function", "function": {"name": "f"}}, "none"),
    ("guided_grammar", "root ::= 'a'", None),
    ("prompt_logprobs", 1, None),
    ("use_beam_search", True, False),
    ("allowed_token_ids", [1, 2], None),
    ("bad_words", ["x"], []),
    ("truncate_prompt_tokens", 8, None),
])
def test_fields_that_would_change_the_output_are_refused_not_ignored(server: ServerThread, field: str, value,
                                                                      neutral) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = _post(server, "/v1/chat/completions", {**body, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = _post(server, "/v1/chat/completions", {**body, field: neutral})  # absent, null or neutral: served
    assert r.status_code == 200, r.text
    r = _post(server, "/v1/chat/completions", {**body, "some_new_client_extra": {"x": 1}})  # unknown: ignored
    assert r.status_code == 200, r.text
