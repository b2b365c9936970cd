"""``pagedkv chat``: a conversation with a model in the terminal (``ollama run``, ``llama-cli -cnv``).

Each turn renders the whole conversation with the model's chat template and streams the reply as
it is generated. The engine stays up between turns, so the conversation so far is a cached prefix:
a turn computes only its new tokens (``/stats`` shows how many were found in the cache).

    /reset   forget the conversation (the system message stays)
    /stats   the conversation's tokens, the last reply's speed, the KV cache's state
    /exit    leave (also /quit, Ctrl-D); Ctrl-C stops a reply, and at the prompt leaves
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

HELP = "commands: /reset (forget the conversation), /stats, /exit (or Ctrl-D); Ctrl-C stops a reply"
PROMPT = ">>> "


def add_chat_parser(subparsers) -> None:
    from pagedkv.engine.flags import add_engine_arguments

    p = subparsers.add_parser("chat", help="chat with a model in the terminal",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder, .gguf file or repo id (default: bundled model)")
    p.add_argument("--system", default=None, help="a system message that starts the conversation")
    g = p.add_argument_group("sampling (defaults: the model's generation_config.json, else these)")
    g.add_argument("--max-tokens", type=int, default=None, help="most tokens per reply (default 512)")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 0.7)")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="seed of the sampling")
    add_engine_arguments(p.add_argument_group("engine"), exclude=("seed",))
    p.set_defaults(func=run_chat)


@dataclass(slots=True)
class LastReply:
    tokens: int = 0
    first_token_s: float = 0.0
    seconds: float = 0.0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None


@dataclass(slots=True)
class Conversation:
    """The messages so far (the system message first, if any) and the last reply's figures."""

    system: str | None
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: int = 0
    last: LastReply | None = None

    def reset(self) -> None:
        self.messages, self.turns, self.last = [], 0, None

    def with_user(self, text: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages + [{"role": "user", "content": text}]


def run_chat(args: argparse.Namespace) -> int:
    from pagedkv.engine import LLMEngine
    from pagedkv.engine.flags import engine_options
    from pagedkv.sampling_params import SamplingParams

    engine = LLMEngine.from_options(args.model, **engine_options(args))
    try:
        chosen = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                  "top_k": args.top_k, "seed": args.sampling_seed}
        params = SamplingParams(**{"max_tokens": 512, "temperature": 0.7, **engine.generation_defaults,
                                   **{k: v for k, v in chosen.items() if v is not None}})
        return ChatSession(engine, params, Conversation(args.system)).run(sys.stdin, sys.stdout)
    finally:
        engine.close()


class ChatSession:
    """Reads lines, runs turns on ``engine``, streams replies to ``out``."""

    def __init__(self, engine: Any, params: Any, conversation: Conversation) -> None:
        self.engine, self.params, self.conv = engine, params, conversation
        self._ids = itertools.count()

    def run(self, stdin: TextIO, out: TextIO) -> int:
        if stdin.isatty():
            try:
                import readline  # noqa: F401 - line editing and history for input()
            except ImportError:
                pass
        print(f"pagedkv chat with {self.engine.model_name}; {HELP}", file=out, flush=True)
        while True:
            try:
                line = input(PROMPT) if stdin is sys.stdin else _read(stdin, out)
            except (EOFError, KeyboardInterrupt):
                print(file=out)
                return 0
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit", "/bye"):
                return 0
            if text == "/reset":
                self.conv.reset()
                print("(conversation cleared)", file=out, flush=True)
            elif text == "/stats":
                print(self.stats_text(), file=out, flush=True)
            elif text.startswith("/") and " " not in text:
                print(f"unknown command {text}; {HELP}", file=out, flush=True)
            else:
                self.turn(text, out)

    def turn(self, text: str, out: TextIO) -> None:
        """One exchange: the reply streams to ``out`` and joins the conversation (a reply stopped
        with Ctrl-C joins as far as it got)."""
        messages = self.conv.with_user(text)
        prompt = self.engine.tokenizer.encode_chat(messages, add_generation_prompt=True)
        rid = f"chat-{next(self._ids)}"
        self.engine.add_request(rid, prompt, self.params)
        shown, last = "", LastReply(prompt_tokens=len(prompt))
        start = time.monotonic()
        try:
            finished = False
            while not finished:
                for output in self.engine.step():
                    if output.request_id != rid:
                        continue
                    completion = output.outputs[0]
                    if completion.token_ids and not last.first_token_s:
                        last.first_token_s = time.monotonic() - start
                    if completion.text.startswith(shown) and len(completion.text) > len(shown):
                        print(completion.text[len(shown):], end="", file=out, flush=True)
                        shown = completion.text
                    last.tokens, last.cached_tokens = len(completion.token_ids), output.num_cached_tokens
                    last.finish_reason, finished = completion.finish_reason, output.finished
                if not finished and not self.engine.has_unfinished_requests():
                    break
        except KeyboardInterrupt:
            self.engine.abort_request(rid)
            last.finish_reason = "interrupted"
            print(" [stopped]", end="", file=out)
        print(file=out, flush=True)
        last.seconds = time.monotonic() - start
        self.conv.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": shown}]
        self.conv.turns += 1
        self.conv.last = last

    def stats_text(self) -> str:
        s = self.engine.stats()
        kv = s.kv
        lines = [f"conversation: {self.conv.turns} turn(s), {len(self.conv.messages)} message(s)"]
        last = self.conv.last
        if last is not None:
            decode_s = max(last.seconds - last.first_token_s, 1e-9)
            rate = (last.tokens - 1) / decode_s if last.tokens > 1 else 0.0
            lines.append(f"last reply: {last.tokens} tokens ({last.finish_reason}), first token after "
                         f"{last.first_token_s:.2f} s, {rate:.1f} tokens/s; its prompt: {last.prompt_tokens} "
                         f"tokens, {last.cached_tokens} of them cached")
        lines.append(f"KV cache: {kv.used_blocks}/{kv.num_blocks} blocks in use ({kv.block_size} tokens each), "
                     f"{kv.cached_blocks} holding cached prefixes; prefix hits {kv.prefix_hit_tokens}/"
                     f"{kv.prefix_query_tokens} prompt tokens")
        return "\n".join(lines)


def _read(stdin: TextIO, out: TextIO) -> str:
    """``input()`` for a stream other than sys.stdin (tests drive a session through pipes)."""
    print(PROMPT, end="", file=out, flush=True)
    line = stdin.readline()
    if not line:
        raise EOFError
    return line
