"""Tool calling through the clients agent code uses, against a server started by the test: LangChain's
``ChatOpenAI`` (``bind_tools``, ``with_structured_output(method="function_calling")``), instructor
(``Mode.TOOLS``) and the OpenAI Agents SDK (``/v1/responses``, streamed, with a function tool).

The tiny model writes scripted text for ``auto`` calls (pagedkv_testing/scripted_writer.py); named calls
(what ``with_structured_output`` and instructor send) run under their real grammar, so the
arguments the client validates are the model's own, constrained.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from pagedkv_testing.scripted_writer import hermes_tool_server


class Weather(BaseModel):
    """Weather report for a city."""

    model_config = ConfigDict(extra="forbid")  # additionalProperties: false, or a random model writes keys forever

    city: str = Field(max_length=10)
    unit: Literal["c", "f"]
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with hermes_tool_server(tmp_path_factory.mktemp("tiny-clients")) as srv:
        yield srv


def test_langchain_bind_tools_and_structured_output(server: Any) -> None:
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(model="m", base_url=server.base_url, api_key="x", max_tokens=300, temperature=1.0, seed=2)
    server.writer.scripts.append('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    bound = llm.bind_tools([get_weather])
    ai = bound.invoke("What is the weather in Oslo?")
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    assert ai.tool_calls[0]["args"] == {"city": "Oslo"}
    # The tool's result goes back; the history (assistant tool_calls + tool message) is accepted.
    server.writer.scripts.append("It is sunny in Oslo.")
    result = get_weather.invoke(ai.tool_calls[0]["args"])
    final = bound.invoke(["What is the weather in Oslo?", ai,
                          ToolMessage(content=result, tool_call_id=ai.tool_calls[0]["id"])])
    assert final.content == "It is sunny in Oslo."
    # Streamed: the chunks add up to the same call.
    server.writer.scripts.append('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    chunks = list(bound.stream("What is the weather in Oslo?"))
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert total.tool_calls[0]["name"] == "get_weather" and total.tool_calls[0]["args"] == {"city": "Oslo"}
    # with_structured_output(method="function_calling"): a named tool_choice, constrained.
    report = llm.with_structured_output(Weather, method="function_calling").invoke("Weather in Oslo for 3 days?")
    assert isinstance(report, Weather)
    Weather.model_validate(report.model_dump())


def test_instructor_tools_mode(server: Any) -> None:
    import instructor  # installed by scripts/setup.sh --test (without its jiter pin)
    import openai

    client = instructor.from_openai(openai.OpenAI(base_url=server.base_url, api_key="x"), mode=instructor.Mode.TOOLS)
    report = client.chat.completions.create(model="m", response_model=Weather, max_retries=0, max_tokens=300,
                                            temperature=1.0, seed=4,
                                            messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert isinstance(report, Weather)


def test_agents_sdk_streamed_run_with_a_function_tool(server: Any) -> None:
    """The Agents SDK's default: /v1/responses, streamed, a function tool (strict schema), then
    the tool's output sent back as input items and a final answer."""
    import openai
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    server.writer.scripts.extend([
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        "It is sunny in Oslo.",
    ])
    model = OpenAIResponsesModel(model="m", openai_client=openai.AsyncOpenAI(base_url=server.base_url, api_key="x"))
    agent = Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather], model=model)

    async def run() -> Any:
        result = Runner.run_streamed(agent, "What is the weather in Oslo?")
        events = [e async for e in result.stream_events()]
        return result, events

    result, events = asyncio.run(run())
    assert calls == ["Oslo"]
    assert result.final_output == "It is sunny in Oslo."
    assert any(getattr(e, "type", "") == "raw_response_event" for e in events)
