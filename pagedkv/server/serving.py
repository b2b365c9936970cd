"""One generation request, from validated body to HTTP response, shared by both endpoints.

    limits (400 stop strings) -> admit (503 draining, 429 queue full)
        -> tokenize in a worker thread (400 too long / rejected; 400 too much work)
        -> add to engine
        -> stream: SSE events, or full: one JSON body once every choice has finished
        -> release the admission, abort whatever is unfinished (client gone), observe latencies

Choices are numbered ``prompt_index * n + completion_index``. Text deltas are cut from the
engine's cumulative outputs, so a step that produced several tokens sends them in one event.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedkv.engine import DEFAULT_TENANT, EngineDeadError, RequestTooLongError, TokenizedPrompt
from pagedkv.engine.grammar_compiler import CompiledGrammar, GrammarError, GrammarLimitError
from pagedkv.lora.request import LoRAError
from pagedkv.outputs import CompletionOutput, RequestOutput
from pagedkv.sampling_params import SamplingParams
from pagedkv.server.async_engine import AsyncEngine, OutputStream
from pagedkv.server.connections import UploadSlots
from pagedkv.server.heavy_work import HeavyWork, dumps_response
from pagedkv.server.limits import ConnectionLimits, RequestLimits
from pagedkv.server.logs import note_generation
from pagedkv.server.lora import adapter_of, lora_api_error
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.protocol import APIError, bad_request
from pagedkv.server.responses import ResponseFormat, Usage

# How often a non-streaming request checks whether its client is still there.
_DISCONNECT_POLL_S = 0.5
# A whole response body with fewer tokens and logprobs entries than this is built on the event loop.
_INLINE_ENTRIES = 4096


@dataclass(slots=True)
class ServerState:
    """What the handlers of one app share. Mutated only on the event loop."""

    engine: AsyncEngine
    metrics: ServerMetrics
    served_model_names: list[str]
    max_num_seqs: int  # the engine's (EngineConfig owns it)
    api_keys: dict[str, str | None] = field(default_factory=dict)  # key -> its tenant (None: none)
    max_queue: int | None = None  # engine requests beyond max_num_seqs allowed to wait; None = no limit
    limits: RequestLimits = field(default_factory=RequestLimits)
    connection_limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    heavy: HeavyWork = field(default_factory=HeavyWork)  # large bodies and responses, off the loop
    uploads: UploadSlots = field(default_factory=lambda: UploadSlots(ConnectionLimits().max_uploads))
    metrics_api_key: str | None = None  # /metrics needs it when set
    draining: bool = False
    active: int = 0  # engine requests admitted and not yet answered

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is a served name of the base model or a LoRA adapter's (server/lora.py)."""
        if model is not None and model not in self.served_model_names and self.adapter_of(model) is None:
            raise APIError(404, f"The model `{model}` does not exist. Served: {self.served_model_names}",
                           type="not_found_error", param="model", code="model_not_found")

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter ``model`` names (None: the base model)."""
        return None if model in self.served_model_names else adapter_of(self.engine.engine, model)

    def check_text_length(self, text: str | int, param: str) -> None:
        """400 (context_length_exceeded) when ``text`` (or a length in characters) must have
        max_model_len tokens or more: the engine's rule for text prompts (one token stands for at
        most ``max_chars_per_token`` characters), applied before text is tokenized, so a huge text
        costs no tokenizer time or memory. Never refuses text that fits."""
        engine = self.engine.engine
        L, per_token = engine.config.max_model_len, getattr(engine.tokenizer, "max_chars_per_token", None)
        size = text if isinstance(text, int) else len(text)
        if per_token and size > L * per_token:
            raise bad_request(f"the text has {size} characters, so more than {L} tokens (one token stands for "
                              f"at most {per_token} characters), but max_model_len is {L}: shorten it",
                              param=param, code="context_length_exceeded")

    def admit(self, count: int) -> Callable[[], None]:
        """Count ``count`` engine requests in, or raise 503 (draining) / 429 (queue full)."""
        if self.draining:
            raise APIError(503, "the server is shutting down", type="service_unavailable",
                           code="server_draining", headers={"Retry-After": "5"})
        if self.engine.is_dead:
            raise APIError(503, "the engine has stopped", type="service_unavailable", code="engine_dead")
        if self.max_queue is not None and self.active + count > self.max_num_seqs + self.max_queue:
            raise APIError(429, f"too many requests: {self.active} in flight, {self.max_num_seqs} run at "
                           f"once and at most {self.max_queue} may wait", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"})
        self.active += count
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.active -= count

        return release


def message_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the chat messages' text: the rendered template holds at least these (for
    ``ServerState.check_text_length`` before rendering a huge conversation)."""
    return sum(len(c) for m in messages if isinstance(c := m.get("content"), str))


@dataclass(slots=True)
class _Tracker:
    """Per-request timings and final outputs; observes the latency histograms once."""

    arrival: float
    first_token: dict[str, float] = field(default_factory=dict)
    final: dict[str, RequestOutput] = field(default_factory=dict)
    last_token: dict[str, tuple[float, int]] = field(default_factory=dict)  # time, tokens so far
    gaps: list[float] = field(default_factory=list)  # inter-token latencies, one per token after the first

    def update(self, out: RequestOutput) -> None:
        ntok = max((len(c.token_ids) for c in out.outputs), default=0)
        if ntok:
            now = time.monotonic()
            if out.request_id not in self.first_token:
                self.first_token[out.request_id] = now
            last = self.last_token.get(out.request_id)
            if last is not None and ntok > last[1]:  # several tokens in one delivery share the gap
                self.gaps.extend([(now - last[0]) / (ntok - last[1])] * (ntok - last[1]))
            if last is None or ntok > last[1]:
                self.last_token[out.request_id] = (now, ntok)
        if out.finished:
            self.final[out.request_id] = out

    def observe(self, metrics: ServerMetrics, tenant: str) -> None:
        now = time.monotonic()
        metrics.observe_inter_token(self.gaps)
        for rid, out in self.final.items():
            if out.cache_details is not None:  # what its caller may see: never another tenant's cache
                metrics.count_first_miss(out.cache_details.caller_reason, tenant)
            first = self.first_token.get(rid)
            ntok = max((len(c.token_ids) for c in out.outputs), default=0)
            metrics.observe_request(ttft=None if first is None else first - self.arrival,
                                    e2e=now - self.arrival, num_output_tokens=ntok)
            metrics.observe_phases(out.metrics or {}, len(out.prompt_token_ids),
                                   sum(len(c.token_ids) for c in out.outputs))
            for c in out.outputs:
                metrics.count_finish(c.finish_reason)


@dataclass(slots=True)
class Generation:
    """Everything one endpoint call needs after validation."""

    prompts: list[str | list[int]]
    params: SamplingParams
    fmt: ResponseFormat
    stream: bool
    include_usage: bool = False
    echo: bool = False
    cache_salt: str | None = None
    priority: int = 0
    tenant: str | None = None  # the API key's tenant (None: the cache_salt is the tenant)
    return_cache_details: bool = False  # usage.prompt_tokens_details.cache_details
    conversation_id: str | None = None  # pin the turn's prefix (memory/pins.py) for pin_ttl_s
    pin_ttl_s: float | None = None
    grammar_param: str = "structured_output"  # the request field that gave params.structured_output
    lora: str | None = None  # the LoRA adapter ``model`` named (server/lora.py), None: the base model


async def serve_generation(state: ServerState, request: Request, gen: Generation) -> Response:
    _check_stops(gen.params, state.limits)
    _check_priority_and_bias(gen, state.limits)
    release = state.admit(len(gen.prompts))
    base_id = f"{gen.fmt.id_prefix}-{uuid.uuid4().hex}"
    tracker = _Tracker(arrival=time.monotonic())
    try:
        prompts = await _tokenize(state, gen)
        grammar = await _compile_grammar(state, gen)  # held until added: the engine then only copies it
        stream = await state.engine.add_requests(
            [(f"{base_id}-{i}", p) for i, p in enumerate(prompts)], gen.params,
            cache_salt=gen.cache_salt, priority=gen.priority, tenant=gen.tenant,
            conversation_id=gen.conversation_id, pin_ttl_s=gen.pin_ttl_s, lora_request=gen.lora,
        )
        del grammar
    except EngineDeadError as exc:
        release()
        raise APIError(503, str(exc), type="service_unavailable", code="engine_dead") from exc
    except LoRAError as exc:  # its adapter was unloaded meanwhile (404), or cannot be read now
        release()
        raise lora_api_error(exc, "model") from exc
    except ValueError as exc:  # RequestRejectedError, RequestTooLongError, bad token ids
        release()
        code = "context_length_exceeded" if isinstance(exc, RequestTooLongError) else "invalid_prompt"
        param = getattr(exc, "param", None)  # a field other than the prompt (logit_bias)
        raise bad_request(str(exc), param=param or gen.fmt.prompt_param, code=None if param else code) from exc
    except BaseException:
        release()
        raise
    rendering = _Rendering(state, gen, base_id, stream, tracker)

    def cleanup() -> None:
        stream.abort()  # no-op once every request finished
        release()
        if not stream.aborted:  # the tenant as the engine counts it: the key's, else the salt, else default
            tracker.observe(state.metrics, gen.tenant if gen.tenant is not None else gen.cache_salt or DEFAULT_TENANT)
            state.metrics.observe_finished(tracker.final.values(), gen.params.n, gen.params.max_tokens)
        note_generation(request.scope, prompt_tokens=sum(len(p.token_ids) for p in prompts),  # its log line
                        outputs=list(tracker.final.values()), first_token_at=min(tracker.first_token.values(),
                                                                                 default=None),
                        tokens_so_far=sum(n for _, n in tracker.last_token.values()), tenant=gen.tenant,
                        aborted=stream.aborted)

    if gen.stream:
        return _EventStreamResponse(rendering.events(), cleanup)
    try:
        body = await rendering.full(request.is_disconnected)
    finally:
        cleanup()
    state.heavy.handled(len(body))
    return Response(body, media_type="application/json")


async def _compile_grammar(state: ServerState, gen: Generation) -> CompiledGrammar | None:
    """The request's grammar, compiled off the event loop and the engine thread (a request whose
    grammar compiles waits here; the engine's steps go on). A 400 naming the request's field
    when it is invalid or past a limit (code grammar_limit_exceeded, the message naming the limit)."""
    so = gen.params.structured_output
    if so is None:
        return None
    try:
        future = await asyncio.to_thread(state.engine.engine.compile_grammar, so)  # the key: O(size)
        return await asyncio.wrap_future(future)
    except GrammarError as exc:
        code = "grammar_limit_exceeded" if isinstance(exc, GrammarLimitError) else None
        raise bad_request(f"{gen.grammar_param}: {exc}", param=gen.grammar_param, code=code) from None


def _check_priority_and_bias(gen: Generation, limits: RequestLimits) -> None:
    refused = limits.priority_error(gen.priority, gen.tenant)
    if refused is not None:
        status, message = refused
        raise APIError(status, message, type="invalid_request_error" if status == 400 else "permission_error",
                       param="priority", code=None if status == 400 else "priority_not_permitted")
    bias = gen.params.logit_bias
    if limits.max_logit_bias is not None and bias and len(bias) > limits.max_logit_bias:
        raise bad_request(f"logit_bias has {len(bias)} entries; this server allows {limits.max_logit_bias} "
                          f"(--max-logit-bias)", param="logit_bias", code="request_too_large")


def _check_stops(params: SamplingParams, limits: RequestLimits) -> None:
    size = sum(len(stop) for stop in params.stop)
    if size > limits.max_stop_chars:
        raise bad_request(f"the stop strings have {size} characters in all; this server allows "
                          f"{limits.max_stop_chars} (--max-stop-chars)", param="stop", code="request_too_large")
    if len(params.stop_token_ids) > limits.max_stop_token_ids:
        raise bad_request(f"{len(params.stop_token_ids)} stop token ids; this server allows "
                          f"{limits.max_stop_token_ids} (--max-stop-token-ids)", param="stop_token_ids",
                          code="request_too_large")


async def _tokenize(state: ServerState, gen: Generation) -> list[TokenizedPrompt]:
    """Tokenize off the event loop and the engine thread; then bound the work asked for."""
    engine, p = state.engine.engine, gen.params

    def tokenize() -> tuple[list[TokenizedPrompt], list[int]]:
        prompts = [engine.tokenize(prompt) for prompt in gen.prompts]
        # The engine's own rule for the new tokens each may take.
        return prompts, [engine.inputs.max_new_tokens(len(t.token_ids), p) for t in prompts]

    prompts, max_new = await asyncio.to_thread(tokenize)
    limit = state.limits.max_tokens_per_request
    work = p.n * sum(max_new)
    echoed = sum(p.n * len(t.token_ids) for t in prompts) if p.prompt_logprobs is not None else 0
    if work + echoed > limit:
        echo = f", plus {echoed} echoed prompt tokens with logprobs" if echoed else ""
        raise bad_request(
            f"the request may generate {work} tokens ({len(prompts) * p.n} choices, each up to "
            f"{'max_tokens' if p.max_tokens else 'the rest of the context'}){echo}; this server allows "
            f"{limit} per request (--max-tokens-per-request): lower n or max_tokens", param="max_tokens",
            code="request_too_large")
    return prompts


class _EventStreamResponse(StreamingResponse):
    """SSE response whose cleanup runs even when the client leaves before the first event."""

    def __init__(self, events: AsyncIterator[str], cleanup: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


@dataclass(slots=True)
class _ChoiceState:
    text_len: int = 0  # characters already sent
    num_tokens: int = 0  # tokens already sent
    done: bool = False


class _Rendering:
    """Turns the engine's cumulative outputs into OpenAI bodies for one HTTP request."""

    def __init__(self, state: ServerState, gen: Generation, base_id: str, stream: OutputStream,
                 tracker: _Tracker) -> None:
        self.state, self.gen, self.base_id, self.stream, self.tracker = state, gen, base_id, stream, tracker
        self.n = gen.params.n
        self.num_choices = len(gen.prompts) * self.n
        self.choices = [_ChoiceState() for _ in range(self.num_choices)]
        self.wants_logprobs = gen.params.logprobs is not None
        self.holdback = max((len(stop) for stop in gen.params.stop), default=1) - 1
        self._decoded: dict[int, str] = {}  # token id -> text, for logprobs
        self._echoed_logprobs: dict[str, dict[str, Any]] = {}  # request id -> its prompt's logprobs

    @property
    def _model(self) -> str:
        """The ``model`` of the response: the LoRA adapter's name when one ran it (vLLM's), else the base's."""
        return self.gen.lora or self.state.model_name

    def _choice_index(self, out: RequestOutput, comp: CompletionOutput) -> int:
        return int(out.request_id.rsplit("-", 1)[1]) * self.n + comp.index

    def _decode(self, token_id: int) -> str:
        text = self._decoded.get(token_id)
        if text is None:
            text = self._decoded[token_id] = self.state.engine.engine.tokenizer.decode([token_id])
        return text

    def _prompt_text(self, out: RequestOutput) -> str:
        if out.prompt is not None:
            return out.prompt
        return self.state.engine.engine.tokenizer.decode(out.prompt_token_ids)

    def _logprobs(self, comp: CompletionOutput, start: int, offset: int,
                  echoed: RequestOutput | None = None) -> dict[str, Any] | None:
        """Logprobs of the completion's tokens from ``start`` (text offsets from ``offset``); with
        ``echoed``, those of that request's prompt tokens first (echo, which starts at offset 0)."""
        if not self.wants_logprobs or comp.logprobs is None:
            return None
        fmt = self.gen.fmt
        body = fmt.logprobs(comp.token_ids[start:], comp.logprobs[start:], self._decode, offset)
        if echoed is None or echoed.prompt_logprobs is None:
            return body
        prompt = self._echoed_logprobs.get(echoed.request_id)
        if prompt is None:  # built once per request, whatever its number of choices
            prompt = fmt.logprobs(echoed.prompt_token_ids, echoed.prompt_logprobs, self._decode, 0)
            self._echoed_logprobs[echoed.request_id] = prompt
        return {key: prompt[key] + body[key] for key in body}

    def _usage(self) -> Usage:
        usage = Usage(cache_details=[] if self.gen.return_cache_details else None)
        for out in sorted(self.tracker.final.values(), key=lambda o: int(o.request_id.rsplit("-", 1)[1])):
            usage.add_request(out)
        return usage

    async def full(self, is_disconnected: Callable[[], Awaitable[bool]]) -> bytes:
        """The whole response body, encoded; built in the heavy-work pool (with echo and logprobs
        on many choices it is tens of megabytes)."""
        async def watch() -> None:
            while True:
                await asyncio.sleep(_DISCONNECT_POLL_S)
                if await is_disconnected():
                    self.stream.abort()
                    return

        watcher = asyncio.create_task(watch())
        try:
            async for out in self.stream:
                self.tracker.update(out)
        except Exception as exc:  # the engine failed this request (EngineDeadError, step failure)
            raise APIError(500, str(exc), type="internal_error", code="engine_error") from exc
        finally:
            watcher.cancel()
        if self.stream.aborted:
            raise APIError(499, "client disconnected", code="client_closed_request")
        if self._entries() < _INLINE_ENTRIES:  # a small body: a thread hop would cost more than building it
            return self._full_body()
        return await self.state.heavy.run(self._full_body)

    def _entries(self) -> int:
        """About how many tokens (each with its logprobs entries) the body will hold."""
        outs = self.tracker.final.values()
        tokens = sum(len(c.token_ids) for out in outs for c in out.outputs)
        if self.gen.echo:
            tokens += sum(self.n * len(out.prompt_token_ids) for out in outs)
        return tokens * (2 + (self.gen.params.logprobs or 0)) if self.wants_logprobs else tokens

    def _full_body(self) -> bytes:
        choices = []
        for out in sorted(self.tracker.final.values(), key=lambda o: int(o.request_id.rsplit("-", 1)[1])):
            prefix = self._prompt_text(out) if self.gen.echo else ""
            for comp in out.outputs:
                logprobs = self._logprobs(comp, 0, len(prefix), out if self.gen.echo else None)
                choices.append(self.gen.fmt.choice(self._choice_index(out, comp), prefix + comp.text,
                                                   logprobs, comp.finish_reason))
        choices.sort(key=lambda c: c["index"])
        return dumps_response(self.gen.fmt.full(self.base_id, self._model, choices, self._usage()))

    async def events(self) -> AsyncIterator[str]:
        fmt, model = self.gen.fmt, self._model
        usage_field = {"usage": None} if self.gen.include_usage else {}
        first = fmt.first_deltas(self.num_choices)
        if first:
            yield _sse(fmt.chunk(self.base_id, model, first) | usage_field)
        try:
            async for out in self.stream:
                self.tracker.update(out)
                if self.gen.echo and self.wants_logprobs:  # the prompt's logprobs in each choice's first delta
                    event = await self.state.heavy.run(self._event, out, usage_field)
                else:
                    event = self._event(out, usage_field)
                if event:
                    yield event
        except Exception as exc:  # noqa: BLE001 - the engine failed this request; headers are sent: report in-band
            yield _sse(APIError(500, str(exc), type="internal_error", code="engine_error").body())
            yield "data: [DONE]\n\n"
            return
        if self.gen.include_usage:
            yield _sse(fmt.chunk(self.base_id, model, [], self._usage()))
        yield "data: [DONE]\n\n"

    def _event(self, out: RequestOutput, usage_field: dict[str, Any]) -> str | None:
        deltas = [d for comp in out.outputs if (d := self._delta(out, comp)) is not None]
        if not deltas:
            return None
        chunk = self.gen.fmt.chunk(self.base_id, self._model, deltas) | usage_field
        return f"data: {dumps_response(chunk, allow_nan=True).decode()}\n\n"  # as _sse writes it

    def _delta(self, out: RequestOutput, comp: CompletionOutput) -> dict[str, Any] | None:
        index = self._choice_index(out, comp)
        st = self.choices[index]
        if st.done:
            return None
        prefix = ""
        if self.gen.echo and st.num_tokens == 0 and st.text_len == 0:
            prefix = self._prompt_text(out)
        # Sent text cannot be taken back, and the engine cuts a stop string out of text it already
        # returned: hold back the last len(longest stop) - 1 characters until the choice finishes.
        finished = comp.finish_reason is not None
        ready = len(comp.text) if finished else len(comp.text) - self.holdback
        text = comp.text[st.text_len:ready] if ready > st.text_len else ""
        logprobs = None
        if len(comp.token_ids) > st.num_tokens or prefix:
            logprobs = self._logprobs(comp, st.num_tokens, len(prefix) + st.text_len, out if prefix else None)
        st.text_len = max(st.text_len, ready)
        st.num_tokens = len(comp.token_ids)
        st.done = finished
        if not text and not prefix and not st.done and logprobs is None:
            return None
        return self.gen.fmt.delta(index, prefix + text, logprobs, comp.finish_reason)
