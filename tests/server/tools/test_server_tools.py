"""Tool calling and reasoning through the HTTP server, end to end on the tiny model.

A scripted writer (pagedkv_testing/scripted_writer.py) makes the model write a given text, so the parsers
see real detokenized output (split into the tiny tokenizer's small tokens); required and named
calls run under their real grammar (the model's random choices, constrained), and their
arguments must validate against the tool's schema.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from pagedkv.server.tools.request import ToolOptions
from pagedkv_testing.scripted_writer import HERMES, hermes_tool_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 8}},
                                       "required": ["tz"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
TWO_CALLS = ('Let me look that up.\n' + CALL +
             '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with hermes_tool_server(tmp_path_factory.mktemp("tiny-tools")) as srv:
        yield srv


@pytest.fixture()
def options(server: Any) -> Any:
    """Set the server's tool options for one test (restored after)."""
    before = server.app.state.tool_options

    def set_options(**kw: Any) -> None:
        server.app.state.tool_options = ToolOptions(**kw)

    yield set_options
    server.app.state.tool_options = before
    server.writer.scripts.clear()


def post(server: Any, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.base_url}/chat/completions", json={"model": None, "max_tokens": 400, **body},
                      timeout=60)


def stream(server: Any, body: dict[str, Any]) -> tuple[dict[str, Any], str | None, list[dict[str, Any]]]:
    """Stream a chat completion; reassemble its deltas into (message, finish_reason, chunks)."""
    chunks = []
    with httpx.stream("POST", f"{server.base_url}/chat/completions", timeout=60,
                      json={"max_tokens": 400, **body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    message: dict[str, Any] = {"content": None}
    calls: list[dict[str, Any]] = []
    finish = None
    for chunk in chunks:
        for choice in chunk["choices"]:
            d = choice["delta"]
            if d.get("content"):
                message["content"] = (message["content"] or "") + d["content"]
            if d.get("reasoning_content"):
                assert d["reasoning"] == d["reasoning_content"]
                message["reasoning_content"] = message.get("reasoning_content", "") + d["reasoning_content"]
            for c in d.get("tool_calls") or []:
                if "id" in c:
                    assert c["index"] == len(calls) and c["type"] == "function"
                    calls.append({"id": c["id"], "type": "function", "function": {"name": c["function"]["name"],
                                                                                  "arguments": ""}})
                calls[c["index"]]["function"]["arguments"] += c["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    if calls:
        message["tool_calls"] = calls
    return message, finish, chunks


def without_ids(message: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in message.items() if k not in ("role", "reasoning")}
    if "tool_calls" in out:
        out["tool_calls"] = [{**c, "id": None} for c in out["tool_calls"]]
    return out


def test_auto_call_full_and_streamed_agree(server: Any, options: Any) -> None:
    server.writer.scripts.extend([TWO_CALLS, TWO_CALLS])
    r = post(server, {"messages": ASK, "tools": TOOLS})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert msg["content"] == "Let me look that up."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "CET"})]
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 for c in msg["tool_calls"])
    assert len({c["id"] for c in msg["tool_calls"]}) == 2
    streamed, finish, chunks = stream(server, {"messages": ASK, "tools": TOOLS})
    assert finish == "tool_calls"
    assert without_ids(streamed) == without_ids(msg)
    # The arguments arrived in fragments (the tiny tokenizer writes them in several tokens).
    fragments = [c for ch in chunks for ch_c in ch["choices"] for c in ch_c["delta"].get("tool_calls") or []]
    assert len(fragments) > 4
    # No chunk carries content that is part of a tool call's markup.
    assert not any("<tool" in (ch_c["delta"].get("content") or "") for ch in chunks for ch_c in ch["choices"])


def test_plain_answer_with_tools_is_content(server: Any, options: Any) -> None:
    server.writer.scripts.extend(["It is sunny in Paris.", "It is sunny in Paris."])
    msg = post(server, {"messages": ASK, "tools": TOOLS}).json()["choices"][0]
    assert msg["message"]["content"] == "It is sunny in Paris." and "tool_calls" not in msg["message"]
    assert msg["finish_reason"] == "stop"
    streamed, finish, _ = stream(server, {"messages": ASK, "tools": TOOLS})
    assert streamed["content"] == "It is sunny in Paris." and finish == "stop"


def test_malformed_call_is_content(server: Any, options: Any) -> None:
    bad = '<tool_call>\n{"name": get_weather}\n</tool_call>'
    server.writer.scripts.extend([bad, bad])
    msg = post(server, {"messages": ASK, "tools": TOOLS}).json()["choices"][0]["message"]
    assert msg["content"] == bad and "tool_calls" not in msg
    streamed, finish, _ = stream(server, {"messages": ASK, "tools": TOOLS})
    assert streamed["content"] == bad and finish == "stop"


def test_tool_choice_none_leaves_text(server: Any, options: Any) -> None:
    server.writer.scripts.append(CALL)
    msg = post(server, {"messages": ASK, "tools": TOOLS, "tool_choice": "none"}).json()["choices"][0]
    assert msg["message"]["content"] == CALL and msg["finish_reason"] == "stop"


@pytest.mark.parametrize("streamed", [False, True])
def test_required_calls_validate(server: Any, options: Any, streamed: bool) -> None:
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": 3,
            "max_tokens": 300}
    if streamed:
        msg, finish, _ = stream(server, body)
    else:
        r = post(server, body)
        assert r.status_code == 200, r.text
        msg, finish = r.json()["choices"][0]["message"], r.json()["choices"][0]["finish_reason"]
    assert finish == "tool_calls" and msg["tool_calls"]
    for call in msg["tool_calls"]:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_required_without_parallel_makes_one_call(server: Any, options: Any) -> None:
    r = post(server, {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
                      "seed": 5, "temperature": 1.0, "max_tokens": 300})
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1


@pytest.mark.parametrize("streamed", [False, True])
def test_named_call_validates(server: Any, options: Any, streamed: bool) -> None:
    options()  # no parser, no auto: a named call needs neither
    body = {"messages": ASK, "tools": TOOLS, "temperature": 1.0, "seed": 7, "max_tokens": 300,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    if streamed:
        msg, finish, _ = stream(server, body)
    else:
        r = post(server, body)
        assert r.status_code == 200, r.text
        msg, finish = r.json()["choices"][0]["message"], r.json()["choices"][0]["finish_reason"]
    assert finish == "tool_calls"
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_time"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["get_time"])


def test_legacy_functions(server: Any, options: Any) -> None:
    r = post(server, {"messages": ASK, "functions": [TIME["function"]], "function_call": {"name": "get_time"},
                      "temperature": 1.0, "seed": 1, "max_tokens": 300})
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["get_time"])


def test_multi_turn_with_tool_results(server: Any, options: Any) -> None:
    """The history's call and result reach the template as it expects them, and the model's next
    turn answers; the prompt is exactly the template's rendering."""
    client = openai.OpenAI(base_url=server.base_url, api_key="x")
    server.writer.scripts.append(CALL)
    first = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=400)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
    server.writer.scripts.append("It is 21 degrees.")
    second = client.chat.completions.create(model="m", messages=history, tools=TOOLS, max_tokens=400)
    assert second.choices[0].message.content == "It is 21 degrees."
    tok = server.engine.tokenizer
    expected = tok.render_chat([
        ASK[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "get_weather",
                                                             "arguments": {"city": "Paris", "unit": "c"}}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}], True,
        chat_template_kwargs={"tools": [{**t, "function": {**t["function"],
                                                           "description": t["function"].get("description", "")}}
                                        for t in TOOLS]})
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>" in expected
    assert '"arguments": {"city": "Paris", "unit": "c"}' in expected
    assert second.usage.prompt_tokens == len(tok.encode(expected, add_special_tokens=False))


def test_openai_client_streams_tool_calls(server: Any, options: Any) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="x")
    server.writer.scripts.append(TWO_CALLS)
    with client.chat.completions.stream(model="m", messages=ASK, tools=TOOLS, max_tokens=400) as s:
        final = s.get_final_completion()
    msg = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in msg.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(msg.tool_calls[1].function.arguments) == {"tz": "CET"}


THINK = "<think>\nThe user wants weather. I should call the tool.\n</think>\n\n"


def test_reasoning_split_full_and_streamed(server: Any, options: Any) -> None:
    options(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    server.writer.scripts.extend([THINK + CALL, THINK + CALL])
    r = post(server, {"messages": ASK, "tools": TOOLS})
    msg = r.json()["choices"][0]["message"]
    assert msg["reasoning_content"] == msg["reasoning"] == "\nThe user wants weather. I should call the tool.\n"
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "get_weather"
    streamed, finish, chunks = stream(server, {"messages": ASK, "tools": TOOLS})
    assert without_ids(streamed) == without_ids(msg) and finish == "tool_calls"
    # "</think>" is several tokens of the tiny vocabulary: the tag arrived split, and none of it leaked.
    ids = server.engine.tokenizer.encode("</think>", add_special_tokens=False)
    assert len(ids) > 1
    assert not any("think>" in (c["delta"].get("reasoning_content") or "") + (c["delta"].get("content") or "")
                   for ch in chunks for c in ch["choices"])


def test_reasoning_without_tools_and_history(server: Any, options: Any) -> None:
    options(reasoning_parser="deepseek_r1")
    server.writer.scripts.extend(["Two plus two.</think>The answer is 4.", "Two plus two.</think>The answer is 4."])
    history = [{"role": "user", "content": "2+2?"},
               {"role": "assistant", "content": "4", "reasoning_content": "easy"},
               {"role": "user", "content": "again?"}]
    msg = post(server, {"messages": history}).json()["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Two plus two.", "The answer is 4.")
    streamed, _, _ = stream(server, {"messages": history})
    assert (streamed["reasoning_content"], streamed["content"]) == ("Two plus two.", "The answer is 4.")


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                "properties": {"a": {"type": 7}}}}}]},
     "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_nothing", "content": "x"}]}, "messages"),
    ({"tools": TOOLS, "functions": [TIME["function"]]}, "functions"),
])
def test_tool_errors_name_the_field(server: Any, options: Any, body: dict[str, Any], param: str) -> None:
    r = post(server, {"messages": ASK, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_auto_needs_the_flag(server: Any, options: Any) -> None:
    options()
    r = post(server, {"messages": ASK, "tools": TOOLS})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]


def test_template_without_tools_is_a_400(server: Any, options: Any) -> None:
    from pagedkv_testing.tiny_model import CHAT_TEMPLATE

    tok = server.engine.tokenizer
    tok.set_chat_template(CHAT_TEMPLATE)
    try:
        r = post(server, {"messages": ASK, "tools": TOOLS, "tool_choice": "required"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "chat_template_without_tools", r.text
        assert "--chat-template" in r.json()["error"]["message"]
        assert post(server, {"messages": ASK}).status_code == 200  # no tools: the template is fine
    finally:
        tok.set_chat_template(HERMES)


def test_completions_still_refuse_tools(server: Any, options: Any) -> None:
    r = httpx.post(f"{server.base_url}/completions", json={"prompt": "hi", "tools": TOOLS}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    r = httpx.post(f"{server.base_url}/completions", json={"prompt": "hi", "tool_choice": "required"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


# ------------------------------------------------------------------------------------------------
# /v1/responses

FN_TOOL = {"type": "function", "name": "get_weather", "description": "weather",
           "parameters": WEATHER["function"]["parameters"], "strict": True}


def test_responses_text_and_function_call(server: Any, options: Any) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="x")
    server.writer.scripts.append("Hello there.")
    r = client.responses.create(model="m", input="hi", instructions="Be brief.", store=False, max_output_tokens=50)
    assert r.output_text == "Hello there." and r.status == "completed"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    server.writer.scripts.append(CALL)
    r = client.responses.create(model="m", input="weather in Paris?", tools=[FN_TOOL])
    (item,) = r.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert json.loads(item.arguments) == {"city": "Paris", "unit": "c"}
    # The call's result, sent back as input items, reaches the template.
    server.writer.scripts.append("21 degrees.")
    r2 = client.responses.create(model="m", tools=[FN_TOOL], input=[
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments},
        {"type": "function_call_output", "call_id": item.call_id, "output": "21"}])
    assert r2.output_text == "21 degrees."


def test_responses_streamed_events(server: Any, options: Any) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="x")
    server.writer.scripts.append(TWO_CALLS)
    events = list(client.responses.create(model="m", input="weather?", tools=[FN_TOOL, {
        "type": "function", "name": "get_time", "parameters": TIME["function"]["parameters"]}], stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.output_text.delta" in types and "response.function_call_arguments.delta" in types
    final = events[-1].response
    assert [o.type for o in final.output] == ["message", "function_call", "function_call"]
    assert final.output[0].content[0].text == "Let me look that up."
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == final.output[1].arguments + final.output[2].arguments


@pytest.mark.parametrize("body,param", [
    ({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
])
def test_responses_unsupported_is_a_400(server: Any, options: Any, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{server.base_url}/responses", json={"model": "m", "input": "hi", **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ------------------------------------------------------------------------------------------------
# The shipped templates (examples/*.jinja)

HISTORY = ASK + [
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]


@pytest.mark.parametrize("template,call_text,result_text", [
    ("tool_chat_template_hermes.jinja", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                                        '"unit": "c"}}\n</tool_call>', "<tool_response>\n21 degrees\n</tool_response>"),
    ("tool_chat_template_pythonic.jinja", '[get_weather(city="Paris", unit="c")]', "<|im_start|>tool\n21 degrees"),
    ("tool_chat_template_llama3.2_pythonic.jinja", '[get_weather(city="Paris", unit="c")]',
     "<|start_header_id|>ipython<|end_header_id|>\n\n21 degrees<|eot_id|>"),
])
def test_shipped_templates_render_tools_calls_and_results(server: Any, template: str, call_text: str,
                                                          result_text: str) -> None:
    from pagedkv.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": TOOLS})
    tok = server.engine.tokenizer
    before = tok.chat_template
    tok.set_chat_template(open(f"examples/{template}", encoding="utf-8").read())
    try:
        text = tok.render_chat(body.chat_messages(), True, chat_template_kwargs=body.template_kwargs())
    finally:
        tok.set_chat_template(before)
    assert '"name": "get_time"' in text and '"description": "Current weather in a city"' in text  # the tools
    assert call_text in text and result_text in text
    assert text.count("What is the weather in Paris?") == 1


def test_pythonic_template_and_parser(server: Any, options: Any) -> None:
    options(enable_auto_tool_choice=True, tool_call_parser="pythonic")
    tok = server.engine.tokenizer
    tok.set_chat_template(open("examples/tool_chat_template_pythonic.jinja", encoding="utf-8").read())
    try:
        text = '[get_weather(city="Paris", unit="c"), get_time(tz="CET")]'
        server.writer.scripts.extend([text, text])
        msg = post(server, {"messages": ASK, "tools": TOOLS}).json()["choices"][0]["message"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
            ("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {"tz": "CET"})]
        streamed, finish, _ = stream(server, {"messages": ASK, "tools": TOOLS})
        assert without_ids(streamed) == without_ids(msg) and finish == "tool_calls"
    finally:
        tok.set_chat_template(HERMES)


ARGS = '{"city": "Paris", "unit": "c"}'


@pytest.mark.parametrize("parser,text", [
    ("llama3_json", '{"name": "get_weather", "parameters": ' + ARGS + '}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + ARGS + '}]'),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n" + ARGS
     + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
])
def test_each_parser_through_the_server(server: Any, options: Any, parser: str, text: str) -> None:
    """The families' texts, written by the model and detokenized by the engine (mistral's and
    deepseek's with special tokens kept, the EOS text dropped), full and streamed alike."""
    options(enable_auto_tool_choice=True, tool_call_parser=parser)
    server.writer.scripts.extend([text, text])
    msg = post(server, {"messages": ASK, "tools": TOOLS}).json()["choices"][0]["message"]
    assert msg["content"] is None, msg
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [("get_weather", ARGS)]
    streamed, finish, _ = stream(server, {"messages": ASK, "tools": TOOLS})
    assert without_ids(streamed) == without_ids(msg) and finish == "tool_calls"


def test_chat_template_kwargs_reach_the_template_beside_the_tools(server: Any, options: Any) -> None:
    """enable_thinking (Qwen3's switch) and the tools both reach the template."""
    tok = server.engine.tokenizer
    tok.set_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}|thinking={{ enable_thinking }}"
                          "|tools={{ tools | length if tools else 0 }}")
    try:
        r = httpx.post(f"{server.base_url}/chat/completions", timeout=30, json={
            "messages": ASK, "tools": TOOLS, "tool_choice": "none", "max_tokens": 1,
            "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200, r.text
        from pagedkv.server.protocol import ChatCompletionRequest
        body = ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS, "tool_choice": "none",
                                                     "chat_template_kwargs": {"enable_thinking": False}})
        text = tok.render_chat(body.chat_messages(), True, chat_template_kwargs=body.template_kwargs())
        assert text.endswith("|thinking=False|tools=2")
        assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(text, add_special_tokens=False))
    finally:
        tok.set_chat_template(HERMES)


def test_server_flags_are_checked() -> None:
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ToolOptions(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="hermes"):
        ToolOptions(tool_call_parser="nope")
    with pytest.raises(ValueError, match="qwen3"):
        ToolOptions(reasoning_parser="nope")


def test_responses_json_schema_and_required_tool_choice(server: Any, options: Any) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="x")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = client.responses.create(model="m", input="a number", max_output_tokens=60, temperature=1.0,
                                text={"format": {"type": "json_schema", "name": "num", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    r = client.responses.create(model="m", input="weather?", tools=[FN_TOOL], tool_choice="required",
                                temperature=1.0, max_output_tokens=300)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), SCHEMAS["get_weather"])


def test_responses_reasoning_items(server: Any, options: Any) -> None:
    options(reasoning_parser="qwen3")
    client = openai.OpenAI(base_url=server.base_url, api_key="x")
    server.writer.scripts.extend([THINK + "Sunny.", THINK + "Sunny."])
    r = client.responses.create(model="m", input="weather?")
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "Sunny."
    assert r.output[0].content[0].text == "\nThe user wants weather. I should call the tool.\n"
    events = list(client.responses.create(model="m", input="weather?", stream=True))
    text = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == r.output[0].content[0].text
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]


@pytest.mark.parametrize("template", ["tool_chat_template_hermes.jinja", "tool_chat_template_pythonic.jinja",
                                      "tool_chat_template_llama3.2_pythonic.jinja"])
def test_templates_render_as_transformers_does(server: Any, template: str) -> None:
    """pagedkv's rendering of a tool conversation equals transformers' apply_chat_template (its
    tojson: no HTML escaping, keys in order), so prompts match what vLLM sends the model."""
    from transformers import PreTrainedTokenizerFast

    from pagedkv.server.protocol import ChatCompletionRequest

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "the city's weather <now> & é",
                                               "parameters": {"type": "object", "required": ["unit", "city"],
                                                              "properties": {"unit": {"enum": ["c", "f"]},
                                                                             "city": {"type": "string"}}}}}]
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "system", "content": "Be brief."}] + HISTORY,
                                                 "tools": tools})
    messages, kwargs = body.chat_messages(), body.template_kwargs()
    tok = server.engine.tokenizer
    text = open(f"examples/{template}", encoding="utf-8").read()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend, bos_token="<s>", eos_token="</s>")
    ref = hf.apply_chat_template(messages, tools=kwargs["tools"], chat_template=text, tokenize=False,
                                 add_generation_prompt=True)
    before = tok.chat_template
    tok.set_chat_template(text)
    try:
        assert tok.render_chat(messages, True, chat_template_kwargs=kwargs) == ref
    finally:
        tok.set_chat_template(before)
    assert "the city's weather <now> & é" in ref and '"required": ["unit", "city"]' in ref
