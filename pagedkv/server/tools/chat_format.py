"""Chat responses with tool calls and reasoning: ``ChatFormat`` with a parse step per choice.

Each choice's text goes through one pipeline, fed as it grows (streamed) or at once (full):

    text -> ReasoningStream (reasoning | rest) -> ToolCallStream / NamedCallStream (content | calls)

so a full answer is exactly what its stream's deltas add up to. A choice that made calls
finishes with ``finish_reason: "tool_calls"`` (unless it was cut by max_tokens: "length").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.server.responses import ChatFormat, Json
from pagedkv.server.tools.json_scan import partial_suffix
from pagedkv.server.tools.parsers import CallDelta, NamedCallStream, StreamDelta, ToolCallStream
from pagedkv.server.tools.reasoning import ReasoningParser, ReasoningStream


@dataclass(slots=True)
class _Pipeline:
    reasoning: ReasoningStream | None
    calls: ToolCallStream | NamedCallStream | None
    strip: tuple[str, ...] = ()  # special-token texts that are markers' neighbours, not content (EOS)
    had_reasoning: bool = False
    held: str = ""  # the end of the text that may be the start of a ``strip`` text

    def _unstripped(self, piece: str, final: bool) -> str:
        text = self.held + piece
        keep = 0 if final else max(partial_suffix(text, s) for s in self.strip)
        text, self.held = text[:len(text) - keep], text[len(text) - keep:]
        for s in self.strip:
            text = text.replace(s, "")
        return text

    def feed(self, piece: str, final: bool) -> StreamDelta:
        if self.strip:
            piece = self._unstripped(piece, final)
        out = StreamDelta()
        rest = piece
        if self.reasoning is not None:
            r1, rest = self.reasoning.feed(piece)
            if final:
                r2, c2 = self.reasoning.finish()
                r1, rest = r1 + r2, rest + c2
            out.reasoning = r1
            self.had_reasoning = self.reasoning.had_reasoning
        if self.calls is None:
            out.content = rest
            return out
        d = self.calls.feed(rest)
        out.content, out.calls = d.content, d.calls
        if final:
            d = self.calls.finish()
            out.content += d.content
            out.calls += d.calls
        return out

    @property
    def num_calls(self) -> int:
        return self.calls.num_calls if self.calls is not None else 0


class ToolChatFormat(ChatFormat):
    """``ChatFormat`` whose choices and deltas carry ``tool_calls`` and ``reasoning_content``.

    ``new_calls``: a fresh call parser per choice (None: no tool parsing); ``reasoning``: the
    reasoning parser (None: none); ``strip``: texts removed before parsing (see _Pipeline)."""

    def __init__(self, num_top_logprobs: int = 0, *,
                 new_calls: Callable[[], ToolCallStream | NamedCallStream] | None = None,
                 reasoning: ReasoningParser | None = None, strip: tuple[str, ...] = ()) -> None:
        super().__init__(num_top_logprobs)
        self.new_calls, self.reasoning, self.strip = new_calls, reasoning, strip
        self._pipelines: dict[int, _Pipeline] = {}

    def _pipeline(self, index: int) -> _Pipeline:
        p = self._pipelines.get(index)
        if p is None:
            p = self._pipelines[index] = _Pipeline(
                self.reasoning.stream() if self.reasoning is not None else None,
                self.new_calls() if self.new_calls is not None else None, self.strip)
        return p

    @staticmethod
    def _finish_reason(p: _Pipeline, finish_reason: str | None) -> str | None:
        return "tool_calls" if finish_reason == "stop" and p.num_calls else finish_reason

    def choice(self, index: int, text: str, logprobs: Json | None, finish_reason: str | None) -> Json:
        p = _Pipeline(self.reasoning.stream() if self.reasoning is not None else None,
                      self.new_calls() if self.new_calls is not None else None, self.strip)
        d = p.feed(text, final=True)
        message: Json = {"role": "assistant", "content": d.content if d.content or not d.calls else None}
        if p.had_reasoning:
            message["reasoning_content"] = message["reasoning"] = d.reasoning
        if d.calls:
            calls: list[Json] = []
            for c in d.calls:
                if c.id is not None:
                    calls.append({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}})
                calls[c.index]["function"]["arguments"] += c.arguments
            message["tool_calls"] = calls
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": self._finish_reason(p, finish_reason)}

    def delta(self, index: int, text: str, logprobs: Json | None, finish_reason: str | None) -> Json | None:
        p = self._pipeline(index)
        d = p.feed(text, final=finish_reason is not None)
        delta: Json = {}
        if d.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = d.reasoning
        if d.content:
            delta["content"] = d.content
        if d.calls:
            delta["tool_calls"] = [c.to_json() for c in _merged(d.calls)]
        if not delta and finish_reason is None and logprobs is None:
            return None  # held back (a marker may be arriving): no chunk
        return {"index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": self._finish_reason(p, finish_reason)}


def _merged(calls: list[CallDelta]) -> list[CallDelta]:
    """One entry per call index (a feed may add a header and, later, fragments of one call)."""
    out: list[CallDelta] = []
    for c in calls:
        if out and out[-1].index == c.index:
            out[-1].arguments += c.arguments
            if c.id is not None:
                out[-1].id, out[-1].name = c.id, c.name
        else:
            out.append(CallDelta(c.index, c.id, c.name, c.arguments))
    return out
