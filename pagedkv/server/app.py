"""The FastAPI app: OpenAI-compatible routes, API-key check, errors in OpenAI's format.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``POST
/tokenize`` and ``POST /detokenize`` (vLLM's; all behind the API key when one is set), ``GET
/health``, ``GET /metrics`` and ``GET /version`` (open, for probes and scrapers).

Error statuses: 400 malformed JSON, invalid or mistyped fields (validation errors are 400, not
FastAPI's 422), lone surrogates, prompt too long (message names the limit), too much work asked
(server/limits.py); 401 missing or wrong API key; 404 unknown model or route; 413 body too large;
429 queue full and 503 draining, both with ``Retry-After``; 500 a request the engine failed, or
an unexpected error (the connection stays open). Bodies are always
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedkv import __version__
from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.connections import UploadSlots, read_limited_body
from pagedkv.server.heavy_work import HeavyWork, TrimAfterRequests, dumps
from pagedkv.server.limits import MAX_CHOICES, ConnectionLimits, RequestLimits
from pagedkv.server.lora import lora_router, model_cards, runtime_updates_allowed
from pagedkv.server.metrics import CONTENT_TYPE, ServerMetrics
from pagedkv.server.protocol import (
    APIError,
    Body,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
)
from pagedkv.server.responses import CompletionFormat
from pagedkv.server.serving import Generation, ServerState, message_chars, serve_generation
from pagedkv.server.tools.request import ToolOptions
from pagedkv.server.tools.responses_api import responses_router
from pagedkv.server.tools.serving import chat_output

logger = logging.getLogger(__name__)


def create_app(
    engine: AsyncEngine,
    *,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    api_keys: dict[str, str | None] | None = None,
    max_queue: int | None = None,
    limits: RequestLimits | None = None,
    connection_limits: ConnectionLimits | None = None,
    metrics_api_key: str | None = None,
    allow_lora_updates: bool = False,
    tool_options: ToolOptions | None = None,  # tool-call and reasoning parsers (server/tools/)
) -> FastAPI:
    """Build the app around an AsyncEngine; the app starts its engine thread and drains it on shutdown.
    ``connection_limits``: body timeout and upload cap here; the rest apply where uvicorn runs it
    (``http_server.server_config``). ``metrics_api_key``: /metrics answers only with this key.
    ``allow_lora_updates``: mount /v1/load_lora_adapter and /v1/unload_lora_adapter (also with
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; server/lora.py)."""
    names = served_model_names or [engine.engine.model_name]
    keys = {**({api_key: None} if api_key else {}), **(api_keys or {})}
    config = getattr(engine.engine, "config", None)
    named = {t for t in keys.values() if t} | engine.engine.tenant_names()
    state = ServerState(
        engine=engine,
        metrics=ServerMetrics(names[0], frozenset(named), getattr(config, "max_model_len", None)),
        served_model_names=names,
        api_keys=keys,
        max_queue=max_queue,
        max_num_seqs=engine.engine.config.max_num_seqs,
        limits=limits or RequestLimits(),
        connection_limits=(connection_limits := connection_limits or ConnectionLimits()),
        uploads=UploadSlots(connection_limits.max_uploads),
        heavy=HeavyWork(),
        metrics_api_key=metrics_api_key,
    )
    engine.step_observer = state.metrics.observe_iteration

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        structured = getattr(engine.engine, "structured", None)  # (test doubles of the engine have none)
        if structured is not None:  # the grammar tokenizer info holds the GIL ~1 s: before serving
            structured.prepare()
        engine.start()
        yield
        state.draining = True
        engine.shutdown()
        state.heavy.shutdown()

    app = FastAPI(title="pagedkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.state.tool_options = tool_options or ToolOptions()
    app.include_router(_api_router(state))
    app.include_router(responses_router(Depends(_key_check(state)), read_body))  # /v1/responses, over chat
    app.include_router(_tokenizer_router(state))
    app.include_router(_ops_router(state))
    if runtime_updates_allowed(allow_lora_updates):  # LoRA load / unload (server/lora.py)
        app.include_router(lora_router(state, [Depends(_key_check(state))]))
    _install_error_handlers(app, state)
    app.add_middleware(TrimAfterRequests, heavy=state.heavy)
    return app


def _key_check(state: ServerState) -> Callable[[Request], Any]:
    async def require_api_key(request: Request) -> None:
        """401 unless the bearer token is one of the keys; the key's tenant goes to
        ``request.state.tenant`` (None: no tenant, the request's cache_salt is its tenant)."""
        request.state.tenant = None
        if not state.api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode()
        found = False
        for key, tenant in state.api_keys.items():  # every key compared, in constant time each
            if hmac.compare_digest(given, key.encode()) and scheme.lower() == "bearer":
                found = True
                request.state.tenant = tenant
        if not found:
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           type="authentication_error", code="invalid_api_key")
    return require_api_key


def _tokenizer_router(state: ServerState) -> APIRouter:
    """vLLM's ``/tokenize`` and ``/detokenize`` (request and response shapes as vLLM's)."""
    router = APIRouter(dependencies=[Depends(_key_check(state))])

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await read_json(request, state, TokenizeRequest)
        state.check_model(body.model)
        body.check()
        tokenizer = state.engine.engine.tokenizer

        def run() -> bytes:  # in a worker thread: rendering, tokenizing and the response grow with the text
            param = "messages" if body.messages is not None else "prompt"
            try:
                if body.messages is not None:  # the chat path; add_special_tokens (vLLM's): specials too
                    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
                    state.check_text_length(message_chars(messages), param)
                    text = tokenizer.render_chat(messages, body.add_generation_prompt,
                                                 continue_final_message=body.continue_final_message,
                                                 chat_template_kwargs=body.chat_template_kwargs)
                    state.check_text_length(text, param)
                    ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
                else:
                    state.check_text_length(body.prompt or "", param)
                    ids = tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens is not False)
            except APIError:
                raise
            except Exception as exc:  # the text or template is the request's fault
                raise bad_request(f"cannot tokenize: {exc}", param=param) from exc
            out: dict[str, Any] = {"count": len(ids), "max_model_len": state.engine.engine.config.max_model_len,
                                   "tokens": ids, "token_strs": None}
            if body.return_token_strs:
                out["token_strs"] = [tokenizer.id_to_token(i) for i in ids]
            return dumps(out)

        return Response(await state.heavy.run(run), media_type="application/json")

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await read_json(request, state, DetokenizeRequest)
        state.check_model(body.model)
        tokenizer = state.engine.engine.tokenizer
        vocab = tokenizer.vocab_size
        bad = next((t for t in body.tokens if t >= vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is not in the vocabulary (0..{vocab - 1})", param="tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens, False)}

    return router


def _api_router(state: ServerState) -> APIRouter:
    router = APIRouter(prefix="/v1", dependencies=[Depends(_key_check(state))])

    created = int(time.time())

    @router.get("/models")
    async def models() -> dict[str, Any]:
        """vLLM's model cards (routers read ``id``, ``root`` and ``max_model_len``)."""
        engine = state.engine.engine
        data = [{"id": name, "object": "model", "created": created, "owned_by": "pagedkv",
                 "root": engine.model_name, "parent": None, "max_model_len": engine.config.max_model_len,
                 "permission": [{"id": f"modelperm-{name}", "object": "model_permission", "created": created,
                                 "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                                 "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                                 "organization": "*", "group": None, "is_blocking": False}]}
                for name in state.served_model_names]
        data += await state.engine.call(lambda e: model_cards(e, state.model_name, created))  # LoRA adapters
        return {"object": "list", "data": data}

    @router.post("/completions")
    async def completions(request: Request) -> Response:
        body = await read_json(request, state, CompletionRequest)
        state.check_model(body.model)
        params = body.to_sampling_params(state.engine.engine.generation_defaults)  # generation_config's
        gen = Generation(
            prompts=body.prompts(), params=params, fmt=CompletionFormat(body.logprobs or 0),
            stream=body.stream, include_usage=body.include_usage_in_stream, echo=body.echo,
            cache_salt=body.cache_salt, priority=body.priority, tenant=request.state.tenant,
            return_cache_details=body.return_cache_details, conversation_id=body.conversation_id,
            pin_ttl_s=body.pin_ttl_s, grammar_param=body.grammar_param, lora=state.adapter_of(body.model),
        )
        if len(gen.prompts) * params.n > MAX_CHOICES:
            raise bad_request(f"at most {MAX_CHOICES} choices (prompts times n) per request", param="n")
        return await serve_generation(state, request, gen)

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await read_json(request, state, ChatCompletionRequest)
        state.check_model(body.model)
        params = body.to_sampling_params(state.engine.engine.generation_defaults)  # generation_config's
        tokenizer = state.engine.engine.tokenizer
        params, fmt = chat_output(body, request.app.state.tool_options, tokenizer, params)  # tools, reasoning

        def render() -> list[int]:  # LLM.chat's path: the template's text, no special tokens added
            try:
                messages = body.chat_messages()
                state.check_text_length(message_chars(messages), "messages")
                text = tokenizer.render_chat(messages, body.add_generation_prompt,
                                             continue_final_message=body.continue_final_message,
                                             chat_template_kwargs=body.template_kwargs())
                state.check_text_length(text, "messages")  # before it is tokenized, as completions' prompts
                return tokenizer.encode(text, add_special_tokens=False)  # (encode_chat's rule)
            except APIError:
                raise
            except Exception as exc:  # a template error is the request's fault
                raise bad_request(f"cannot apply the chat template: {exc}", param="messages") from exc

        gen = Generation(
            prompts=[await asyncio.to_thread(render)], params=params, fmt=fmt,
            stream=body.stream, include_usage=body.include_usage_in_stream,
            cache_salt=body.cache_salt, priority=body.priority, tenant=request.state.tenant,
            return_cache_details=body.return_cache_details, conversation_id=body.conversation_id,
            pin_ttl_s=body.pin_ttl_s, grammar_param=body.grammar_param, lora=state.adapter_of(body.model),
        )
        return await serve_generation(state, request, gen)

    return router


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it is known to exceed ``limit`` bytes (from
    Content-Length, else while it streams in), so an oversized body is never held in full; 408
    past the body timeout, 503 when too many large bodies are being read (server/connections.py)."""
    state: ServerState = request.app.state.server
    return await read_limited_body(request, limit, state.connection_limits.body_timeout, state.uploads)


async def read_json(request: Request, state: ServerState, model: type[Body]) -> Body:
    """The request body read (``read_body``) and validated (``parse_body``: a 400 naming the
    field); a large body is decoded in the heavy-work pool, not on the event loop."""
    return await state.heavy.parse(await read_body(request, state.limits.max_request_bytes), model)


def _ops_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if state.engine.is_dead:
            raise APIError(503, "the engine has stopped", type="service_unavailable", code="engine_dead")
        if state.draining:
            raise APIError(503, "the server is shutting down", type="service_unavailable",
                           code="server_draining", headers={"Retry-After": "5"})
        return JSONResponse({"status": "ok"})

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        if state.metrics_api_key is not None:  # what /metrics reveals: README, Security
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if not (hmac.compare_digest(token.strip().encode(), state.metrics_api_key.encode())
                    and scheme.lower() == "bearer"):
                raise APIError(401, "missing or invalid metrics key (send 'Authorization: Bearer <key>' with "
                               "the server's --metrics-api-key)", type="authentication_error", code="invalid_api_key")
        # Idle: ask the engine (answered at once). Busy: the snapshot of its last step (at most
        # STATS_INTERVAL_S old), so a scrape never waits for a long step.
        stats = state.engine.latest_stats() if state.engine.num_in_flight else None
        if stats is None:
            stats = await state.engine.call(lambda engine: engine.stats())
        return Response(state.metrics.render(stats), media_type=CONTENT_TYPE)

    return router


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
    def respond(error: APIError) -> JSONResponse:
        state.metrics.count_error(error.status)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return respond(APIError(exc.status_code, str(exc.detail), type=kind))

    app.add_middleware(_UnexpectedErrors, respond=respond)


class _UnexpectedErrors:
    """An unexpected exception becomes a 500 in OpenAI's format, and the connection stays open.

    (Starlette answers an ``Exception`` handler's 500 and then re-raises, which makes uvicorn drop
    a keep-alive connection, so the client's next request on it fails too. Once a response has
    started, a streamed one, there is nothing left to answer: the error is raised as before.)
    """

    def __init__(self, app: ASGIApp, respond: Callable[[APIError], JSONResponse]) -> None:
        self.app, self.respond = app, respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise
            logger.exception("unexpected error in %s %s", scope.get("method"), scope.get("path"))
            response = self.respond(APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                             type="internal_error"))
            await response(scope, receive, send)
