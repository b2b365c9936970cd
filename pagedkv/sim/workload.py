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

Tenants: a request may name a ``tenant`` (a trace's ``tenant`` column, or ``generate_tenant_workload``
from ``--tenant`` specs: each tenant its own arrivals, lengths and system prompt). Paged memory keeps
each tenant's prefix cache apart and applies its KV quota; requests naming none are tenant ``default``.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass
from pathlib import Path

from pagedkv.workloads import LengthDist, WorkloadConfig, parse_length_dist

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
    ``tenant`` (None: ``default``) owns its KV blocks: its prefix-cache salt and whose quota it uses.
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
    tenant: str | None = None

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


TRACE_COLUMNS = ("prompt_len", "output_len", "n", "beam_width", "prefix_id", "tenant", "arrival_step")


def load_trace(path: str | Path, config: WorkloadConfig) -> list[Request]:
    """Requests from a CSV trace, one request a row::

        prompt_len,output_len[,n,beam_width,prefix_id[,tenant[,arrival_step]]]

    Columns are in that order, unless a header row names them in another: a header holding only
    these names (``prompt_len`` and ``output_len`` required, the others optional, any order) maps
    the columns by name; any other header row (before the first request, a row whose
    ``prompt_len`` is not a number) is skipped, as are blank lines and lines starting with ``#``.
    Empty fields take their defaults. ``tenant`` is a name (none: tenant ``default``);
    ``arrival_step`` fixes the row's arrival step, otherwise arrivals follow ``config`` (rate or
    closed loop). ``prefix_id`` shares the first ``min(config.prefix_len, prompt_len - 1)`` prompt
    tokens with every row of the same id (rows of different tenants never share cached blocks all
    the same). Lengths are clipped so ``prompt_len + output_len <= config.max_model_len``. Bad rows
    raise ``ValueError`` with the line number.
    """
    config.validate()
    rng = random.Random(config.seed)
    counter = _TokenCounter()
    requests: list[Request] = []
    columns: tuple[str, ...] = TRACE_COLUMNS
    clock = 0.0
    with open(path, newline="") as handle:
        for line_no, row in enumerate(csv.reader(handle), start=1):
            fields = [f.strip() for f in row]
            if not any(fields) or fields[0].startswith("#"):
                continue
            where = f"--trace {path}:{line_no}"
            first = columns.index("prompt_len")
            if not requests and not _is_int(fields[first] if first < len(fields) else ""):
                columns = _header_columns(fields, where) or columns
                continue  # header
            if len(fields) > len(columns):
                raise ValueError(f"{where}: expected {_columns_text(columns)}, got {len(fields)} fields")
            raw = dict(zip(columns, fields))
            try:
                values = {k: int(v) for k, v in raw.items() if k != "tenant" and v}
            except ValueError:
                raise ValueError(f"{where}: fields other than tenant must be integers, got {row}") from None
            if "prompt_len" not in values or "output_len" not in values:
                raise ValueError(f"{where}: expected {_columns_text(columns)}")
            prompt_len, output_len = values["prompt_len"], values["output_len"]
            n = values.get("n", config.n)
            beam = values.get("beam_width", config.beam_width)
            prefix_id = values.get("prefix_id")
            arrival = values.get("arrival_step")
            if prompt_len < 1 or output_len < 1 or n < 1 or beam < 1:
                raise ValueError(f"{where}: lengths, n and beam_width must be >= 1")
            if arrival is not None and arrival < 0:
                raise ValueError(f"{where}: arrival_step must be >= 0, got {arrival}")
            prompt_len = min(prompt_len, config.max_model_len - 1)
            output_len = min(output_len, config.max_model_len - prompt_len)
            prompt = []
            if prefix_id is not None:
                prompt = prefix_tokens(prefix_id, min(config.prefix_len, prompt_len - 1))
            prompt += counter.take(prompt_len - len(prompt))
            req = Request(len(requests), prompt, output_len, n, beam, prefix_id,
                          tenant=raw.get("tenant") or None)
            if arrival is not None:
                req.arrival_step = arrival
            elif config.clients:
                if req.req_id >= config.clients:
                    req.after, req.delay = req.req_id - config.clients, config.think_steps
            elif math.isfinite(config.rate):
                clock += rng.expovariate(config.rate)
                req.arrival_step = int(clock)
            requests.append(req)
    if not requests:
        raise ValueError(f"--trace {path}: no request rows")
    return requests


def _header_columns(fields: list[str], where: str) -> tuple[str, ...] | None:
    """The columns a header row names, or None for a header to skip (the positional order holds).

    A header naming ``tenant`` or ``arrival_step`` must name only known columns (a typo would
    otherwise shift every column silently)."""
    names = tuple(f.lower() for f in fields)
    known = set(TRACE_COLUMNS)
    if names == TRACE_COLUMNS[:len(names)]:
        return TRACE_COLUMNS  # the positional order: rows may still have the later columns
    if set(names) <= known and {"prompt_len", "output_len"} <= set(names) and len(set(names)) == len(names):
        return names
    if {"tenant", "arrival_step"} & set(names):
        unknown = [n for n in names if n not in known]
        problem = f"unknown columns {unknown}" if unknown else "prompt_len and output_len, each once, are required"
        raise ValueError(f"{where}: header {list(fields)}: {problem}; columns: {', '.join(TRACE_COLUMNS)}")
    return None


def _columns_text(columns: tuple[str, ...]) -> str:
    if columns == TRACE_COLUMNS:
        return "prompt_len,output_len[,n,beam_width,prefix_id[,tenant[,arrival_step]]]"
    return ",".join(columns)


# ----------------------------------------------------------------------------- tenant workloads
TENANT_KEYS = ("requests", "rate", "every", "burst", "start", "prompt", "output", "prefix")


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One tenant's traffic (``--tenant NAME:key=value,...``; see ``parse_tenant_spec``)."""

    name: str
    requests: int = 100
    rate: float = math.inf  # arrivals (bursts) per step; inf: all at ``start`` (unless ``every``)
    every: int | None = None  # an arrival every this many steps instead of Poisson
    burst: int = 1  # requests per arrival
    start: int = 0  # step of the first arrival
    prompt: LengthDist | None = None  # user tokens after the system prompt (None: --dataset's)
    output: LengthDist | None = None
    prefix: int = 0  # tokens of this tenant's system prompt, shared by all its requests


def parse_tenant_spec(text: str) -> TenantSpec:
    """``quiet:requests=40,every=20,prefix=384,prompt=fixed:16,output=fixed:8`` -> ``TenantSpec``.

    Keys (all optional): ``requests`` (default 100), ``rate`` (Poisson arrivals per step) or
    ``every`` (an arrival every N steps; neither: all at once), ``burst`` (requests per arrival,
    default 1), ``start`` (first arrival step, default 0), ``prompt`` and ``output`` (length
    distributions as ``--prompt-len``; ``prompt`` counts the tokens after the system prompt;
    default: the ``--dataset`` shape's) and ``prefix`` (tokens of the tenant's own system prompt,
    default 0). A comma inside a value (``prompt=lognormal:100,0.8``) is kept. ValueError names
    ``--tenant`` and the bad part."""
    name, sep, body = text.partition(":")
    name = name.strip()
    if not sep or not name or "=" in name:
        raise ValueError(f"--tenant: expected NAME:key=value,... such as quiet:requests=40,every=20, got {text!r}")
    pairs: list[list[str]] = []
    for part in body.split(","):
        key, eq, value = part.partition("=")
        if eq and key.strip() in TENANT_KEYS:
            pairs.append([key.strip(), value.strip()])
        elif pairs and part.strip():
            pairs[-1][1] += "," + part.strip()  # a comma inside the previous value
        elif part.strip():
            raise ValueError(f"--tenant {name}: unknown setting {part.strip()!r}; keys: {', '.join(TENANT_KEYS)}")
    values: dict[str, object] = {}
    for key, value in pairs:
        if key in values:
            raise ValueError(f"--tenant {name}: {key} is given twice")
        try:
            if key in ("prompt", "output"):
                values[key] = parse_length_dist(value, f"--tenant {name} {key}")
            elif key == "rate":
                values[key] = float(value)
            else:
                values[key] = int(value)
        except ValueError as exc:
            if key in ("prompt", "output"):
                raise
            raise ValueError(f"--tenant {name}: {key} must be a number, got {value!r}") from exc
    # each key's value parsed above to its field's type; a dict[str, object] cannot say which is which
    spec = TenantSpec(name, **values)  # type: ignore[arg-type]
    checks = [(spec.requests >= 1, "requests", ">= 1", spec.requests),
              (spec.rate > 0, "rate", "> 0", spec.rate),
              (spec.every is None or spec.every >= 1, "every", ">= 1", spec.every),
              (spec.burst >= 1, "burst", ">= 1", spec.burst),
              (spec.start >= 0, "start", ">= 0", spec.start),
              (spec.prefix >= 0, "prefix", ">= 0", spec.prefix),
              (spec.every is None or "rate" not in values, "every", "given without rate", spec.every)]
    for ok, key, allowed, got in checks:
        if not ok:
            raise ValueError(f"--tenant {name}: {key} must be {allowed}, got {got}")
    return spec


def generate_tenant_workload(tenants: list[TenantSpec], config: WorkloadConfig) -> list[Request]:
    """Every tenant's requests, merged in arrival order (ties: tenants in the order given).

    Each tenant draws its lengths and arrivals from its own seeded stream (``config.seed`` and its
    name), so adding a tenant does not change another's requests. Prompts are ``[the tenant's
    system prompt][unique user tokens]`` (system prompt ``i`` for the i-th tenant, clipped to
    ``max_model_len - 2`` tokens); ``n`` and ``beam_width`` come from ``config``; its
    ``num_requests``, ``rate``, ``clients``, ``turns`` and ``prefix_len`` are not used."""
    config.validate()
    names = [t.name for t in tenants]
    if not tenants or len(set(names)) != len(names):
        raise ValueError(f"--tenant: expected one or more tenants, each named once, got {names}")
    rows: list[tuple[int, int, int, int, int, int]] = []  # arrival, tenant, k, prefix, user, output
    for index, t in enumerate(tenants):
        rng = random.Random(f"{config.seed}:{t.name}")
        prompt_dist, output_dist = t.prompt or config.shape.prompt, t.output or config.shape.output
        prefix = min(t.prefix, config.max_model_len - 2)
        clock = float(t.start)
        for k in range(t.requests):
            if k % t.burst == 0 and k:
                clock += t.every if t.every is not None else (rng.expovariate(t.rate) if math.isfinite(t.rate) else 0)
            elif k == 0 and t.every is None and math.isfinite(t.rate):
                clock += rng.expovariate(t.rate)
            user = prompt_dist.sample(rng, config.max_model_len - prefix - 1)
            output = output_dist.sample(rng, config.max_model_len - prefix - user)
            rows.append((int(clock), index, k, prefix, user, output))
    rows.sort()
    counter = _TokenCounter()
    requests: list[Request] = []
    for arrival, index, _, prefix, user, output in rows:
        prompt = prefix_tokens(index, prefix) + counter.take(user)
        requests.append(Request(len(requests), prompt, output, config.n, config.beam_width,
                                index if prefix else None, arrival, tenant=tenants[index].name))
    return requests


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True
