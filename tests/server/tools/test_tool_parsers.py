"""Tool-call and reasoning parsers on texts as each model family writes them (no model, no server).

Every case is checked twice: parsed whole, and streamed one character at a time (the worst
split a tokenizer can make), where the deltas must add up to the whole parse.
"""

from __future__ import annotations

import json
import random

import pytest

from pagedkv.server.tools.parsers import (
    NamedCallStream,
    RequiredCallsParser,
    ToolCallStream,
    ToolParser,
    tool_parser,
)
from pagedkv.server.tools.reasoning import reasoning_parser

W = '{"city": "Paris", "unit": "c"}'

# (parser, model text, expected content, expected [(name, arguments)]); texts as the families'
# chat templates teach them (Qwen2.5/3 and Hermes: hermes; Llama 3.1-3.3: llama3_json; Mistral's
# two tokenizer generations; Llama 3.2/4: pythonic; DeepSeek V3 and V3.1).
CASES = [
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>', None, [("get_weather", W)]),
    ("hermes", f'I will check both.\n\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
     "I will check both.", [("get_weather", W), ("get_time", '{"tz": "CET"}')]),
    ("hermes", '<tool_call>{"arguments": {"q": "x"}, "name": "search"}</tool_call>', None, [("search", '{"q": "x"}')]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', None, [("f", '{"a": 1}')]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\nDone, see above.', "Done, see above.",
     [("f", "{}")]),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"s": "a } ] \\" </tool_call>"}}\n</tool_call>', None,
     [("f", '{"s": "a } ] \\" </tool_call>"}')]),
    ("hermes", "The weather is fine, no tools needed.", "The weather is fine, no tools needed.", []),
    ("hermes", '<tool_call>\n{"name": get_weather}\n</tool_call>',
     '<tool_call>\n{"name": get_weather}\n</tool_call>', []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',
     '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>', []),
    ("hermes", 'Sure <tool_call>\n{"name": "f", "argu', 'Sure <tool_call>\n{"name": "f", "argu', []),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {W}}}', None, [("get_weather", W)]),
    ("llama3_json", f'<|python_tag|>{{"name": "get_weather", "parameters": {W}}}; {{"name": "t", "parameters": {{}}}}',
     None, [("get_weather", W), ("t", "{}")]),
    ("llama3_json", '{"name": "Bob", "age": 42}', '{"name": "Bob", "age": 42}', []),
    ("llama3_json", "Paris is sunny today.", "Paris is sunny today.", []),
    ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}, {{"name": "t", "arguments": {{}}}}]',
     None, [("get_weather", W), ("t", "{}")]),
    ("mistral", f'[TOOL_CALLS]get_weather[ARGS]{W}', None, [("get_weather", W)]),
    ("mistral", f'Checking.[TOOL_CALLS]get_weather[ARGS]{W}[TOOL_CALLS]t[ARGS]{{}}', "Checking.",
     [("get_weather", W), ("t", "{}")]),
    ("mistral", "[TOOL_CALLS]oops no json", "[TOOL_CALLS]oops no json", []),
    ("pythonic", '[get_weather(city="Paris", unit="c"), get_time(tz=\'CET\')]', None,
     [("get_weather", W), ("get_time", '{"tz": "CET"}')]),
    ("pythonic", '<|python_start|>[search(q="a, b", n=3, exact=True, tags=["x"])]<|python_end|>', None,
     [("search", '{"q": "a, b", "n": 3, "exact": true, "tags": ["x"]}')]),
    ("pythonic", '[f(flag=true, none=null, xs=[1, false])]', None,
     [("f", '{"flag": true, "none": null, "xs": [1, false]}')]),
    ("pythonic", "[1] is a citation, not a call.", "[1] is a citation, not a call.", []),
    ("pythonic", "[os.system('rm -rf /')]", "[os.system('rm -rf /')]", []),
    ("deepseek_v3", 'Let me see.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n'
                    f'```json\n{W}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Let me see.", [("get_weather", W)]),
    ("deepseek_v3", f'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{W}<｜tool▁call▁end｜>'
                    '<｜tool▁call▁begin｜>t<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None,
     [("get_weather", W), ("t", "{}")]),
]


def stream_all(parser: ToolParser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    s = ToolCallStream(parser)
    content, calls = "", []
    for d in [s.feed(p) for p in pieces] + [s.finish()]:
        content += d.content
        for c in d.calls:
            if c.id is not None:
                assert c.index == len(calls)
                calls.append([c.name, ""])
            calls[c.index][1] += c.arguments
    return content or None, [tuple(c) for c in calls]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parser_whole_and_streamed(name: str, text: str, content: str | None, calls: list) -> None:
    parser = tool_parser(name)
    got_content, got = parser.extract(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    for c in got:
        json.loads(c.arguments)
        assert c.id.startswith("call_") and len(c.id) == 29 if name != "mistral" else len(c.id) == 9
    assert len({c.id for c in got}) == len(got)
    assert stream_all(parser, list(text)) == (content, calls)
    rng = random.Random(0)
    cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert stream_all(parser, pieces) == (content, calls)


def test_arguments_stream_in_fragments() -> None:
    """A call's id and name come first, then its arguments as they are written."""
    s = ToolCallStream(tool_parser("hermes"))
    deltas = [s.feed(c) for c in f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>']
    calls = [c for d in deltas for c in d.calls]
    assert calls[0].id is not None and calls[0].name == "get_weather"
    assert len(calls) > 10 and all(c.id is None for c in calls[1:])
    assert "".join(c.arguments for c in calls) == W


def test_content_is_held_only_while_a_marker_may_be_arriving() -> None:
    s = ToolCallStream(tool_parser("hermes"))
    assert s.feed("Hello <tool").content == "Hello"
    assert s.feed("s are fun").content == " <tools are fun"


def test_required_and_named_streams() -> None:
    text = '[{"name": "get_weather", "parameters": ' + W + '}, {"name": "t", "parameters": {}}]'
    assert stream_all(RequiredCallsParser(), list(text)) == (None, [("get_weather", W), ("t", "{}")])
    s = NamedCallStream("get_weather")
    deltas = [s.feed(c) for c in W] + [s.finish()]
    calls = [c for d in deltas for c in d.calls]
    assert calls[0].name == "get_weather" and "".join(c.arguments for c in calls) == W


def test_unknown_parser_lists_the_names() -> None:
    with pytest.raises(ValueError, match="hermes"):
        tool_parser("nope")


@pytest.mark.parametrize("name,text,reasoning,content", [
    ("deepseek_r1", "<think>\nStep 1.\n</think>\n\nThe answer is 4.", "\nStep 1.\n", "The answer is 4."),
    ("deepseek_r1", "Step 1 (the template opened the tag).</think>Four.", "Step 1 (the template opened the tag).",
     "Four."),
    ("deepseek_r1", "Still thinking when max_tokens hit", "Still thinking when max_tokens hit", ""),
    ("qwen3", "<think>\nhmm\n</think>\n\nFour.", "\nhmm\n", "Four."),
    ("qwen3", "<think>\n\n</think>\n\nFour.", "\n\n", "Four."),  # enable_thinking false: an empty pair
    ("qwen3", "Four, without thinking.", None, "Four, without thinking."),
    ("qwen3", "A <think> tag later is content.", None, "A <think> tag later is content."),
])
def test_reasoning_whole_and_streamed(name: str, text: str, reasoning: str | None, content: str) -> None:
    parser = reasoning_parser(name)
    assert parser.split(text) == (reasoning, content)
    stream = parser.stream()
    pieces = [stream.feed(c) for c in text] + [stream.finish()]
    assert "".join(r for r, _ in pieces) == (reasoning or "")
    assert "".join(c for _, c in pieces) == content
    assert all("think>" not in r and "</" not in c[-2:] for r, c in pieces if reasoning is not None)


def test_mistral_pipeline_drops_eos_text_even_when_split() -> None:
    """Mistral's [TOOL_CALLS] is a special token: the text is decoded with special tokens kept,
    so the EOS text ("</s>") arrives too, possibly split by a stop-string holdback."""
    from pagedkv.server.tools.chat_format import ToolChatFormat
    from pagedkv.server.tools.parsers import ToolCallStream

    fmt = ToolChatFormat(new_calls=lambda: ToolCallStream(tool_parser("mistral")), strip=("</s>",))
    text = f'[TOOL_CALLS]get_weather[ARGS]{W}</s>'
    full = fmt.choice(0, text, None, "stop")
    assert full["finish_reason"] == "tool_calls" and full["message"]["content"] is None
    assert full["message"]["tool_calls"][0]["function"]["arguments"] == W
    plain = fmt.choice(1, "Hello.</s>", None, "stop")["message"]["content"]
    assert plain == "Hello."
    pieces = ["Hel", "lo.</", "s>"]
    deltas = [fmt.delta(2, p, None, "stop" if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)]
    assert "".join(d["delta"].get("content", "") for d in deltas if d) == "Hello."


@pytest.mark.parametrize("name", ["hermes", "pythonic"])
def test_a_long_call_streams_in_linear_time(name: str) -> None:
    """Each feed resumes the scan where the last one stopped: a 16k-character call fed one
    character at a time takes well under a second (re-scanning from the start each time took
    about 15 s)."""
    import time

    body = "lorem 'ipsum' \"dolor\" {[ " * 640
    text = ('<tool_call>\n{"name": "write", "arguments": ' + json.dumps({"text": body}) + '}\n</tool_call>'
            if name == "hermes" else "[write(text=" + json.dumps(body) + ")]")
    s = ToolCallStream(tool_parser(name))
    start = time.process_time()
    args = "".join(c.arguments for ch in text for c in s.feed(ch).calls)
    args += "".join(c.arguments for c in s.finish().calls)
    assert time.process_time() - start < 5.0
    assert json.loads(args) == {"text": body}
