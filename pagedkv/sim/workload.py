"""Simulated requests: lengths, token ids, shared prefixes, multi-turn chats and arrival times.

The workload itself (shape, count, sharing, arrivals) is a ``WorkloadConfig`` from
``pagedkv.workloads``, the definition the benchmarks use too. Here it becomes a list of
``Request`` in id order, built once from a seed and replayed unchanged against every memory
policy. Arrivals are either fixed (``arrival_step``, Poisson or all at once) or triggered by
another request's completion (``after`` + ``delay``: a closed-loop client, or the next turn of a
chat), so the trace is identical for every policy even when the timing is not.

Token ids are synthetic but deterministic, so prefix caching sees real sharing:

    prompt = [system prompt of prefix_id][user tokens, unique]            single turn
    prompt = [previous turn's prompt][previous turn's output][user tokens] multi-turn chat

and sample 0 of request ``r`` emits ``output_token(r, i)`` as its i-th token, which is exactly what
the next turn of the chat reads back in its prompt.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass
from pathlib import Path

from pagedkv.workloads import WorkloadConfig

_STREAM_STRIDE = 1 << 20  # tokens per output stream / shared prefix; lengths stay far below this
_PREFIX_BASE = 1 << 32
_OUTPUT_BASE = 1 << 40


def output_token(stream: int, index: int) -> int:
    """The ``index``-th generated token of output stream ``stream`` (deterministic, never a prompt id)."""
    return _OUTPUT_BASE + stream * _STREAM_STRIDE + index


def prefix_tokens(prefix_id: int, length: int) -> list[int]:
    """The shared system prompt ``prefix_id``: the same ``length`` ids for every request that uses it."""
    base = _PREFIX_BASE + prefix_id * _STREAM_STRIDE
    return list(range(base, base + length))


@dataclass(slots=True)
class Request:
    """One simulated request.

    ``num_seqs`` sequences run together: ``beam_width`` beams when ``beam_width > 1``, else ``n``
    parallel samples. The request arrives at ``arrival_step`` or, when ``after`` is set, ``delay`` steps
    after request ``after`` completes. Every sequence generates exactly ``output_len`` tokens.
    """

    req_id: int
    prompt: list[int]
    output_len: int
    n: int = 1
    beam_width: int = 1
    prefix_id: int | None = None
    arrival_step: int = 0
    after: int | None = None
    delay: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def num_seqs(self) -> int:
        return self.beam_width if self.beam_width > 1 else self.n

    @property
    def final_len(self) -> int:
        return len(self.prompt) + self.output_len


class _TokenCounter:
    """Hands out fresh prompt token ids (below every prefix and output id)."""

    __slots__ = ("next_id",)

    def __init__(self) -> None:
        self.next_id = 1

    def take(self, count: int) -> list[int]:
        start = self.next_id
        self.next_id += count
        return list(range(start, start + count))


def generate_workload(config: WorkloadConfig) -> list[Request]:
    """Build ``config.num_requests`` requests, reproducibly from ``config.seed``."""
    config.validate()
    rng = random.Random(config.seed)
    counter = _TokenCounter()
    requests: list[Request] = []
    conversation_ends: list[int] = []  # last request id of each conversation, for the closed loop
    clock = 0.0
    while len(requests) < config.num_requests:
        conv = len(conversation_ends)
        prefix_id = rng.randrange(config.num_prefixes) if config.prefix_len else None
        history = prefix_tokens(prefix_id, config.prefix_len) if prefix_id is not None else []
        for turn in range(config.turns):
            if len(requests) >= config.num_requests:
                break
            room = config.max_model_len - len(history) - 1  # keep >= 1 slot for output
            if room < 1:
                break
            prompt = history + counter.take(config.shape.prompt.sample(rng, room))
            output_len = config.shape.output.sample(rng, config.max_model_len - len(prompt))
            req = Request(len(requests), prompt, output_len, config.n, config.beam_width, prefix_id)
            if turn > 0:
                req.after, req.delay = req.req_id - 1, config.think_steps
            elif config.clients and conv >= config.clients:
                req.after, req.delay = conversation_ends[conv - config.clients], config.think_steps
            elif not config.clients and math.isfinite(config.rate):
                clock += rng.expovariate(config.rate)
                req.arrival_step = int(clock)
            requests.append(req)
            history = prompt + [output_token(req.req_id, i) for i in range(output_len)]
        conversation_ends.append(len(requests) - 1)
    return requests


def load_trace(path: str | Path, config: WorkloadConfig) -> list[Request]:
    """Requests from a CSV of ``prompt_len,output_len[,n,beam_width,prefix_id]`` rows.

    A header row is skipped when its first field is not a number; blank lines and lines starting with
    ``#`` are ignored. Arrivals follow ``config`` (rate or closed loop); ``prefix_id`` shares the first
    ``min(config.prefix_len, prompt_len - 1)`` prompt tokens with every row of the same id. Lengths are
    clipped so ``prompt_len + output_len <= config.max_model_len``. Bad rows raise ``ValueError`` with
    the line number.
    """
    config.validate()
    rng = random.Random(config.seed)
    counter = _TokenCounter()
    requests: list[Request] = []
    clock = 0.0
    with open(path, newline="") as handle:
        for line_no, row in enumerate(csv.reader(handle), start=1):
            fields = [f.strip() for f in row]
            if not fields or not fields[0] or fields[0].startswith("#"):
                continue
            if not requests and not _is_int(fields[0]):
                continue  # header
            try:
                values = [int(f) if f else None for f in fields]
            except ValueError:
                raise ValueError(f"--trace {path}:{line_no}: fields must be integers, got {row}") from None
            if len(values) < 2 or len(values) > 5 or values[0] is None or values[1] is None:
                raise ValueError(
                    f"--trace {path}:{line_no}: expected prompt_len,output_len[,n,beam_width,prefix_id]"
                )
            prompt_len, output_len = values[0], values[1]
            n = values[2] if len(values) > 2 and values[2] is not None else config.n
            beam = values[3] if len(values) > 3 and values[3] is not None else config.beam_width
            prefix_id = values[4] if len(values) > 4 else None
            if prompt_len < 1 or output_len < 1 or n < 1 or beam < 1:
                raise ValueError(f"--trace {path}:{line_no}: lengths, n and beam_width must be >= 1")
            prompt_len = min(prompt_len, config.max_model_len - 1)
            output_len = min(output_len, config.max_model_len - prompt_len)
            prompt = []
            if prefix_id is not None:
                prompt = prefix_tokens(prefix_id, min(config.prefix_len, prompt_len - 1))
            prompt += counter.take(prompt_len - len(prompt))
            req = Request(len(requests), prompt, output_len, n, beam, prefix_id)
            if config.clients:
                if req.req_id >= config.clients:
                    req.after, req.delay = req.req_id - config.clients, config.think_steps
            elif math.isfinite(config.rate):
                clock += rng.expovariate(config.rate)
                req.arrival_step = int(clock)
            requests.append(req)
    if not requests:
        raise ValueError(f"--trace {path}: no request rows")
    return requests


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True
