"""Request bodies of the OpenAI-compatible API, and the OpenAI error format.

Bodies are validated strictly (a string where a number belongs is an error, not a coercion) and
unknown fields are ignored, as OpenAI clients send fields this server does not use. ``null`` means
"the default" for every optional field, as in OpenAI's schema (openai-python sends ``null`` for a
parameter given as None): ``max_tokens: null`` on completions is 16, not "the rest of the context". Every error a
client can cause becomes an :class:`APIError`, rendered as
``{"error": {"message", "type", "param", "code"}}`` with the matching HTTP status.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, TypeAdapter, ValidationError, model_validator

from pagedkv.engine.grammar_worker import excerpt
from pagedkv.sampling_params import SamplingParams, StructuredOutput
from pagedkv.server.errors import APIError as APIError  # re-exported: the routes raise it from here
from pagedkv.server.errors import bad_request
from pagedkv.server.limits import MAX_CHOICES


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


# OpenAI and vLLM fields that would change the output if ignored: a 400 naming them unless absent,
# null or at the neutral value listed (other unknown fields are ignored, as clients send extras).
UNSUPPORTED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    # (chat serves these: ChatCompletionRequest.SERVED_FIELDS; completions have no tools)
    "tool_choice": (("none", "auto"), "tools are served by /v1/chat/completions, not completions"),
    "functions": (([],), "functions are served by /v1/chat/completions, not completions"),
    "function_call": (("none", "auto"), "functions are served by /v1/chat/completions, not completions"),
    "guided_grammar": ((), "grammars (guided_grammar) are not supported: use guided_json, guided_regex, "
                           "guided_choice or response_format"),
    "prompt_logprobs": ((), "prompt_logprobs is not supported over HTTP: use echo with logprobs (completions)"),
    "use_beam_search": ((False,), "beam search is not served over HTTP (LLMEngine.add_request(beam_width=))"),
    "length_penalty": ((1, 1.0), "length_penalty applies to beam search, which is not served over HTTP"),
    "truncate_prompt_tokens": ((), "truncate_prompt_tokens is not supported"),
    "allowed_token_ids": ((), "allowed_token_ids is not supported (logit_bias can forbid tokens)"),
    "bad_words": (([],), "bad_words is not supported (logit_bias can forbid tokens)"),
    "documents": (([],), "documents (RAG chat templates) are not supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "audio": ((), "audio output is not supported"),
    "modalities": ((["text"],), "only the text modality is supported"),
    "web_search_options": ((), "web search is not supported"),
}


def reject_unsupported_fields(body: dict[str, Any], served: frozenset[str] = frozenset()) -> None:
    """400 naming the first field of ``UNSUPPORTED_FIELDS`` (but ``served``) given with a value that matters."""
    for name, (neutral, message) in UNSUPPORTED_FIELDS.items():
        if name in served:
            continue
        value = body.get(name)
        if value is not None and not any(value == v and type(value) is type(v) for v in neutral):
            raise bad_request(message, param=name)


NonNegInt = Annotated[int, Field(ge=0)]
# Sampling fields that are None when a request leaves them out: the engine's defaults fill them.
_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty")
Stop = str | list[str] | None


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    """Fields shared by both endpoints; ``to_sampling_params`` turns them into SamplingParams."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None
    stop: Stop = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    priority: int = 0
    return_cache_details: bool = False  # pagedkv's: usage.prompt_tokens_details.cache_details
    conversation_id: str | None = Field(default=None, min_length=1, max_length=256)  # pagedkv's: pinning
    pin_ttl_s: float | None = Field(default=None, gt=0)
    include_stop_str_in_output: bool = False  # vLLM's extras
    skip_special_tokens: bool = True
    speculative: bool = True  # pagedkv's: false opts out of the server's speculative decoding
    kv_cache_dtype: str | None = Field(default=None, min_length=1)  # pagedkv's: e.g. float32 = full-precision KV
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    logit_bias: dict[str, float] | None = None  # {"token id": bias in [-100, 100]}, keys as OpenAI sends them
    # Structured output: OpenAI's response_format (json_object, json_schema), vLLM's guided_* and
    # structured_outputs ({"json" | "regex" | "choice" | "json_object": ...}); at most one.
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    # Accepted at their neutral values only, so that a client relying on them hears it is not served.
    best_of: int | None = None
    tools: list[dict[str, Any]] | None = None

    def _reject_unsupported(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of is not supported (use n)", param="best_of")
        if self.tools and not isinstance(self, ChatCompletionRequest):
            raise bad_request("tools are served by /v1/chat/completions, not completions", param="tools")

    def _structured_source(self) -> tuple[str, dict[str, Any]] | None:
        """(the field, StructuredOutput's arguments) of the request's structured output, if any; a
        400 naming the field when two are given or response_format has a bad shape."""
        given: list[tuple[str, dict[str, Any]]] = []  # (field, StructuredOutput's arguments)
        rf = self.response_format
        kind = rf.get("type", "text") if rf else "text"
        if kind == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = rf.get("json_schema") if rf else None
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise bad_request("response_format json_schema must be an object with a \"schema\" object",
                                  param="response_format")
            given.append(("response_format", {"json": spec["schema"]} if spec.get("schema") else
                          {"json_object": True}))
        elif kind != "text":
            raise bad_request(f"response_format type must be text, json_object or json_schema, got {kind!r}",
                              param="response_format")
        for name, arg in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice")):
            if getattr(self, name) is not None:
                given.append((name, {arg: getattr(self, name)}))
        if self.structured_outputs:
            given.append(("structured_outputs", dict(self.structured_outputs)))
        if len(given) > 1:
            raise bad_request(f"give at most one of response_format, guided_json, guided_regex, guided_choice "
                              f"and structured_outputs (got {given[0][0]} and {given[1][0]})", param=given[1][0])
        return given[0] if given else None

    @property
    def grammar_param(self) -> str:
        """The field a 400 about the request's grammar names (its compile, server/serving.py):
        the one that gave it; a chat request's forced tool call comes from tool_choice."""
        source = self._structured_source()
        return source[0] if source is not None else "tool_choice"

    def _structured_output(self) -> StructuredOutput | None:
        """The request's structured output, its shape checked (a 400 naming the field otherwise).
        Its grammar is compiled later, off the event loop and within the engine's limits."""
        source = self._structured_source()
        if source is None:
            return None
        name, args = source
        try:
            return StructuredOutput(**args)
        except (TypeError, ValueError) as exc:  # an unknown key, a bad shape
            raise bad_request(f"{name}: {excerpt(str(exc))}", param=name) from exc

    def _params(self, max_tokens: int | None, logprobs: int | None,
                prompt_logprobs: int | None = None, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """``defaults`` (the engine's generation_config defaults, SamplingParams' names) fill the
        sampling fields the request left out; SamplingParams' own defaults fill the rest."""
        self._reject_unsupported()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        chosen: dict[str, Any] = {}
        for name in _DEFAULTABLE:
            value = getattr(self, name)
            value = (defaults or {}).get(name) if value is None else value
            if value is not None:
                chosen[name] = value
        try:
            return SamplingParams(
                n=self.n,
                max_tokens=max_tokens,
                **chosen,
                # OpenAI's string keys: SamplingParams reads them as token ids (its error names logit_bias)
                logit_bias=self.logit_bias,  # type: ignore[arg-type]
                seed=self.seed,
                stop=tuple(stop),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                min_tokens=self.min_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                structured_output=self._structured_output(),
                speculative=self.speculative,
                kv_cache_dtype=self.kv_cache_dtype,
            )
        except ValueError as exc:
            # SamplingParams names the field first: "top_p must be in ...".
            raise bad_request(str(exc), param=str(exc).split(" ", 1)[0]) from exc

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: prompt is a string, a token-id list, or a list of either."""

    prompt: str | list[str] | list[NonNegInt] | list[list[NonNegInt]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one engine request each."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [cast(list[int], list(p))]  # one token-id prompt
        return cast(list[str | list[int]], list(p))

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """``defaults``: see ``_params`` (its max_tokens replaces 16 when the request has none)."""
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        # echo + logprobs: the prompt tokens' logprobs come first, as OpenAI's legacy API does.
        prompt_logprobs = self.logprobs if self.echo else None
        max_tokens = (self.max_tokens if "max_tokens" in self.model_fields_set
                      else (defaults or {}).get("max_tokens", self.max_tokens))
        return self._params(max_tokens, self.logprobs, prompt_logprobs, defaults)


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # Tool calling and reasoning in the history (server/tools/request.py's template_messages)
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None  # legacy
    reasoning_content: str | None = None  # vLLM's older name
    reasoning: str | None = None  # vLLM's current name

    def text(self) -> str:
        """The message text; content parts must all be ``{"type": "text", "text": ...}``."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        pieces = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request("only text content parts are supported", param="messages")
            pieces.append(part["text"])
        return "".join(pieces)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's extras
    chat_template_kwargs: dict[str, Any] | None = None
    # Tools (server/tools/request.py checks them; the legacy functions fields map onto them)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    _tools: Any = PrivateAttr(default=None)
    SERVED_FIELDS: ClassVar[frozenset[str]] = frozenset({"tool_choice", "functions", "function_call"})

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template expects them (tool calls, tool results, reasoning)."""
        from pagedkv.server.tools.request import template_messages
        return template_messages(self.messages)

    @property
    def tool_request(self) -> Any:
        """The request's tools, checked (server/tools/request.py's ToolRequest); a 400 naming the field."""
        if self._tools is None:
            from pagedkv.server.tools.request import parse_tool_request
            self._tools = parse_tool_request(self.tools, self.tool_choice, self.functions, self.function_call,
                                             self.parallel_tool_calls)
        return self._tools

    def template_kwargs(self) -> dict[str, Any] | None:
        """``chat_template_kwargs`` with the tools the template shows the model (when there are any)."""
        tools = self.tool_request.tools
        return {**(self.chat_template_kwargs or {}), "tools": tools} if tools else self.chat_template_kwargs

    def _structured_output(self) -> StructuredOutput | None:
        given = super()._structured_output()
        forced = self.tool_request.forced_output()  # a required or named call: its schema
        if forced is not None and given is not None:
            raise bad_request("a required or named tool_choice constrains the output already: drop "
                              "response_format (or the guided_* field)", param="tool_choice")
        return forced or given

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """``defaults``: see ``_params`` (its max_tokens replaces "the rest of the context")."""
        self.tool_request  # noqa: B018 - tool errors first, as a 400 naming their field
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is None:
            max_tokens = (defaults or {}).get("max_tokens")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, logprobs, defaults=defaults)


class TokenizeRequest(_Body):
    """``POST /tokenize`` (vLLM's shape): a ``prompt`` (with the tokenizer's special tokens unless
    ``add_special_tokens`` is false), or chat ``messages`` (the chat path: the template's text,
    no special tokens added, unless ``add_special_tokens`` is true)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give exactly one of prompt and messages", param="prompt")


class DetokenizeRequest(_Body):
    """``POST /detokenize`` (vLLM's shape)."""

    model: str | None = None
    tokens: list[NonNegInt]


Body = TypeVar("Body", bound=BaseModel)


def parse_body(raw: bytes, model: type[Body]) -> Body:
    """Decode and validate a JSON body; every failure is a 400 naming the offending field.

    Besides malformed JSON, a 400 answers text with a lone UTF-16 surrogate (``"\\ud800"``: not
    Unicode, no tokenizer can take it), nesting too deep to parse, and numbers Python refuses.
    """
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, an int of > 4300 digits
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    except RecursionError as exc:
        raise bad_request("request body is nested too deeply", code="invalid_json") from exc
    if not isinstance(obj, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(raw):  # only an escape can put a surrogate into a str
        _reject_lone_surrogates(obj)
    if issubclass(model, _SamplingFields):
        reject_unsupported_fields(obj, getattr(model, "SERVED_FIELDS", frozenset()))
    try:
        return model.model_validate(_messages_in_slices(obj, model))
    except RecursionError as exc:
        raise bad_request("request body is nested too deeply", code="invalid_json") from exc
    except (ValidationError, _SliceError) as exc:
        first = exc.first if isinstance(exc, _SliceError) else exc.errors()[0]
        loc = ".".join(str(x) for x in first["loc"] if not _is_union_tag(x))
        message = f"{loc}: {first['msg']}" if loc else first["msg"]
        if first["loc"] and first["loc"][0] == "prompt" and first["type"] != "missing":
            loc, message = "prompt", _PROMPT_TYPES
        raise bad_request(message, param=loc or None) from exc


_SLICE = 2000  # chat messages validated per call


class _SliceError(Exception):
    """A message of a slice failed validation; ``first`` is its error, located in the body."""

    def __init__(self, first: Any) -> None:
        super().__init__(first["msg"])
        self.first = first


def _messages_in_slices(obj: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    """``obj`` with a long ``messages`` list validated _SLICE messages per call: 100,000 messages
    in one validation call hold the GIL for over a second, and with it the event loop (parsing a
    large body runs in a worker thread, server/heavy_work.py). The model then takes the
    validated message objects as they are."""
    messages = obj.get("messages")
    field = model.model_fields.get("messages")
    if field is None or not isinstance(messages, list) or len(messages) <= _SLICE:
        return obj
    # the annotation (a type, hashable) keys _adapter's cache; pydantic types it TypeForm | None
    adapter = _adapter(field.annotation)  # type: ignore[arg-type]
    out: list[Any] = []
    for start in range(0, len(messages), _SLICE):
        try:
            out.extend(adapter.validate_python(messages[start:start + _SLICE]))
        except ValidationError as exc:
            for error in exc.errors():
                loc = [x for x in error["loc"] if not _is_union_tag(x)]  # (list[...] | None names its member)
                if loc and isinstance(loc[0], int):
                    raise _SliceError({**error, "loc": ("messages", start + loc[0], *loc[1:])}) from exc
            raise
    return {**obj, "messages": out}


@functools.lru_cache(maxsize=8)
def _adapter(annotation: Any) -> TypeAdapter:
    return TypeAdapter(annotation)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _reject_lone_surrogates(obj: Any) -> None:
    """400 if any string (key or value) holds a surrogate that is not half of a pair (json.loads
    joins the pairs, so any surrogate left is a lone one). Iterative: depth is no problem."""
    stack = [(obj, "")]
    while stack:
        x, path = stack.pop()
        if isinstance(x, dict):
            for k, v in x.items():
                stack.append((k, path))
                stack.append((v, f"{path}.{k}" if path else str(k)))
        elif isinstance(x, list):
            stack.extend((v, path) for v in x if isinstance(v, (str, dict, list)))
        elif isinstance(x, str) and _SURROGATE.search(x):
            raise bad_request("text must be valid Unicode: it holds a lone UTF-16 surrogate (\\ud800-\\udfff)",
                              param=path.split(".", 1)[0] or None, code="invalid_unicode")


_PROMPT_TYPES = ("prompt must be a string, a list of strings, a list of token ids (integers >= 0) "
                 "or a list of token-id lists")


def _is_union_tag(x: object) -> bool:
    # Pydantic names union members in error locations ("prompt.list[int].0"); drop those tags.
    return isinstance(x, str) and ("[" in x or x in ("str", "int", "float", "bool"))
