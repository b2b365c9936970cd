"""``POST /v1/responses``: OpenAI's Responses API, the basic surface, served by the chat path.

The OpenAI Agents SDK (and other new clients) call this endpoint by default. A request is turned
into a chat completion request (input items -> messages, function tools -> tools, ``text.format``
-> ``response_format``), run through ``/v1/chat/completions`` itself (same limits, admission,
template and tool parsers), and its answer turned back: a message item for the content, a
``function_call`` item per call, a ``reasoning`` item for the thinking. Streamed, the chat chunks
become the Responses events (``response.created``, ``response.output_item.added``,
``response.output_text.delta``, ``response.function_call_arguments.delta``, ...,
``response.completed``).

Nothing is stored: ``store: true``, ``previous_response_id``, ``conversation`` and
``background`` are a 400 naming the field, as are tools other than functions and input items
this server cannot render (images, files, item references).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message

from pagedkv.server.errors import APIError, bad_request

Json = dict[str, Any]

# Fields that ask for what is not served, and the neutral values accepted.
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "store": ((False,), "stored responses are not supported: send store: false"),
    "previous_response_id": ((), "previous_response_id needs stored responses, which are not supported: "
                                 "send the whole conversation in input"),
    "conversation": ((), "conversations are not stored: send the whole conversation in input"),
    "background": ((False,), "background responses are not supported"),
    "prompt": ((), "stored prompts are not supported"),
}
# Responses fields passed to chat as they are (pagedkv's and vLLM's extras among them).
_PASSED = ("model", "temperature", "top_p", "user", "parallel_tool_calls", "seed", "top_k", "min_p",
           "repetition_penalty", "presence_penalty", "frequency_penalty", "stop", "cache_salt",
           "priority", "chat_template_kwargs", "conversation_id", "pin_ttl_s")


def responses_router(key_check: Any, read_body: Callable[[Request, int], Awaitable[bytes]]) -> APIRouter:
    """The ``/v1/responses`` route (behind ``key_check``, the API-key dependency); ``read_body`` is
    the server's bounded body reader (app.py's, with its size, time and upload limits)."""
    router = APIRouter(prefix="/v1", dependencies=[key_check])

    @router.post("/responses")
    async def create_response(request: Request) -> Response:
        state = request.app.state.server
        raw = await read_body(request, state.limits.max_request_bytes)
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object", code="invalid_json")
        chat = to_chat_request(body)
        response = await _chat_endpoint(request)(_subrequest(request, json.dumps(chat).encode()))
        meta = _ResponseMeta.of(body, chat)
        if isinstance(response, StreamingResponse):  # the chat stream's cleanup stays with it
            response.body_iterator = _events(response.body_iterator, meta)
            return response
        return JSONResponse(meta.response(json.loads(bytes(response.body))))

    @router.get("/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        raise APIError(404, f"response {response_id!r} not found: responses are not stored", type="not_found_error",
                       param="response_id")

    return router


def _chat_endpoint(request: Request) -> Any:
    stack = list(request.app.routes)
    while stack:  # routes, and routers included in the app (FastAPI wraps those)
        route = stack.pop()
        if getattr(route, "path", None) == "/v1/chat/completions":
            return route.endpoint
        inner = getattr(route, "original_router", None) or getattr(route, "routes", None)
        stack.extend(getattr(inner, "routes", inner) or [])
    raise RuntimeError("the chat route is not registered")


def _subrequest(request: Request, body: bytes) -> Request:
    """The same connection and state, with ``body`` as its body (the chat route reads it)."""
    scope = dict(request.scope)
    scope["headers"] = [(k, v) for k, v in request.scope["headers"] if k.lower() != b"content-length"]
    scope["headers"].append((b"content-length", str(len(body)).encode()))
    scope["path"] = "/v1/chat/completions"
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()  # a disconnect, as the chat route watches for

    return Request(scope, receive)


def to_chat_request(body: Json) -> Json:
    """A chat completion request for a Responses request; a 400 naming the field otherwise."""
    for name, (neutral, message) in _UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not any(value == v and type(value) is type(v) for v in neutral):
            raise bad_request(message, param=name)
    chat: Json = {k: body[k] for k in _PASSED if body.get(k) is not None}
    messages: list[Json] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise bad_request("instructions must be a string", param="instructions")
        messages.append({"role": "system", "content": body["instructions"]})
    messages += _messages(body.get("input"))
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        chat["tools"] = [_tool(t, i) for i, t in enumerate(body["tools"])] if isinstance(body["tools"], list) else \
            _raise(bad_request("tools must be a list", param="tools"))
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                              param="tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        chat["tool_choice"] = choice
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt:
        kind = fmt.get("type")
        if kind == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name", "response"), "schema": fmt.get("schema") or {}, "strict": fmt.get("strict")}}
        elif kind == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif kind != "text":
            raise bad_request(f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                              param="text")
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _raise(exc: Exception) -> Any:
    raise exc


def _tool(tool: Any, i: int) -> Json:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise bad_request(f"tools[{i}]: only function tools are served, got {kind!r}", param="tools")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts", param="input")
    pieces = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where}: only text content is supported, got a {kind!r} part", param="input")
        pieces.append(part["text"])
    return "".join(pieces)


def _messages(items: Any) -> list[Json]:
    if items is None:
        raise bad_request("input is required", param="input")
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad_request("input must be a string or a list of items", param="input")
    out: list[Json] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or assistant, got {role!r}",
                                  param="input")
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant" and not last.get("tool_calls"):
                last["tool_calls"] = [call]  # text, then calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text(output, where)})
        elif kind == "reasoning":
            continue  # the model's earlier thinking: templates drop it from past turns
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported", param="input")
    return out


class _ResponseMeta:
    """The Responses-shaped answer around the chat answer's content and calls."""

    def __init__(self, body: Json, chat: Json) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.body, self.chat = body, chat

    @classmethod
    def of(cls, body: Json, chat: Json) -> _ResponseMeta:
        return cls(body, chat)

    def response(self, completion: Json | None, output: list[Json] | None = None, status: str | None = None,
                 usage: Json | None = None, finish_reason: str | None = None) -> Json:
        """The response object: from a chat completion (full), or from streamed items."""
        if completion is not None:
            choice = completion["choices"][0]
            output = output_items(choice["message"])
            finish_reason = choice.get("finish_reason")
            usage = completion.get("usage")
        if status is None:
            status = "incomplete" if finish_reason == "length" else "completed"
        b = self.body
        tool_choice = b.get("tool_choice", "auto")
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish_reason == "length" else None,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "model": (completion or {}).get("model") or b.get("model"), "output": output or [],
            "parallel_tool_calls": b.get("parallel_tool_calls", True), "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": b.get("temperature"), "top_p": b.get("top_p"),
            "text": {"format": (b.get("text") or {}).get("format") or {"type": "text"}},
            "tool_choice": tool_choice, "tools": b.get("tools") or [], "truncation": "disabled",
            "metadata": b.get("metadata") or {}, "user": b.get("user"),
            "usage": _usage(usage) if usage else None,
        }


def _usage(u: Json) -> Json:
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)},
            "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def _message_item(text: str, status: str = "completed", item_id: str | None = None) -> Json:
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed",
               item_id: str | None = None) -> Json:
    return {"type": "function_call", "id": item_id or f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _reasoning_item(text: str, item_id: str | None = None) -> Json:
    return {"type": "reasoning", "id": item_id or f"rs_{uuid.uuid4().hex}", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def output_items(message: Json) -> list[Json]:
    """A chat message as Responses output items: reasoning, message, function calls."""
    items: list[Json] = []
    if message.get("reasoning_content"):
        items.append(_reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(_message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        items.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


async def _events(chunks: AsyncIterable[Any], meta: _ResponseMeta) -> AsyncIterator[str]:
    """The chat stream's SSE chunks as Responses events."""
    seq = 0
    output: list[Json] = []
    open_item: Json | None = None  # the item being streamed (message, reasoning, or a call)
    calls: dict[int, Json] = {}  # chat call index -> its item
    usage: Json | None = None
    finish_reason: str | None = None

    def event(kind: str, **fields: Any) -> str:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def close() -> list[str]:
        nonlocal open_item
        item, open_item = open_item, None
        if item is None:
            return []
        index = output.index(item)
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            return [event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                          text=part["text"], logprobs=[]),
                    event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                          part=part),
                    event("response.output_item.done", output_index=index, item=item)]
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            return [event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                          text=text),
                    event("response.output_item.done", output_index=index, item=item)]
        return [event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                      arguments=item["arguments"], name=item["name"]),
                event("response.output_item.done", output_index=index, item=item)]

    def open_(item: Json) -> list[str]:
        nonlocal open_item
        out = close()
        output.append(item)
        open_item = item
        index = len(output) - 1
        out.append(event("response.output_item.added", output_index=index, item=json.loads(json.dumps(item))))
        if item["type"] == "message":
            out.append(event("response.content_part.added", item_id=item["id"], output_index=index,
                             content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                    "logprobs": []}))
        return out

    start = meta.response(None, [], status="in_progress")
    yield event("response.created", response=start)
    yield event("response.in_progress", response=start)
    async for raw in chunks:
        text = raw.decode() if isinstance(raw, bytes) else raw
        for line in text.splitlines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                for e in close():
                    yield e
                err = chunk["error"]
                yield event("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))
                failed = meta.response(None, output, status="failed")
                failed["error"] = {"code": err.get("code") or "server_error", "message": err.get("message")}
                yield event("response.failed", response=failed)
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                reasoning = delta.get("reasoning_content")
                if reasoning:
                    if open_item is None or open_item["type"] != "reasoning":
                        for e in open_(_reasoning_item("")):
                            yield e
                    assert open_item is not None
                    open_item["content"][0]["text"] += reasoning
                    yield event("response.reasoning_text.delta", item_id=open_item["id"],
                                output_index=output.index(open_item), content_index=0, delta=reasoning)
                if delta.get("content"):
                    if open_item is None or open_item["type"] != "message":
                        for e in open_(_message_item("", status="in_progress")):
                            yield e
                    assert open_item is not None
                    open_item["content"][0]["text"] += delta["content"]
                    yield event("response.output_text.delta", item_id=open_item["id"],
                                output_index=output.index(open_item), content_index=0, delta=delta["content"],
                                logprobs=[])
                for call in delta.get("tool_calls") or []:
                    fn = call.get("function") or {}
                    if call.get("id"):
                        item = _call_item(call["id"], fn.get("name") or "", "", status="in_progress")
                        calls[call["index"]] = item
                        for e in open_(item):
                            yield e
                    item = calls[call["index"]]
                    if fn.get("arguments"):
                        item["arguments"] += fn["arguments"]
                        yield event("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=output.index(item), delta=fn["arguments"])
                if choice.get("finish_reason"):
                    finish_reason = choice["finish_reason"]
    for e in close():
        yield e
    final = meta.response(None, output, usage=usage, finish_reason=finish_reason)
    yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)
