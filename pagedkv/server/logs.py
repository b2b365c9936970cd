"""What ``pagedkv serve`` tells its operator: a start-up summary, a line per request and a
periodic stats line, as text or as JSON lines, on stderr.

    INFO 2026-12-01 21:04:26 [startup] model SmolLM2-135M-Instruct: dtype float32, weights 513.1 MiB, ...
    INFO 2026-12-01 21:04:31 [requests] 200 POST /v1/chat/completions prompt_tokens=12 output_tokens=16
         cached_tokens=0 ttft_s=0.052 total_s=0.310 tenant=- finish=length
    INFO 2026-12-01 21:04:36 [stats] Avg prompt throughput: 2.4 tokens/s, Avg generation throughput: ...

Request lines come from :class:`RequestLogMiddleware` (every status: 2xx, 4xx and 429s, 5xx, and
requests whose client went away, shown as ``disconnected``); the generation handler adds what
only it knows (tokens, time to first token, tenant, finish reason) with :func:`note_generation`.
At ``--log-level info`` the probes' routes (``/health``, ``/metrics``, ``/version``) are logged only
when they fail: a scraper every few seconds would drown the lines that matter; ``debug`` logs them
too, with each request's id and client address. The stats line (vLLM's "Avg prompt throughput"
line) is written every ``VLLM_LOG_STATS_INTERVAL`` seconds (default 10, vLLM's name; also
``PAGEDKV_LOG_STATS_INTERVAL``), only when something happened since the last one: an idle server
writes one line saying so, then stays quiet.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedkv import envs

LOG_FORMATS = ("text", "json")
PROBE_ROUTES = frozenset({"/health", "/metrics", "/version", "/ping"})

startup_log = logging.getLogger("pagedkv.server.startup")
request_log = logging.getLogger("pagedkv.server.requests")
stats_log = logging.getLogger("pagedkv.server.stats")

_SCOPE_KEY = "pagedkv.request_log"  # the scope entry holding a request's RequestRecord


class _TextFormatter(logging.Formatter):
    """``LEVEL date time [logger] message``; the logger shown by its last part (``requests``), or
    ``uvicorn`` for the HTTP server's own lines."""

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.fromtimestamp(record.created).strftime("%Y-%m-%d %H:%M:%S")
        name = "uvicorn" if record.name.startswith("uvicorn") else record.name.rsplit(".", 1)[-1]
        line = f"{record.levelname} {when} [{name}] {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JSONFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, and the record's
    ``fields`` (a request line's status, route, tokens...) as keys of their own, for log pipelines."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure_logging(level: str, fmt: str = "text") -> None:
    """Send every logger's records (pagedkv's, uvicorn's) at ``level`` and above to stderr in
    ``fmt``. Run uvicorn with ``log_config=None`` so that it keeps this setup."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JSONFormatter() if fmt == "json" else _TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # to the root handler, once
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True


def _log(logger: logging.Logger, level: int, message: str, fields: dict[str, Any]) -> None:
    logger.log(level, message, extra={"fields": fields})


def _mib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# -- the start-up summary ------------------------------------------------------------------------

def startup_summary(engine: Any, *, host: str, port: int, api_keys: int, metrics_key: bool) -> list[tuple[str, dict]]:
    """The summary's lines (message, fields): what was loaded and how memory was split, where the
    server listens and whether a key protects it."""
    import torch

    runner, config = engine.runner, engine.config
    dtype, weights = runner.model_dtype, runner.weight_bytes
    stats = engine.stats()
    kv, per_block = stats.kv, stats.kv_bytes_per_block
    lines: list[tuple[str, dict]] = []
    fields = {"model": engine.model_name, "source": config.model, "dtype": dtype, "weights_bytes": weights,
              "quantization": config.quantization, "max_model_len": config.max_model_len,
              "max_num_seqs": config.max_num_seqs, "threads": torch.get_num_threads()}
    lines.append((f"model {engine.model_name} ({config.model or 'bundled default'}): dtype {dtype}, weights "
                  f"{_mib(weights)}, max_model_len {config.max_model_len}, max_num_seqs {config.max_num_seqs}, "
                  f"{fields['threads']} threads", fields))
    tiers = {"device": (kv.num_blocks, kv.num_blocks * per_block),
             "host": (kv.host_blocks, kv.host_blocks * per_block)}
    if getattr(kv, "disk_capacity_bytes", 0):
        tiers["disk"] = (kv.disk_capacity_bytes // per_block if per_block else 0, kv.disk_capacity_bytes)
    text = ", ".join(f"{tier} {blocks} blocks ({_mib(size)})" for tier, (blocks, size) in tiers.items())
    fields = {"block_size": kv.block_size, "kv_cache_dtype": stats.kv_cache_dtype, "kv_bytes_per_block": per_block,
              "prefix_caching": stats.enable_prefix_caching,
              **{f"kv_{tier}_blocks": b for tier, (b, _) in tiers.items()},
              **{f"kv_{tier}_bytes": s for tier, (_, s) in tiers.items()}}
    lines.append((f"KV cache: {text}; {kv.block_size} tokens per block, {stats.kv_cache_dtype}, {per_block:,} bytes "
                  f"per block, prefix caching {'on' if stats.enable_prefix_caching else 'off'}", fields))
    shown = f"[{host}]" if ":" in host else host
    where = f"http://{shown}:{port}" if port else f"http://{shown} (a free port, see the listening line)"
    protection = (f"an API key protects /v1 ({api_keys} key{'s' if api_keys > 1 else ''})" if api_keys
                  else "no API key: anyone who reaches the address may use it")
    lines.append((f"address {where}: {protection}; /metrics {'needs --metrics-api-key' if metrics_key else 'open'}",
                  {"host": host, "port": port, "api_key": bool(api_keys), "metrics_key": metrics_key}))
    return lines


def log_startup_summary(engine: Any, **where: Any) -> None:
    for message, fields in startup_summary(engine, **where):
        _log(startup_log, logging.INFO, message, fields)


# -- a line per request --------------------------------------------------------------------------

@dataclass(slots=True)
class RequestRecord:
    """What a generation handler knows about its request, for the request's log line."""

    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    first_token_at: float | None = None  # time.monotonic() of the first token
    tenant: str | None = None
    finish: list[str] = field(default_factory=list)
    disconnected: bool = False


def note_generation(scope: Scope, *, prompt_tokens: int, outputs: list[Any], first_token_at: float | None,
                    tokens_so_far: int, tenant: str | None, aborted: bool) -> None:
    """Record a generation request's figures for its log line (``outputs``: the finished
    ``RequestOutput``s; ``tokens_so_far``: output tokens counted while streaming, for a request
    aborted before it finished). A no-op when the request log is off."""
    record = scope.get(_SCOPE_KEY)
    if record is None:
        return
    record.prompt_tokens = prompt_tokens
    record.output_tokens = max(tokens_so_far, sum(len(c.token_ids) for o in outputs for c in o.outputs))
    record.cached_tokens = sum(o.num_cached_tokens for o in outputs) if outputs else None
    record.first_token_at, record.tenant = first_token_at, tenant
    record.finish = sorted({c.finish_reason or "abort" for o in outputs for c in o.outputs}) or (
        ["abort"] if aborted else [])
    record.disconnected = aborted


class RequestLogMiddleware:
    """Logs one line per HTTP request when its response is done (streams included), with the
    status uvicorn sent (a 499 when a client left before a non-streamed answer)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        status = 0
        record = scope[_SCOPE_KEY] = RequestRecord()

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except BaseException:
            status = status or 500
            raise
        finally:
            _log_request(scope, status, start, record)


def _log_request(scope: Scope, status: int, start: float, record: RequestRecord) -> None:
    path = scope.get("path", "")
    probe = path in PROBE_ROUTES and status < 400
    level = logging.DEBUG if probe else logging.INFO
    if not request_log.isEnabledFor(level):
        return
    total = time.monotonic() - start
    ttft = None if record.first_token_at is None else record.first_token_at - start
    fields: dict[str, Any] = {
        "status": status, "method": scope.get("method"), "route": path,
        "prompt_tokens": record.prompt_tokens, "output_tokens": record.output_tokens,
        "cached_tokens": record.cached_tokens, "ttft_s": None if ttft is None else round(ttft, 4),
        "total_s": round(total, 4), "tenant": record.tenant, "finish_reason": ",".join(record.finish) or None,
        "client_disconnected": record.disconnected or status == 499}
    if request_log.isEnabledFor(logging.DEBUG):
        client = scope.get("client")
        fields["client"] = f"{client[0]}:{client[1]}" if client else None
    parts = [f"{status} {scope.get('method')} {path}"]
    if record.prompt_tokens is not None:
        parts.append(f"prompt_tokens={record.prompt_tokens} output_tokens={record.output_tokens} "
                     f"cached_tokens={record.cached_tokens if record.cached_tokens is not None else '-'} "
                     f"ttft_s={'-' if ttft is None else f'{ttft:.3f}'}")
    parts.append(f"total_s={total:.3f}")
    if record.prompt_tokens is not None:
        parts.append(f"tenant={record.tenant or '-'} finish={fields['finish_reason'] or '-'}")
    if fields["client_disconnected"]:
        parts.append("client disconnected")
    if "client" in fields:
        parts.append(f"client={fields['client']}")
    _log(request_log, level, " ".join(parts), fields)


# -- the periodic stats line ---------------------------------------------------------------------

def stats_interval() -> float:
    """Seconds between stats lines: PAGEDKV_LOG_STATS_INTERVAL, else vLLM's VLLM_LOG_STATS_INTERVAL."""
    return envs.LOG_STATS_INTERVAL.get()


@dataclass(slots=True)
class StatsLine:
    """Turns successive engine snapshots into vLLM's periodic stats line (throughputs are over
    the time between two snapshots)."""

    last: Any = None
    last_at: float = 0.0
    was_idle: bool = True

    def update(self, stats: Any, now: float) -> tuple[str, dict] | None:
        """The line for ``stats`` taken at ``now``, or None when nothing happened since the last one."""
        prev, prev_at = self.last, self.last_at
        self.last, self.last_at = stats, now
        if prev is None:
            return None
        span = max(now - prev_at, 1e-9)
        prompt = (stats.prompt_tokens_total - prev.prompt_tokens_total) / span
        gen = (stats.generation_tokens_total - prev.generation_tokens_total) / span
        idle = not (prompt or gen or stats.num_running or stats.num_waiting or stats.num_swapped)
        if idle and self.was_idle:
            return None
        self.was_idle = idle
        kv = stats.kv
        host = kv.host_used_blocks + getattr(kv, "host_cached_blocks", 0)
        hit = kv.prefix_hit_tokens / kv.prefix_query_tokens if kv.prefix_query_tokens else 0.0
        fields = {"prompt_throughput": round(prompt, 2), "generation_throughput": round(gen, 2),
                  "running": stats.num_running, "waiting": stats.num_waiting, "swapped": stats.num_swapped,
                  "kv_device_usage": round(kv.usage, 4), "kv_device_blocks_used": kv.used_blocks,
                  "kv_device_blocks": kv.num_blocks, "kv_host_blocks_used": host, "kv_host_blocks": kv.host_blocks,
                  "prefix_cache_hit_rate": round(hit, 4)}
        tiers = f"device {kv.usage:.1%} ({kv.used_blocks}/{kv.num_blocks} blocks)"
        if kv.host_blocks:
            tiers += f", host {host / kv.host_blocks:.1%} ({host}/{kv.host_blocks} blocks)"
        if getattr(kv, "disk_capacity_bytes", 0):
            fields["kv_disk_usage"] = round(kv.disk_bytes_used / kv.disk_capacity_bytes, 4)
            tiers += f", disk {fields['kv_disk_usage']:.1%} ({_mib(kv.disk_bytes_used)})"
        message = (f"Avg prompt throughput: {prompt:.1f} tokens/s, Avg generation throughput: {gen:.1f} tokens/s, "
                   f"Running: {stats.num_running} reqs, Waiting: {stats.num_waiting} reqs, Swapped: "
                   f"{stats.num_swapped} reqs, KV cache usage: {tiers}, Prefix cache hit rate: {hit:.1%}")
        return message, fields


async def log_stats_forever(fetch: Callable[[], Any], interval: float) -> None:
    """Every ``interval`` seconds, ``await fetch()`` an engine snapshot and log its stats line."""
    line = StatsLine()
    while True:
        try:
            out = line.update(await fetch(), time.monotonic())
        except Exception:  # noqa: BLE001 - the engine stopped: /health says so; the log goes on
            stats_log.debug("no engine stats", exc_info=True)
            out = None
        if out is not None:
            _log(stats_log, logging.INFO, *out)
        await asyncio.sleep(interval)


def install_server_logs(app: Any, *, log_requests: bool, log_stats: bool) -> None:
    """Add the request log and the stats task to an app built by ``create_app`` (before it starts)."""
    if log_requests:
        app.add_middleware(RequestLogMiddleware)
    if not log_stats:
        return
    interval = stats_interval()
    state = app.state.server
    inner = app.router.lifespan_context

    async def fetch() -> Any:
        stats = state.engine.latest_stats() if state.engine.num_in_flight else None
        return stats if stats is not None else await state.engine.call(lambda engine: engine.stats())

    @asynccontextmanager
    async def lifespan(app_: Any) -> AsyncIterator[None]:
        async with inner(app_):
            task = asyncio.create_task(log_stats_forever(fetch, interval))
            try:
                yield
            finally:
                task.cancel()

    app.router.lifespan_context = lifespan
