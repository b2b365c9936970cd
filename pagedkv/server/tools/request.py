"""A chat request's tools: checked, turned into the template's inputs and the output's rules.

OpenAI's fields, and the legacy ones mapped onto them:

    tools: [{"type": "function", "function": {name, description, parameters, strict}}]
    functions: [{name, description, parameters}]            -> tools
    tool_choice: "none" | "auto" | "required" | {"type": "function", "function": {"name": N}}
    function_call: "none" | "auto" | {"name": N}            -> tool_choice
    parallel_tool_calls: false                              -> at most one forced call

How the answer is read (vLLM's rules):

    auto      the model chooses; ``--tool-call-parser`` reads what it wrote (a 400 unless the
              server runs with ``--enable-auto-tool-choice``); the default when tools are given
    required  decoding is constrained (the structured-output path) to a JSON list of calls
              [{"name": one of the tools, "parameters": that tool's schema}], at least one
    named     decoding is constrained to the named function's parameters schema: the whole
              output is its arguments
    none      the tools are still shown to the template; nothing is parsed

A forced call's arguments therefore always parse and match the schema (``strict`` or not).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from pagedkv.sampling_params import StructuredOutput
from pagedkv.server.errors import APIError, bad_request
from pagedkv.server.tools.parsers import ToolParser, tool_parser
from pagedkv.server.tools.reasoning import ReasoningParser, reasoning_parser

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolOptions:
    """The server's tool and reasoning flags (``pagedkv serve``)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            tool_parser(self.tool_call_parser)  # ValueError naming the choices
        if self.reasoning_parser is not None:
            reasoning_parser(self.reasoning_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes)")

    def new_tool_parser(self) -> ToolParser | None:
        return tool_parser(self.tool_call_parser) if self.tool_call_parser else None

    def new_reasoning_parser(self) -> ReasoningParser | None:
        return reasoning_parser(self.reasoning_parser) if self.reasoning_parser else None


@dataclass(slots=True)
class ToolRequest:
    """The tools of one chat request, checked."""

    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's shape, normalized
    choice: str = "none"  # none | auto | required | named
    named: str | None = None  # the function tool_choice names
    parallel: bool = True
    choice_param: str = "tool_choice"  # or the legacy function_call, for error messages

    @property
    def by_name(self) -> dict[str, dict[str, Any]]:
        return {t["function"]["name"]: t["function"] for t in self.tools}

    def forced_output(self) -> StructuredOutput | None:
        """The constraint that makes a required or named call parse, or None."""
        if self.choice == "named":
            assert self.named is not None, "tool_choice named a function"
            return StructuredOutput(json=self.by_name[self.named]["parameters"])
        if self.choice != "required":
            return None
        variants = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                      "parameters": fn["parameters"]},
                     "required": ["name", "parameters"], "additionalProperties": False}
                    for name, fn in self.by_name.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": variants[0] if len(variants) == 1 else {"anyOf": variants}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutput(json=schema)


def parse_tool_request(tools: list[Any] | None, tool_choice: Any, functions: list[Any] | None,
                       function_call: Any, parallel_tool_calls: bool | None) -> ToolRequest:
    """Check the request's tool fields; a 400 naming the field for anything wrong."""
    if tools is not None and functions is not None:
        raise bad_request("give tools or the legacy functions, not both", param="functions")
    if tool_choice is not None and function_call is not None:
        raise bad_request("give tool_choice or the legacy function_call, not both", param="function_call")
    param = "functions" if functions is not None else "tools"
    given = functions if functions is not None else tools or []
    req = ToolRequest(parallel=parallel_tool_calls is not False)
    seen: set[str] = set()
    for i, tool in enumerate(given):
        fn = _function_of(tool, f"{param}[{i}]", legacy=functions is not None)
        if fn["name"] in seen:
            raise bad_request(f"{param}[{i}]: the function name {fn['name']!r} is given twice", param=param)
        seen.add(fn["name"])
        req.tools.append({"type": "function", "function": fn})
    choice_param = "function_call" if function_call is not None else "tool_choice"
    choice = function_call if function_call is not None else tool_choice
    if choice is None:
        choice = "auto" if req.tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required") or (choice == "required" and function_call is not None):
            raise bad_request(f"{choice_param} must be none, auto, required or a named function, got {choice!r}",
                              param=choice_param)
        req.choice = choice
    elif isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if "function" in choice else choice.get("name")
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise bad_request(f'{choice_param} must name a function: {{"type": "function", "function": '
                              f'{{"name": ...}}}}, got {json.dumps(choice)[:120]}', param=choice_param)
        if name not in seen:
            raise bad_request(f"{choice_param} names the function {name!r}, which is not in {param} "
                              f"({', '.join(sorted(seen)) or 'none given'})", param=choice_param)
        req.choice, req.named = "named", name
    else:
        raise bad_request(f"{choice_param} must be a string or an object", param=choice_param)
    if req.choice in ("required", "auto") and not req.tools:
        raise bad_request(f"{choice_param} is {req.choice!r} but no tools are given", param=choice_param)
    req.choice_param = choice_param
    return req


def check_served(req: ToolRequest, options: ToolOptions) -> None:
    """A 400 when the request needs what the server was not started with."""
    if req.choice == "auto" and not options.enable_auto_tool_choice:
        raise bad_request('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                          '--tool-call-parser; name a function in tool_choice, or use "required" or "none"',
                          param=req.choice_param)


def _function_of(tool: Any, where: str, *, legacy: bool) -> dict[str, Any]:
    param = "functions" if legacy else "tools"
    if not isinstance(tool, dict):
        raise bad_request(f"{where} must be an object", param=param)
    if not legacy:
        if tool.get("type", "function") != "function":
            raise bad_request(f"{where}.type must be \"function\", got {tool.get('type')!r}", param=param)
        tool = tool.get("function")
        if not isinstance(tool, dict):
            raise bad_request(f"{where}.function must be an object with a name", param=param)
        where += ".function"
    name = tool.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(f"{where}.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}", param=param)
    parameters = tool.get("parameters")
    if parameters is None:
        parameters = _EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise bad_request(f"{where}.parameters must be a JSON Schema object", param=param)
    check_schema(parameters, f"{where}.parameters", param)
    fn = {"name": name, "description": tool.get("description") or "", "parameters": parameters}
    if tool.get("strict") is not None:
        fn["strict"] = bool(tool["strict"])
    return fn


_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("not", "if", "then", "else", "contains", "propertyNames", "unevaluatedProperties")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def schema_problem(schema: Any, path: str = "") -> str | None:
    """What makes ``schema`` not a JSON Schema (the shape of the keywords that matter for
    decoding, as the meta-schema has it), or None. The grammar compiler is lenient (it reads
    ``{"type": 7}`` as no constraint), so a mistyped keyword is caught here instead."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{path or 'the schema'} must be an object or a boolean"
    at = (path + ".") if path else ""
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or not all(isinstance(k, str) and k in _TYPES for k in kinds):
            return f"{at}type must be one of {', '.join(sorted(_TYPES))} (or a list of them), got {kind!r}"
    for key in _SCHEMA_MAPS:
        if key in schema:
            if not isinstance(schema[key], dict):
                return f"{at}{key} must be an object of schemas"
            for name, sub in schema[key].items():
                if (problem := schema_problem(sub, f"{at}{key}.{name}")) is not None:
                    return problem
    for key in _SCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list) or (key != "prefixItems" and not schema[key]):
                return f"{at}{key} must be a non-empty list of schemas"
            for i, sub in enumerate(schema[key]):
                if (problem := schema_problem(sub, f"{at}{key}[{i}]")) is not None:
                    return problem
    for key in (*_SCHEMA_ONE, "items", "additionalProperties"):
        if key in schema:
            sub = schema[key]
            if key == "items" and isinstance(sub, list):  # the older tuple form: one schema per position
                subs = [(one, f"{at}{key}[{i}]") for i, one in enumerate(sub)]
            else:
                subs = [(sub, f"{at}{key}")]
            for one, where in subs:
                if (problem := schema_problem(one, where)) is not None:
                    return problem
    required = schema.get("required")
    if required is not None and (not isinstance(required, list) or not all(isinstance(r, str) for r in required)):
        return f"{at}required must be a list of property names"
    if "enum" in schema and not isinstance(schema["enum"], list):
        return f"{at}enum must be a list"
    for key in _NUMBERS:
        if key in schema and (isinstance(schema[key], bool) or not isinstance(schema[key], (int, float))):
            return f"{at}{key} must be a number"
    for key in _COUNTS:
        if key in schema and (isinstance(schema[key], bool) or not isinstance(schema[key], int) or schema[key] < 0):
            return f"{at}{key} must be a non-negative integer"
    for key in ("pattern", "format", "$ref", "description", "title"):
        if key in schema and not isinstance(schema[key], str):
            return f"{at}{key} must be a string"
    return None


def check_schema(schema: dict[str, Any], where: str, param: str) -> None:
    """400 unless ``schema`` is a JSON Schema (:func:`schema_problem`). (A forced call's schema is
    also compiled, later and off the event loop, by the structured-output path like any other.)"""
    problem = schema_problem(schema)
    if problem is not None:
        raise bad_request(f"{where} is not a valid JSON Schema: {problem}", param=param)


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The messages as chat templates expect them (Hugging Face's conventions):

    - an assistant's ``tool_calls`` keep OpenAI's shape, each call's ``arguments`` decoded from
      its JSON text into an object (Qwen's and Llama's templates write it with ``tojson``);
    - a ``tool`` message keeps its ``tool_call_id``, and the called function's ``name``;
    - an assistant's ``reasoning_content`` (or ``reasoning``) is passed as ``reasoning_content``;
    - legacy ``function_call`` and ``role: "function"`` become a tool call and a tool message.

    A 400 (param ``messages``) when a tool message answers a call id that no earlier assistant
    message made.
    """
    out: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        calls = m.tool_calls
        if m.function_call is not None and calls is None:  # legacy: one call, id by position
            calls = [{"id": f"call_legacy_{i}", "type": "function", "function": m.function_call}]
        if calls:
            if m.role != "assistant":
                raise bad_request(f"messages[{i}]: only assistant messages may have tool_calls", param="messages")
            d["tool_calls"] = [_template_call(c, i, k) for k, c in enumerate(calls)]
            for c in d["tool_calls"]:
                call_names[c["id"]] = c["function"]["name"]
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None and m.role == "assistant":
            d["reasoning_content"] = reasoning
        if m.role == "function":  # legacy function result: a tool message answering the last call of that name
            d["role"] = "tool"
            d["tool_call_id"] = next((cid for cid, n in reversed(call_names.items()) if n == m.name), None)
        if d["role"] == "tool":
            cid = m.tool_call_id if m.role == "tool" else d.get("tool_call_id")
            if m.role == "tool" and not cid:
                raise bad_request(f"messages[{i}]: a tool message needs the tool_call_id it answers",
                                  param="messages")
            if cid not in call_names:
                known = ", ".join(call_names) or "none"
                raise bad_request(f"messages[{i}].tool_call_id {cid!r} matches no tool call of an earlier "
                                  f"assistant message (ids: {known})", param="messages")
            d["tool_call_id"] = cid
            d.setdefault("name", call_names[cid])
        out.append(d)
    return out


def _template_call(call: Any, i: int, k: int) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{k}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                          f"\"arguments\"}}}}", param="messages")
    arguments = fn.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass  # left as the text the client sent
    cid = call.get("id") or f"call_{i}_{k}"
    return {"id": cid, "type": "function", "function": {"name": fn["name"], "arguments": arguments},
            "name": fn["name"], "arguments": arguments}


@lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """The variables a chat template reads (``tools``, ``enable_thinking``, ...)."""
    import jinja2
    import jinja2.meta
    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError:
        return frozenset()


def check_template_knows_tools(template: str | None, req: ToolRequest, messages: list[Any]) -> None:
    """A 400 when tools (or tool calls in the history, ``messages`` as the request gave them) would
    be dropped by a template that never reads them, rather than a prompt that silently lacks them."""
    uses_tools = bool(req.tools) or any(m.tool_calls or m.function_call or m.role in ("tool", "function")
                                        for m in messages)
    if not uses_tools or template is None:
        return
    if "tools" in template_variables(template) or "tool_calls" in template:
        return
    raise APIError(400, "this model's chat template cannot render tools (it never reads `tools` or "
                        "`tool_calls`): start the server with a tool-capable --chat-template, e.g. "
                        "examples/tool_chat_template_hermes.jinja with --tool-call-parser hermes",
                   param="tools", code="chat_template_without_tools")
