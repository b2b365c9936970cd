"""``pagedkv serve``: argument parser and entry point.

The top-level CLI wires it in with ``add_serve_parser(subparsers)`` and calls ``run_serve(args)``.
Engine flags (``pagedkv.engine.flags``) keep vLLM's names; flags left unset keep EngineConfig's
defaults.

SIGTERM (or Ctrl-C) drains: new requests get 503, requests in flight run to the end (up to
``--drain-timeout`` seconds), then the engine thread stops and the process exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Any

from pagedkv import envs
from pagedkv.block_size import AUTO
from pagedkv.engine.flags import add_engine_arguments, engine_options
from pagedkv.server.cors import add_cors_arguments
from pagedkv.server.limits import CONNECTION_HELP, LIMIT_HELP, ConnectionLimits, RequestLimits
from pagedkv.server.logs import LOG_FORMATS
from pagedkv.server.tools.parsers import TOOL_PARSERS
from pagedkv.server.tools.reasoning import REASONING_PARSERS
from pagedkv.server.vllm_flags import add_vllm_flags


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to a top-level parser's subparsers and return its parser."""
    p = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API with Prometheus metrics.",
    )
    add_serve_arguments(p)
    p.set_defaults(command_parser=p)  # unknown flags are reported with serve's usage (pagedkv/cli.py)
    return p


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="model folder, GGUF file or cached Hugging Face repo id (default: the bundled "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                   help="the model, as a flag (vLLM's older spelling; give it or the positional one)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", action="extend", nargs="+", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 routes and /tokenize, /detokenize (also "
                        "env PAGEDKV_API_KEY); several (after one flag, as vLLM's, or the flag repeated): "
                        "each key is a tenant of its own, named key1, key2, ... in the order given (name them "
                        "with --api-keys-file)")
    p.add_argument("--api-keys-file", default=None, metavar="FILE",
                   help="a JSON object mapping API keys to tenant names, e.g. {\"sk-1\": \"team-a\"}: a "
                        "request's tenant is its key's (KV quotas, a prefix cache of its own)")
    p.add_argument("--served-model-name", action="extend", nargs="+", default=None, metavar="NAME",
                   help="model names clients use, the first in responses and metrics (several after one "
                        "flag, as vLLM's, or the flag repeated; default: the engine's model name)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a jinja2 chat template (a file, or the template itself) instead of the model's")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model choose when to call tools (tool_choice \"auto\", the default when tools are "
                        "given); needs --tool-call-parser (docs/tools.md)")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls: hermes (Qwen, Hermes; "
                        "examples/tool_chat_template_hermes.jinja), llama3_json, mistral, pythonic, deepseek_v3")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split <think>...</think> into the reasoning_content field (deepseek_r1, qwen3)")
    p.add_argument("--max-queue", type=int, default=None,
                   help="requests allowed to wait beyond --max-num-seqs; more get 429 (default: no limit)")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds to let in-flight requests finish after SIGTERM (default 60)")
    for f in dataclasses.fields(RequestLimits):
        p.add_argument("--" + f.name.replace("_", "-"), default=f.default, **(f.metadata or {"type": int}),
                       help=LIMIT_HELP[f.name] + ("" if f.default is None else f" (default {f.default})"))
    for f in dataclasses.fields(ConnectionLimits):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                       help=f"{CONNECTION_HELP[f.name]} (default {f.default})")
    p.add_argument("--metrics-api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /metrics (also env PAGEDKV_METRICS_API_KEY); "
                        "/metrics shows per-tenant figures and load: protect it or keep its port private "
                        "(README, Security). Default: open, like /health")
    p.add_argument("--kv-events-endpoint", default=None, metavar="ENDPOINT",
                   help="publish KV cache events (vLLM's format) on this ZMQ PUB endpoint for KV-aware routers, "
                        "e.g. tcp://127.0.0.1:5557 (an address of this machine is bound, another one connected to)")
    p.add_argument("--kv-events-replay-endpoint", default=None, metavar="ENDPOINT",
                   help="a ZMQ ROUTER endpoint answering replay requests for recent event batches")
    p.add_argument("--kv-events-topic", default=None, help="the topic frame of each event message (default empty)")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="vLLM's spelling of the above: {\"endpoint\": ..., \"replay_endpoint\": ..., \"topic\": ..., "
                        "\"buffer_steps\": 10000, \"hwm\": 100000, \"max_queue_size\": 100000}")
    p.add_argument("--lora-modules", action="extend", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) a request selects by its model field: NAME=PATH, or vLLM's "
                        "JSON form {\"name\": ..., \"path\": ..., \"base_model_name\": ...}; needs --enable-lora "
                        "(docs/lora.md)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key; also env "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")
    add_log_arguments(p)
    add_cors_arguments(p)
    p.add_argument("--max-tokens-default", type=int, default=None, metavar="N",
                   help="the most tokens a response may have when its request gives no max_tokens (a chat "
                        "otherwise runs to the end of the context); the same as --override-generation-config's "
                        "max_new_tokens")
    p.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="sampling defaults over the model's generation_config.json, as vLLM's: e.g. "
                        "'{\"max_new_tokens\": 512, \"temperature\": 0.6}'")
    add_engine_arguments(p.add_argument_group("engine"))
    add_vllm_flags(p)  # last: vLLM's flags pagedkv lacks, as no-ops with a warning or refused


def serve_engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options ``pagedkv serve`` runs with: those given, and ``block_size="auto"``
    unless ``--block-size`` was. A server runs on one device for a long time, where the size fitted
    to its model, context and kernels pays (logged with its reason); the Python API keeps a fixed 16
    (docs/block_size.md)."""
    return {"block_size": AUTO, **engine_options(args)}


def add_log_arguments(p: argparse.ArgumentParser) -> None:
    """--log-level and what is logged (server/logs.py)."""
    p.add_argument("--log-level", "--uvicorn-log-level", default="info",
                   choices=["debug", "info", "warning", "error", "critical"],
                   help="the least severe log lines shown (default info: the start-up summary, a line per "
                        "request, the stats line; debug adds probes' requests, client addresses and more)")
    p.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                   help="log lines as text or as one JSON object each (default text)")
    p.add_argument("--disable-log-requests", "--no-enable-log-requests", action="store_true",
                   help="no line per request (on by default)")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="a line per request (vLLM's newer spelling; on by default here)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (throughput, queues, KV usage, prefix hits; every "
                        "VLLM_LOG_STATS_INTERVAL seconds, default 10, when something happened)")


def run_serve(args: argparse.Namespace) -> int:
    """Load the engine, serve until SIGTERM/SIGINT, drain, and return the exit status."""
    from pagedkv.engine import LLMEngine
    from pagedkv.server.app import create_app
    from pagedkv.server.async_engine import AsyncEngine
    from pagedkv.server.cors import cors_options, install_cors
    from pagedkv.server.http_server import DrainingServer, server_config
    from pagedkv.server.logs import configure_logging, install_server_logs, log_startup_summary
    from pagedkv.server.tools.request import ToolOptions
    from pagedkv.server.vllm_flags import check_max_model_len, generation_overrides, model_context_length

    configure_logging(args.log_level, args.log_format)
    for warning in getattr(args, "vllm_warnings", None) or []:
        logging.getLogger("pagedkv.server.flags").warning(warning)
    try:
        cors = cors_options(args)
        overrides = generation_overrides(args.override_generation_config, args.max_tokens_default)
    except ValueError as exc:
        print(f"pagedkv serve: {exc}", file=sys.stderr)
        return 2
    if args.disable_log_requests and args.enable_log_requests:
        print("pagedkv serve: give --disable-log-requests or --enable-log-requests, not both", file=sys.stderr)
        return 2

    if args.max_queue is not None and args.max_queue < 0:
        print("pagedkv serve: --max-queue must be >= 0", file=sys.stderr)
        return 2
    try:
        env_key = envs.API_KEY.get()
        api_keys = read_api_keys(args.api_key or ([env_key] if env_key else []), args.api_keys_file)
    except ValueError as exc:
        print(f"pagedkv serve: {exc}", file=sys.stderr)
        return 2
    if args.model_flag is not None:
        if args.model is not None and args.model != args.model_flag:
            print(f"pagedkv serve: two models given ({args.model!r} and --model {args.model_flag!r})",
                  file=sys.stderr)
            return 2
        args.model = args.model_flag
    template = None
    if args.chat_template is not None:
        path = os.path.expanduser(args.chat_template)
        try:
            template = open(path, encoding="utf-8").read() if os.path.isfile(path) else args.chat_template
        except OSError as exc:
            print(f"pagedkv serve: --chat-template: cannot read {path}: {exc}", file=sys.stderr)
            return 2
        if "{" not in template:
            print(f"pagedkv serve: --chat-template: {args.chat_template!r} is neither a file nor a jinja2 "
                  "template", file=sys.stderr)
            return 2
    try:
        tool_options = ToolOptions(args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser)
    except ValueError as exc:
        print(f"pagedkv serve: {exc}", file=sys.stderr)
        return 2
    try:
        limits = RequestLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RequestLimits)})
    except ValueError as exc:
        print(f"pagedkv serve: --{str(exc).replace('_', '-')}", file=sys.stderr)
        return 2
    try:
        connection_limits = ConnectionLimits(**{f.name: getattr(args, f.name)
                                                for f in dataclasses.fields(ConnectionLimits)})
    except ValueError as exc:
        print(f"pagedkv serve: --{str(exc).replace('_', '-')}", file=sys.stderr)
        return 2
    metrics_api_key = args.metrics_api_key or envs.METRICS_API_KEY.get()
    try:
        events_config = kv_events_config(args)
    except ValueError as exc:
        print(f"pagedkv serve: {exc}", file=sys.stderr)
        return 2
    options = serve_engine_options(args)
    if events_config is not None:
        options["kv_events"] = True
    try:
        engine = LLMEngine.from_options(model=args.model, **options)
    except (ValueError, TypeError, OSError, RuntimeError) as exc:  # bad options, ModelLoadError
        print(f"pagedkv serve: cannot start the engine: {exc}", file=sys.stderr)
        return 2
    try:
        check_max_model_len(args.max_model_len, model_context_length(engine))
    except ValueError as exc:
        print(f"pagedkv serve: {exc}", file=sys.stderr)
        return 2
    engine.generation_defaults.update(overrides)  # before anything serves: read-only from here on
    try:
        from pagedkv.server.lora import parse_lora_modules, register_lora_modules
        register_lora_modules(engine, parse_lora_modules(args.lora_modules or []))
    except ValueError as exc:  # a bad --lora-modules item, or an adapter that cannot be applied
        print(f"pagedkv serve: {exc}", file=sys.stderr)
        return 2
    publisher = None
    if events_config is not None:
        from pagedkv.server.kv_events import KVEventPublisher
        try:
            publisher = KVEventPublisher(events_config)
        except ValueError as exc:
            print(f"pagedkv serve: {exc}", file=sys.stderr)
            return 2
    if template is not None and engine.tokenizer is not None:
        engine.tokenizer.set_chat_template(template)
    async_engine = AsyncEngine(engine)
    if publisher is not None:
        async_engine.kv_event_sink = publisher.publish
    app = create_app(async_engine, tool_options=tool_options, served_model_names=args.served_model_name,
                     api_keys=api_keys, max_queue=args.max_queue, limits=limits, connection_limits=connection_limits,
                     metrics_api_key=metrics_api_key,
                     allow_lora_updates=args.allow_runtime_lora_updating)
    if cors is not None:
        install_cors(app, cors)
    try:
        install_server_logs(app, log_requests=not args.disable_log_requests, log_stats=not args.disable_log_stats)
    except ValueError as exc:  # a bad VLLM_LOG_STATS_INTERVAL
        print(f"pagedkv serve: {exc}", file=sys.stderr)
        return 2
    log_startup_summary(engine, host=args.host, port=args.port, api_keys=len(api_keys),
                        metrics_key=metrics_api_key is not None)
    config = server_config(app, host=args.host, port=args.port, log_level=args.log_level, log_config=None,
                           timeout_graceful_shutdown=args.drain_timeout, access_log=False)
    server = DrainingServer(config, app.state.server)
    died: list[str] = []

    def engine_died(message: str) -> None:  # (a tensor-parallel rank died): 503s, then exit non-zero
        died.append(message)
        async_engine.fail(message)
        server.should_exit = True

    engine.on_dead(engine_died)
    try:
        server.run()
    finally:
        if publisher is not None:
            publisher.close()
    if died:
        print(f"pagedkv serve: the engine stopped: {died[0]}", file=sys.stderr, flush=True)
        return 1
    return 0


def kv_events_config(args: argparse.Namespace):
    """The KV events publisher's config from the --kv-events-* flags, or None (events off)."""
    from pagedkv.server.kv_events import KVEventsConfig

    given = {name: value for name, value in (("endpoint", args.kv_events_endpoint),
                                             ("replay_endpoint", args.kv_events_replay_endpoint),
                                             ("topic", args.kv_events_topic)) if value is not None}
    if args.kv_events_config is None and not given:
        return None
    base = KVEventsConfig.parse(args.kv_events_config) if args.kv_events_config is not None else KVEventsConfig()
    return dataclasses.replace(base, **given)


def read_api_keys(keys: list[str], keys_file: str | None) -> dict[str, str | None]:
    """``{key: tenant}`` from ``--api-key`` (one key: no tenant, the cache_salt stays the tenant;
    several: tenants key1, key2, ...) and ``--api-keys-file`` (a JSON object of key -> tenant).
    Raises ValueError saying what is wrong."""
    out: dict[str, str | None] = {}
    for i, key in enumerate(keys, 1):
        if not key.strip():
            raise ValueError("--api-key: an empty key")
        out[key.strip()] = None if len(keys) == 1 and keys_file is None else f"key{i}"
    if keys_file is not None:
        try:
            with open(os.path.expanduser(keys_file), encoding="utf-8") as f:
                mapping = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--api-keys-file: cannot read {keys_file}: {exc}") from exc
        if not isinstance(mapping, dict) or not mapping:
            raise ValueError(f"--api-keys-file: {keys_file} must hold a JSON object of API key -> tenant name")
        for key, tenant in mapping.items():
            if not str(key).strip() or not isinstance(tenant, str) or not tenant.strip():
                raise ValueError(f"--api-keys-file: each entry must map a non-empty key to a non-empty tenant "
                                 f"name, got {str(key)[:4]}...: {tenant!r}")
            if key.strip() in out:
                raise ValueError(f"--api-keys-file: the key {key.strip()[:4]}... is given twice")
            out[key.strip()] = tenant.strip()
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedkv.server.cli`` runs the server without the top-level CLI."""
    parser = argparse.ArgumentParser(prog="pagedkv serve")
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
