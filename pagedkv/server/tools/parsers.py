"""Tool-call parsers: the calls a model wrote in its text, taken out as OpenAI ``tool_calls``.

Each model family writes calls its own way (vLLM's ``--tool-call-parser`` names):

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call>   Qwen2.5/3, Hermes, SmolLM3,
                                                                            examples/tool_chat_template_hermes.jinja
    llama3_json  {"name": "f", "parameters": {...}}  (the whole answer; <|python_tag|> optional;
                 several separated by ";")                                  Llama 3.1-3.3
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]  or  [TOOL_CALLS]f[ARGS]{...}
    pythonic     [f(a=1, b="x"), g()]  (the whole answer)                   Llama 3.2 / 4, examples/*pythonic*
    deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```
                 <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>  (V3.1's "f<｜tool▁sep｜>{...}" too)

A parser answers two questions about the text so far: where the calls start (:meth:`ToolParser.locate`;
the text before is content) and which calls the region from there holds (:meth:`ToolParser.parse`,
called again as the text grows). :class:`ToolCallStream` turns those answers into OpenAI's streamed
deltas (a call's id and name once known, then its arguments as they arrive); a full response is
the same stream fed at once, so the streamed deltas always add up to the non-streamed answer.

The arguments are the JSON text the model wrote (checked to be an object), not a re-serialization,
which is what lets them stream. A region that stops being calls (``<tool_call>not json``) is
content from there on, as is a call cut off before its name and arguments began; a call already
streamed when the text breaks stays as it was sent.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
from dataclasses import dataclass, field

from pagedkv.server.tools.json_scan import Member, NotJSON, partial_suffix, scan_object, scan_value, skip_ws

_ARG_KEYS = ("arguments", "parameters")
_ID_ALPHABET = string.ascii_letters + string.digits


@dataclass(slots=True)
class PartialCall:
    """One call as far as the text goes. ``name`` is None until it is known (and its arguments
    have begun, so that a JSON answer with a "name" key is not mistaken for a call too early);
    ``arguments`` only grows by appending while ``complete`` is False."""

    start: int  # offset in the region where the call's text begins
    name: str | None
    arguments: str
    complete: bool
    stream_arguments: bool = True  # False: the arguments are sent once complete (decoded from a string)


@dataclass(slots=True)
class RegionParse:
    calls: list[PartialCall]
    bad_at: int | None = None  # offset in the region from which the text is content, not calls
    extra: str = ""  # text between or after the calls (content, sent when the answer ends)


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str

    def to_json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolParser:
    """One family's call syntax. Subclasses set ``name`` and implement ``locate`` and ``parse``."""

    name = ""
    id_length = 24  # OpenAI's ids are call_ + 24 characters; Mistral's templates want 9 alphanumerics
    skip_special_tokens = True  # False: the markers are special tokens that decoding must keep
    # Where scans of the growing region stopped (json_scan's ``resume``): set by each ToolCallStream,
    # so a long call is scanned once in all rather than once per token.
    resume: dict | None = None

    def locate(self, text: str) -> tuple[int | None, int]:
        """(offset where the calls begin, None if not yet; how much of ``text`` is surely content)."""
        raise NotImplementedError

    def parse(self, region: str, final: bool) -> RegionParse:
        """The calls in ``region`` (the text from ``locate``'s offset); ``final``: no more text comes."""
        raise NotImplementedError

    def new_id(self) -> str:
        return new_call_id(self.id_length)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole answer at once: (content or None, calls)."""
        stream = ToolCallStream(self)
        deltas = [stream.feed(text), stream.finish()]
        content = "".join(d.content for d in deltas)
        calls: list[ToolCall] = []
        for d in deltas:
            for c in d.calls:
                if c.id is not None:
                    calls.append(ToolCall(c.id, c.name or "", ""))
                calls[c.index].arguments += c.arguments
        return content or None, calls


def new_call_id(length: int = 24) -> str:
    """OpenAI's ``call_`` + 24 letters and digits; a shorter length: that many alone (Mistral's 9)."""
    tail = "".join(secrets.choice(_ID_ALPHABET) for _ in range(length))
    return tail if length < 24 else f"call_{tail}"


class _MarkerParser(ToolParser):
    """Calls begin at a marker anywhere in the text."""

    marker = ""

    def locate(self, text: str) -> tuple[int | None, int]:
        at = text.find(self.marker)
        if at >= 0:
            return at, at
        return None, len(text) - partial_suffix(text, self.marker)


class _LeadingParser(ToolParser):
    """Calls are the whole answer: they begin with one of ``openers`` after leading whitespace."""

    openers: tuple[str, ...] = ()

    def locate(self, text: str) -> tuple[int | None, int]:
        start = skip_ws(text, 0)
        rest = text[start:]
        if not rest:
            return None, 0
        for opener in self.openers:
            if rest.startswith(opener):
                return start, start
        if any(opener.startswith(rest) for opener in self.openers):
            return None, 0
        return None, len(text)  # never calls: the text did not start with them


def _call_from_object(text: str, start: int, members: list[Member], end: int | None) -> PartialCall:
    """A call from a ``{"name": ..., "arguments": {...}}`` object (``parameters`` also read)."""
    name: str | None = None
    args: Member | None = None
    for m in members:
        if m.key == "name" and m.end is not None:
            name = json.loads(text[m.start:m.end])
            if not isinstance(name, str) or not name:
                raise NotJSON("a call's name must be a non-empty string")
        elif m.key in _ARG_KEYS:
            args = m
    complete = end is not None
    if args is None:
        if complete:
            raise NotJSON("a call needs its arguments")  # e.g. a JSON answer that has a "name" key
        return PartialCall(start, None, "", False)
    first = text[args.start:args.start + 1]
    if first not in ("", "{", '"'):
        raise NotJSON("arguments must be an object")
    if not first:  # the name waits for the arguments' first character: an object or a string
        return PartialCall(start, None, "", False)
    as_string = first == '"'  # arguments given as a JSON-encoded string
    if args.end is None:
        arguments = "" if as_string else text[args.start:]
    else:
        arguments = json.loads(text[args.start:args.end]) if as_string else text[args.start:args.end]
    if complete:
        _check_arguments(arguments)
        if name is None:
            raise NotJSON("a call needs a name")
    return PartialCall(start, name, arguments, complete, stream_arguments=not as_string)


def _check_arguments(arguments: object) -> None:
    if not isinstance(arguments, str):
        raise NotJSON("arguments must be an object")
    try:
        value = json.loads(arguments)
    except ValueError as exc:
        raise NotJSON(f"arguments are not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise NotJSON("arguments must be an object")


def _parse_object_call(region: str, j: int, calls: list[PartialCall], resume: dict | None) -> int | None:
    """Parse the call object at ``region[j]`` into ``calls``; its end, or None while it is open.
    A finished call is kept in ``resume``: the growing text never changes it."""
    done = resume.get(("call", j)) if resume is not None else None
    if done is not None:
        calls.append(done[0])
        return done[1]
    members, end = scan_object(region, j, resume)
    call = _call_from_object(region, j, members, end)
    calls.append(call)
    if end is not None and resume is not None:
        resume[("call", j)] = (call, end)
    return end


def _parse_array(region: str, j: int, calls: list[PartialCall], resume: dict | None) -> int | None:
    """``[{call}, {call}, ...]`` at ``region[j]``; the array's end, or None while it is open."""
    if region[j] != "[":
        raise NotJSON(f"expected '[' at {j}")
    k = skip_ws(region, j + 1)
    first = True
    while k < len(region):
        if region[k] == "]" and (first or not calls or calls[-1].complete):
            return k + 1
        if not first:
            if region[k] != ",":
                raise NotJSON(f"expected ',' at {k}")
            k = skip_ws(region, k + 1)
            if k >= len(region):
                return None
        end = _parse_object_call(region, k, calls, resume)
        if end is None:
            return None
        first = False
        k = skip_ws(region, end)
    return None


class HermesParser(_MarkerParser):
    name = "hermes"
    marker = "<tool_call>"
    close = "</tool_call>"

    def parse(self, region: str, final: bool) -> RegionParse:
        calls: list[PartialCall] = []
        extra: list[str] = []
        pos = 0
        while True:
            start = region.find(self.marker, pos)
            if start < 0:
                extra.append(region[pos:])
                break
            extra.append(region[pos:start])
            j = skip_ws(region, start + len(self.marker))
            if j >= len(region):
                calls.append(PartialCall(start, None, "", False))
                break
            try:
                end = _parse_object_call(region, j, calls, self.resume)
            except NotJSON:
                return RegionParse(calls, start, "".join(extra))
            calls[-1].start = start
            if end is None:
                break
            k = skip_ws(region, end)
            if region.startswith(self.close, k):
                pos = k + len(self.close)
            elif self.close.startswith(region[k:]):  # the closing tag still arriving, or left out at the end
                break
            else:
                pos = k  # no closing tag: lenient, what follows is the next call or content
        return RegionParse(calls, None, "".join(extra))


class Llama3JsonParser(_LeadingParser):
    name = "llama3_json"
    openers = ("<|python_tag|>", "{")

    def parse(self, region: str, final: bool) -> RegionParse:
        calls: list[PartialCall] = []
        pos = len("<|python_tag|>") if region.startswith("<|python_tag|>") else 0
        while True:
            j = skip_ws(region, pos)
            if j < len(region) and region[j] == ";":
                j = skip_ws(region, j + 1)
            if j >= len(region):
                break
            if region[j] != "{":
                return RegionParse(calls, j if calls else 0)
            try:
                end = _parse_object_call(region, j, calls, self.resume)
            except NotJSON:
                return RegionParse(calls, j if calls else 0)
            if end is None:
                break
            pos = end
        return RegionParse(calls)


class MistralParser(_MarkerParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    id_length = 9
    skip_special_tokens = False
    _NAME = re.compile(r"[A-Za-z0-9_.\-]*")

    def parse(self, region: str, final: bool) -> RegionParse:
        calls: list[PartialCall] = []
        pos = 0
        while region.startswith(self.marker, pos):
            start = pos
            j = skip_ws(region, pos + len(self.marker))
            if j >= len(region):
                break
            try:
                if region[j] == "[":  # [TOOL_CALLS][{...}, {...}]
                    end = _parse_array(region, j, calls, self.resume)
                else:  # [TOOL_CALLS]name[ARGS]{...} (the tokenizer v11+ format)
                    end = self._parse_named(region, j, calls)
                    calls[-1].start = start
            except NotJSON:
                return RegionParse(calls, start)
            if end is None:
                return RegionParse(calls)
            pos = skip_ws(region, end)
        return RegionParse(calls, None, region[pos:])

    def _parse_named(self, region: str, j: int, calls: list[PartialCall]) -> int | None:
        name = self._NAME.match(region, j)
        assert name is not None
        k = name.end()
        if k >= len(region) or "[ARGS]".startswith(region[k:]):
            calls.append(PartialCall(j, None, "", False))
            return None
        if not region.startswith("[ARGS]", k) or not name.group():
            raise NotJSON("expected a name and [ARGS]")
        a = skip_ws(region, k + len("[ARGS]"))
        if a >= len(region):
            calls.append(PartialCall(j, name.group(), "", False))
            return None
        if region[a] != "{":
            raise NotJSON("arguments must be an object")
        end = scan_value(region, a, self.resume)
        arguments = region[a:end] if end is not None else region[a:]
        if end is not None:
            _check_arguments(arguments)
        calls.append(PartialCall(j, name.group(), arguments, end is not None))
        return end


class RequiredCallsParser(ToolParser):
    """The output of a forced call (``tool_choice: "required"``): the grammar makes it
    ``[{"name": ..., "parameters": {...}}, ...]`` from the first token."""

    name = "required"

    def locate(self, text: str) -> tuple[int | None, int]:
        return 0, 0

    def parse(self, region: str, final: bool) -> RegionParse:
        calls: list[PartialCall] = []
        j = skip_ws(region, 0)
        if j >= len(region):
            return RegionParse(calls)
        try:
            end = _parse_array(region, j, calls, self.resume)
        except NotJSON:
            return RegionParse(calls, j if not calls else calls[-1].start)
        return RegionParse(calls, None, region[end:] if end is not None else "")


class PythonicParser(_LeadingParser):
    name = "pythonic"
    openers = ("<|python_start|>", "[")

    def parse(self, region: str, final: bool) -> RegionParse:
        body = region
        if body.startswith("<|python_start|>"):
            body = body[len("<|python_start|>"):]
        offset = len(region) - len(body)
        j = skip_ws(body, 0)
        if j >= len(body):
            return RegionParse([], 0 if final else None)
        end = _scan_python_list(body, j, self.resume)
        if end is None:  # a call list arrives whole; held back until it closes
            return RegionParse([], 0 if final else None)
        try:
            calls = [PartialCall(offset + j, name, args, True) for name, args in _python_calls(body[j:end])]
        except (SyntaxError, ValueError, TypeError):
            return RegionParse([], 0)
        rest = body[end:]
        if rest.lstrip().startswith("<|python_end|>"):
            rest = rest.lstrip()[len("<|python_end|>"):]
        return RegionParse(calls, None, rest)


_PY_STOP = re.compile(r"""['"()\[\]{}]""")
_PY_IN_STRING = {q: re.compile(r"[\\" + q + "]") for q in "'\""}


def _scan_python_list(text: str, i: int, resume: dict | None = None) -> int | None:
    """End of the Python list literal at ``text[i]`` (``[``), strings skipped; None while open
    (``resume``: as json_scan's, where the last scan of the shorter text stopped)."""
    if text[i] != "[":
        return None
    j, depth, quote = resume.get(("py", i), (i, 0, None)) if resume is not None else (i, 0, None)
    while True:
        if quote is not None:  # inside a string: find its end
            m = _PY_IN_STRING[quote].search(text, j)
            if m is None or (m.group() == "\\" and m.end() >= len(text)):
                j = m.start() if m is not None else len(text)
                break
            j = m.end() + (1 if m.group() == "\\" else 0)
            if m.group() == quote:
                quote = None
            continue
        m = _PY_STOP.search(text, j)
        if m is None:
            j = len(text)
            break
        c, j = m.group(), m.end()
        if c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return j
    if resume is not None:
        resume[("py", i)] = (j, depth, quote)
    return None


def _python_calls(source: str) -> list[tuple[str, str]]:
    """``[f(a=1), g(b="x")]`` -> [("f", '{"a": 1}'), ...]; literals only (nothing is evaluated)."""
    tree = ast.parse(source, mode="eval").body
    if not isinstance(tree, ast.List) or not tree.elts:
        raise ValueError("not a list of calls")
    out = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            raise ValueError("each element must be a call with keyword arguments")
        name = ast.unparse(node.func)
        if not re.fullmatch(r"[A-Za-z_][\w.\-]*", name):
            raise ValueError(f"bad function name {name!r}")
        args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
        out.append((name, json.dumps(args, ensure_ascii=False)))
    return out


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> object:
    """A Python literal, where JSON's ``true``, ``false`` and ``null`` are also read (models
    trained on JSON write them inside calls)."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values) if k is not None}
    return ast.literal_eval(node)


class DeepSeekV3Parser(_MarkerParser):
    name = "deepseek_v3"
    marker = "<｜tool▁calls▁begin｜>"
    skip_special_tokens = False
    CALL_BEGIN, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
    CALL_END, CALLS_END = "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"

    def parse(self, region: str, final: bool) -> RegionParse:
        calls: list[PartialCall] = []
        pos = len(self.marker)
        while True:
            j = skip_ws(region, pos)
            if region.startswith(self.CALLS_END, j):
                return RegionParse(calls, None, region[j + len(self.CALLS_END):])
            rest = region[j:]
            if not rest or self.CALL_BEGIN.startswith(rest) or self.CALLS_END.startswith(rest):
                return RegionParse(calls)
            if not rest.startswith(self.CALL_BEGIN):
                return RegionParse(calls, j)
            try:
                end = self._parse_call(region, j, calls)
            except NotJSON:
                return RegionParse(calls, j)
            if end is None:
                return RegionParse(calls)
            pos = end

    def _parse_call(self, region: str, j: int, calls: list[PartialCall]) -> int | None:
        k = j + len(self.CALL_BEGIN)
        sep = region.find(self.SEP, k)
        if sep < 0:
            if len(region) - k > 256:
                raise NotJSON("no tool separator")
            calls.append(PartialCall(j, None, "", False))
            return None
        head = region[k:sep]
        a = sep + len(self.SEP)
        if head == "function":  # V3: function<sep>NAME\n```json\n{...}\n```
            newline = region.find("\n", a)
            if newline < 0:
                calls.append(PartialCall(j, None, "", False))
                return None
            name = region[a:newline].strip()
            fence = "```json\n"
            b = newline + 1
            if len(region) - b < len(fence):
                if not fence.startswith(region[b:]):
                    raise NotJSON("expected ```json")
                calls.append(PartialCall(j, None, "", False))
                return None
            if not region.startswith(fence, b):
                raise NotJSON("expected ```json")
            a = b + len(fence)
        else:  # V3.1: NAME<sep>{...}
            name = head.strip()
        if not name:
            raise NotJSON("a call needs a name")
        a = skip_ws(region, a)
        if a >= len(region):
            calls.append(PartialCall(j, name, "", False))
            return None
        if region[a] != "{":
            raise NotJSON("arguments must be an object")
        end = scan_value(region, a, self.resume)
        if end is None:
            calls.append(PartialCall(j, name, region[a:], False))
            return None
        arguments = region[a:end]
        _check_arguments(arguments)
        calls.append(PartialCall(j, name, arguments, True))
        k = skip_ws(region, end)
        if region.startswith("```", k):
            k = skip_ws(region, k + 3)
        if region.startswith(self.CALL_END, k):
            return k + len(self.CALL_END)
        if self.CALL_END.startswith(region[k:]) or "```".startswith(region[k:]):
            return None if k < len(region) else len(region)
        raise NotJSON("expected the end of the call")


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser, DeepSeekV3Parser)
}
TOOL_PARSERS["llama4_pythonic"] = PythonicParser  # vLLM's name for Llama 4's


def tool_parser(name: str) -> ToolParser:
    """The parser named ``name``; ValueError listing the names otherwise."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        names = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {names}") from None


# --------------------------------------------------------------------------------------------------
# Streaming


@dataclass(slots=True)
class CallDelta:
    """One entry of ``delta.tool_calls``: the first for a call has its id and name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_json(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out |= {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        else:
            out["function"] = {"arguments": self.arguments}
        return out


@dataclass(slots=True)
class StreamDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)
    reasoning: str = ""

    def __bool__(self) -> bool:
        return bool(self.content or self.calls or self.reasoning)


class ContentTrim:
    """Content with its leading and trailing whitespace dropped, while it streams: trailing
    whitespace is held until more content follows it (calls leave newlines around them)."""

    __slots__ = ("started", "pending")

    def __init__(self) -> None:
        self.started = False
        self.pending = ""

    def __call__(self, piece: str) -> str:
        text = self.pending + piece
        if not self.started:
            text = text.lstrip()
            if not text:
                self.pending = ""
                return ""
            self.started = True
        kept = text.rstrip()
        self.pending = text[len(kept):]
        return kept


@dataclass(slots=True)
class _Sent:
    id: str
    args_len: int = 0


class ToolCallStream:
    """One choice's text, fed as it grows, split into content and OpenAI call deltas."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        parser.resume = {}  # the region only grows: scans resume where they stopped
        self.text = ""
        self.region: int | None = None  # where the calls begin
        self.sent_to = 0  # text[:sent_to] is handled (content sent, or the calls' region)
        self.bad: int | None = None  # text from here on is content
        self.sent: list[_Sent] = []
        self.trim = ContentTrim()

    @property
    def num_calls(self) -> int:
        return len(self.sent)

    def feed(self, piece: str) -> StreamDelta:
        self.text += piece
        return self._advance(final=False)

    def finish(self) -> StreamDelta:
        return self._advance(final=True)

    def _advance(self, final: bool) -> StreamDelta:
        out = StreamDelta()
        if self.region is None and self.bad is None:
            start, safe = self.parser.locate(self.text)
            if start is None:
                end = len(self.text) if final else safe
                out.content += self.trim(self.text[self.sent_to:end])
                self.sent_to = max(self.sent_to, end)
                return out
            out.content += self.trim(self.text[self.sent_to:start])
            self.region = self.sent_to = start
        if self.bad is None:
            assert self.region is not None
            parsed = self.parser.parse(self.text[self.region:], final)
            self._calls(parsed, final, out)
            if parsed.bad_at is not None:
                self.bad = self.sent_to = self.region + parsed.bad_at
            elif final:
                out.content += self.trim(parsed.extra)
                return out
        if self.bad is not None:
            out.content += self.trim(self.text[self.sent_to:])
            self.sent_to = len(self.text)
        return out

    def _calls(self, parsed: RegionParse, final: bool, out: StreamDelta) -> None:
        for i, call in enumerate(parsed.calls):
            if call.name is None or (final and not call.complete and i >= len(self.sent)):
                if final:  # cut off before it could be sent: its text is content
                    parsed.bad_at = call.start
                return
            delta = None
            if i >= len(self.sent):
                self.sent.append(_Sent(self.parser.new_id()))
                delta = CallDelta(i, self.sent[i].id, call.name)
            sent = self.sent[i]
            ready = call.arguments if call.complete or call.stream_arguments else ""
            if len(ready) > sent.args_len:
                delta = delta or CallDelta(i)
                delta.arguments = ready[sent.args_len:]
                sent.args_len = len(ready)
            if delta is not None:
                out.calls.append(delta)


class NamedCallStream:
    """The output of ``tool_choice: {"function": {"name": ...}}``: the grammar makes the whole
    text the function's arguments, so it streams as one call's argument fragments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.id = new_call_id()
        self.started = False

    @property
    def num_calls(self) -> int:
        return 1 if self.started else 0

    def feed(self, piece: str) -> StreamDelta:
        out = StreamDelta()
        if not self.started:
            self.started = True
            out.calls.append(CallDelta(0, self.id, self.name, piece))
        elif piece:
            out.calls.append(CallDelta(0, arguments=piece))
        return out

    def finish(self) -> StreamDelta:
        return self.feed("") if not self.started else StreamDelta()
