"""A test-only way to make a (tiny, random) model write a given text: each request without a
structured output of its own gets a "grammar" that allows exactly the next token of its script,
then EOS. It uses the engine's structured-output seam (a state with ``fill_bitmask``/``accept``),
so the text goes through the real sampler, detokenizer and server; nothing ships in the package.

    writer = ScriptedWriter(engine)
    writer.scripts.append('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


class _Script:
    __slots__ = ("tokens", "pos", "eos")

    def __init__(self, tokens: list[int], eos: int, pos: int = 0) -> None:
        self.tokens, self.eos, self.pos = tokens, eos, pos

    def fill_bitmask(self, out: torch.Tensor) -> torch.Tensor:
        token = self.tokens[self.pos] if self.pos < len(self.tokens) else self.eos
        out.zero_()
        bit = 1 << (token % 32)
        out[token // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 words
        return out

    def accept(self, token: int) -> None:
        expected = self.tokens[self.pos] if self.pos < len(self.tokens) else self.eos
        assert token == expected, (token, expected)
        self.pos += 1

    @property
    def is_complete(self) -> bool:
        return self.pos >= len(self.tokens)

    def fork(self) -> _Script:
        return _Script(self.tokens, self.eos, self.pos)


class ScriptedWriter:
    """Install on ``engine``: requests take the texts of ``scripts`` in order (none left: free
    sampling); a request with its own structured output (a forced tool call) keeps its grammar."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.scripts: deque[str] = deque()
        original = engine._start_grammar
        tokenizer = engine.tokenizer
        self.eos = min(engine.outputs.eos_token_ids)

        def start(params: Any, beam_width: int) -> Any:
            if params.structured_output is not None or not self.scripts:
                return original(params, beam_width)
            ids = tokenizer.encode(self.scripts.popleft(), add_special_tokens=False)
            return _Script(ids, self.eos)

        engine._start_grammar = start


HERMES = Path("examples/tool_chat_template_hermes.jinja").read_text(encoding="utf-8")


@contextmanager
def hermes_tool_server(folder: Path) -> Iterator[Any]:
    """A tiny model behind a ServerThread that serves tools with the shipped Hermes template and
    the hermes parser; ``server.writer`` (a ScriptedWriter) makes the model write a given text."""
    from pagedkv.server.tools.request import ToolOptions
    from pagedkv_testing.server import ServerThread, tiny_engine
    from pagedkv_testing.tiny_model import write_tiny_model

    engine = tiny_engine(write_tiny_model(folder, max_position_embeddings=4096), num_kv_blocks=1200, seed=0)
    engine.tokenizer.set_chat_template(HERMES)
    writer = ScriptedWriter(engine)
    with ServerThread(engine, served_model_names=["m"], tool_options=ToolOptions(True, "hermes", None)) as srv:
        srv.writer = writer  # type: ignore[attr-defined]  # this fixture's server carries its writer
        yield srv
        writer.scripts.clear()
