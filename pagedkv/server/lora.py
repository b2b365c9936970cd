"""LoRA adapters over HTTP, vLLM's surface: ``--lora-modules``, ``model`` naming an adapter,
adapter cards in ``/v1/models``, runtime load and unload, and the adapters' metrics.

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql"}   200 text
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}                                 200 text

The two routes exist only with ``--allow-runtime-lora-updating`` (or vLLM's environment variable
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), behind the API key like every /v1 route. Errors: an
unknown adapter is a 404 naming it; one that cannot be applied (a rank above ``--max-lora-rank``,
target modules or shapes the base model lacks, DoRA, ...) a 400 saying why; a name already
loaded a 400. The registry is the engine's (``lora/manager.py``); every change runs on the
engine thread.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from pydantic import BaseModel, ConfigDict
from starlette.responses import PlainTextResponse

from pagedkv import envs
from pagedkv.lora.request import LoRAError, LoRARequest
from pagedkv.lora.stats import LoRAStats
from pagedkv.server.protocol import APIError, bad_request, parse_body


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace an adapter already loaded under this name


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str
    lora_int_id: int | None = None


def parse_lora_modules(items: list[str]) -> list[tuple[str, str, str | None]]:
    """``--lora-modules`` values, vLLM's two forms: ``name=path``, or a JSON object
    ``{"name": ..., "path": ..., "base_model_name": ...}``. Returns (name, path, base model name);
    ValueError naming the bad item."""
    out: list[tuple[str, str, str | None]] = []
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                obj = json.loads(item)
            except ValueError as exc:
                raise ValueError(f"--lora-modules: {item!r} is not valid JSON: {exc}") from None
            if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("path"), str)):
                raise ValueError(f"--lora-modules: {item!r} needs string fields \"name\" and \"path\"")
            out.append((obj["name"], obj["path"], obj.get("base_model_name")))
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {item!r} is neither NAME=PATH nor a JSON object")
            out.append((name, path, None))
    names = [n for n, _, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules: a name given twice in {names}")
    return out


def runtime_updates_allowed(flag: bool) -> bool:
    """``--allow-runtime-lora-updating``, or vLLM's environment variable set to true."""
    return flag or envs.ALLOW_RUNTIME_LORA_UPDATING.get()


def register_lora_modules(engine: Any, modules: list[tuple[str, str, str | None]]) -> None:
    """Read and register the ``--lora-modules`` adapters at start (LoRAError for a bad one)."""
    if modules and engine.lora is None:
        raise ValueError("--lora-modules needs --enable-lora")
    for i, (name, path, base) in enumerate(modules, 1):
        engine.lora.add(LoRARequest(name, i, path, base))


def adapter_of(engine: Any, model: str | None) -> str | None:
    """The adapter a request's ``model`` names, else None (the base model, or no such name)."""
    manager = getattr(engine, "lora", None)
    if model is None or manager is None:
        return None
    return model if model in manager.registry else None  # (a dict lookup: safe off the engine thread)


def model_cards(engine: Any, parent: str, created: int) -> list[dict[str, Any]]:
    """vLLM's cards of the adapters: ``root`` the folder, ``parent`` the base model's served name.
    Call on the engine thread."""
    manager = getattr(engine, "lora", None)
    if manager is None:
        return []
    return [{"id": a.name, "object": "model", "created": created, "owned_by": "pagedkv", "root": a.path,
             "parent": parent, "max_model_len": engine.config.max_model_len, "permission": []}
            for a in manager.known()]


def lora_router(state: Any, dependencies: list[Any]) -> APIRouter:
    """The runtime load / unload routes (mount only when runtime updates are allowed)."""
    router = APIRouter(prefix="/v1", dependencies=dependencies)

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = parse_body(await request.body(), LoadLoRAAdapterRequest)
        if body.lora_name in state.served_model_names:
            raise bad_request(f"the name {body.lora_name!r} is the base model's", param="lora_name")

        def load(engine: Any) -> None:
            if engine.lora is None:
                raise APIError(400, "this server serves no LoRA adapters: start it with --enable-lora",
                               param="lora_name")
            if body.lora_name in engine.lora.registry and not body.load_inplace:
                raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded. "
                               f"Unload it first, or send load_inplace: true", param="lora_name")
            old = engine.lora.registry.get(body.lora_name)
            engine.lora.add(LoRARequest(body.lora_name, old.lora_int_id if old else engine.lora.next_int_id(),
                                        body.lora_path))

        await _on_engine(state, load)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = parse_body(await request.body(), UnloadLoRAAdapterRequest)

        def unload(engine: Any) -> None:
            if engine.lora is None:
                raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                               type="not_found_error")
            engine.lora.remove(body.lora_name)

        await _on_engine(state, unload)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router


async def _on_engine(state: Any, fn: Any) -> None:
    try:
        await state.engine.call(fn)
    except LoRAError as exc:
        raise lora_api_error(exc, "lora_name") from None


def lora_api_error(exc: LoRAError, param: str) -> APIError:
    """A LoRAError as the client sees it: 404 for an unknown adapter, else 400."""
    if exc.status == 404:
        return APIError(404, str(exc), type="not_found_error", param=param, code="model_not_found")
    return APIError(exc.status, str(exc), param=param)


def lora_metrics(model: str, stats: LoRAStats) -> Iterator[Metric]:
    """vLLM's ``vllm:lora_requests_info`` (the adapters of running and waiting requests, comma
    separated, and max_loras as labels; the value is the time of the snapshot) and pagedkv's
    requests per adapter."""
    info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                             labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"])
    info.add_metric([",".join(stats.running), str(stats.max_loras), ",".join(stats.waiting)], time.time())
    yield info
    requests = CounterMetricFamily("pagedkv_lora_requests", "Requests admitted per LoRA adapter.",
                                   labels=["model_name", "adapter"])
    for name, n in sorted(stats.requests.items()):
        requests.add_metric([model, name], float(n))
    yield requests
    yield CounterMetricFamily("pagedkv_lora_slot_loads", "LoRA adapters copied into a slot.",
                              value=float(stats.slot_loads))
