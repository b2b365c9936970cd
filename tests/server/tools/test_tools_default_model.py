"""Tool calls on the bundled default model (SmolLM2-135M-Instruct, whose own template knows no
tools), served as a user would: ``pagedkv serve --enable-auto-tool-choice --tool-call-parser hermes
--chat-template examples/tool_chat_template_hermes.jinja``, through openai-python. Named, required
and streamed calls must come back with arguments that validate against their schema.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pagedkv_testing.server import free_port, spawn_server, stop_server

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a time zone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}},
                   "required": ["timezone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client() -> openai.OpenAI:
    port = free_port()
    proc, _ = spawn_server(["--port", str(port), "--served-model-name", "smol", "--enable-auto-tool-choice",
                            "--tool-call-parser", "hermes", "--chat-template",
                            "examples/tool_chat_template_hermes.jinja"], timeout=240)
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
    finally:
        stop_server(proc)


def check(calls: list) -> None:
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, max_tokens=100,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    check([call])


def test_required_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smol", messages=ASK, tools=TOOLS, max_tokens=150,
                                       tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls"
    check(r.choices[0].message.tool_calls)


def test_streamed_required_call_and_a_second_turn(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(model="smol", messages=ASK, tools=TOOLS, max_tokens=150,
                                        tool_choice="required") as s:
        final = s.get_final_completion()
    message = final.choices[0].message
    check(message.tool_calls)
    # The result goes back with the call; the model answers in text (auto: it may also call again).
    history = ASK + [message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"result": "sunny, 21 degrees"})}
        for c in message.tool_calls]
    r = client.chat.completions.create(model="smol", messages=history, tools=TOOLS, max_tokens=40)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 200  # the tools, the call and its result are in the prompt
