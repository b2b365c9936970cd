"""Reasoning parsers: a thinking model's ``<think>...</think>`` split from its answer.

``--reasoning-parser`` (vLLM's names):

    deepseek_r1  the text up to ``</think>`` is reasoning, with or without a ``<think>`` in the
                 output (DeepSeek-R1's template, and Qwen3's 2507 thinking ones, open the tag in
                 the prompt); an answer with no ``</think>`` is all reasoning (it was cut short)
    qwen3        reasoning only when the output opens with ``<think>`` (Qwen3 writes it itself;
                 with ``chat_template_kwargs: {"enable_thinking": false}`` it writes none, or an
                 empty pair, and the whole answer is content)

The reasoning goes out as ``reasoning`` (vLLM's current name) and ``reasoning_content`` (its
older one, which most clients read); tool calls and content are parsed from the text after
``</think>``. Streaming holds back a tail that may be the start of a tag, so a ``</think>`` split
across tokens is still found.
"""

from __future__ import annotations

from pagedkv.server.tools.json_scan import partial_suffix

START, END = "<think>", "</think>"


class ReasoningParser:
    name = ""
    needs_start_tag = False  # qwen3: no <think> at the start means no reasoning

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.needs_start_tag)

    def split(self, text: str) -> tuple[str | None, str]:
        """The whole answer at once: (reasoning or None, the rest)."""
        stream = self.stream()
        a, b = stream.feed(text), stream.finish()
        reasoning = a[0] + b[0]
        return (reasoning if stream.had_reasoning else None), a[1] + b[1]


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"


class Qwen3Parser(ReasoningParser):
    name = "qwen3"
    needs_start_tag = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1Parser, Qwen3Parser)}


def reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        names = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {names}") from None


class ReasoningStream:
    """One choice's text, fed as it grows: ``feed`` returns (reasoning, content) pieces."""

    def __init__(self, needs_start_tag: bool) -> None:
        self.needs_start_tag = needs_start_tag
        self.text = ""
        self.state = "start"  # start -> reasoning -> content (or start -> content)
        self.pos = 0  # text[:pos] is handled
        self.had_reasoning = False
        self.content_started = False

    def feed(self, piece: str) -> tuple[str, str]:
        self.text += piece
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning = ""
        if self.state == "start":
            body = self.text.lstrip()
            if body.startswith(START):
                self.pos = len(self.text) - len(body) + len(START)
                self.state = "reasoning"
            elif START.startswith(body) and body and not final:
                return "", ""  # maybe the tag, still arriving
            elif not body and not final:
                return "", ""
            else:
                self.state = "reasoning" if not self.needs_start_tag else "content"
        if self.state == "reasoning":
            self.had_reasoning = True
            end = self.text.find(END, self.pos)
            if end < 0:
                ready = len(self.text) if final else len(self.text) - partial_suffix(self.text, END)
                reasoning = self.text[self.pos:ready]
                self.pos = max(self.pos, ready)
                return reasoning, ""
            reasoning = self.text[self.pos:end]
            self.pos = end + len(END)
            self.state = "content"
        piece = self.text[self.pos:]
        self.pos = len(self.text)
        if not self.content_started and self.had_reasoning:  # the blank lines after </think>
            piece = piece.lstrip()
            if not piece:
                return reasoning, ""
        self.content_started = True
        return reasoning, piece
