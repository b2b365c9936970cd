"""Fuzz both generation endpoints with bodies derived from their own request models.

Bodies are generated from each endpoint's JSON schema (``model_json_schema()`` of the pydantic
request models), then made hostile: fields replaced by arbitrary JSON, extreme numbers, lone
surrogates, NaN and Infinity literals, unknown fields, and truncated or non-object JSON. Every
response must be 2xx, or 4xx with OpenAI's error body, never 5xx (and no in-band error in a
stream); after each request a known-good request must still succeed. The number of requests sent
is printed (run with -s).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.server.limits import RequestLimits
from pagedkv.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedkv_testing.server import ServerThread, tiny_engine
from pagedkv_testing.tiny_model import write_tiny_model

pytestmark = pytest.mark.timeout(600)

EXAMPLES = 150  # per endpoint (on average); each sends the fuzzed request and a known-good one
SENT = {"requests": 0, "fuzzed 2xx": 0, "fuzzed 4xx": 0}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 70), 2 ** 70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
edge_numbers = st.sampled_from([0, -1, 1, 2 ** 31, 2 ** 63, 10 ** 30, -(10 ** 30), 1e-40, 5e-324, 1e308,
                                -1e308, 0.5, 1.0000001, 4096, 129, 257])


def from_schema(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """A strategy of (mostly) valid instances of one JSON-schema node (the subset pydantic emits)."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in schema:
        return st.one_of(*(from_schema(s, defs) for s in schema["anyOf"]))
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=40)
    if kind == "integer":
        low = schema.get("minimum", -50)
        return st.integers(low, schema.get("maximum", low + 300)) | edge_numbers.filter(lambda v: isinstance(v, int))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        high = schema.get("maximum", schema.get("exclusiveMaximum"))
        if low is None and high is None:
            return st.floats(allow_nan=False, allow_infinity=False) | edge_numbers
        return st.floats(low, high, exclude_min="exclusiveMinimum" in schema,
                         exclude_max="exclusiveMaximum" in schema) | edge_numbers
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), defs), min_size=schema.get("minItems", 0), max_size=4)
    if kind == "object" and "properties" in schema:
        props = {k: from_schema(v, defs) for k, v in schema["properties"].items()}
        required = set(schema.get("required", []))
        return st.fixed_dictionaries({k: props[k] for k in required},
                                     optional={k: v for k, v in props.items() if k not in required})
    return json_values  # Any, dict[str, Any] and friends


def bodies(model: type) -> st.SearchStrategy[bytes]:
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    props = {k: from_schema(v, defs) for k, v in schema["properties"].items()}
    required = sorted(schema.get("required", []))
    optional = sorted(set(props) - set(required))

    @st.composite
    def hostile(draw: st.DrawFn) -> bytes:
        # The required fields, plus a few optional ones drawn from their schema (the rest keep
        # their defaults, so that a body fails for at most a few reasons and often runs).
        body = {k: draw(props[k]) for k in required}
        for k in draw(st.lists(st.sampled_from(optional), max_size=5, unique=True)):
            body[k] = draw(props[k])
        for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):  # replace fields by anything at all
            body[draw(st.sampled_from(sorted(props)))] = draw(json_values | edge_numbers)
        if draw(st.booleans()):
            body[draw(st.text(max_size=10))] = draw(json_values)  # unknown fields are ignored
        raw = json.dumps(body)
        mangle = draw(st.sampled_from(["none"] * 6 + ["surrogate", "nan", "infinity", "truncate", "array"]))
        if mangle == "surrogate" and '"' in raw[1:]:
            at = raw.index('"', 1)
            raw = raw[:at] + "\\ud800" + raw[at:]
        elif mangle in ("nan", "infinity"):
            bad = "NaN" if mangle == "nan" else "Infinity"
            raw = raw[:-1] + (", " if len(body) else "") + f'"temperature": {bad}}}'
        elif mangle == "truncate":
            raw = raw[: draw(st.integers(0, max(len(raw) - 1, 0)))]
        elif mangle == "array":
            raw = f"[{raw}]"
        return raw.encode()

    return hostile()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    engine = tiny_engine(model_dir, block_size=8, num_kv_blocks=512, max_model_len=128, max_num_seqs=64,
                         seed=0, debug_integrity=True)
    limits = RequestLimits(max_request_bytes=1 << 16, max_tokens_per_request=512, max_stop_chars=256)
    with ServerThread(engine, served_model_names=["tiny"], limits=limits) as s:
        yield s
    print(f"\nfuzz: {SENT}")


def check(r: httpx.Response, body: bytes) -> None:
    SENT["requests"] += 1
    SENT[f"fuzzed {r.status_code // 100}xx"] = SENT.get(f"fuzzed {r.status_code // 100}xx", 0) + 1
    assert r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", r.text
        assert not any('"error"' in e and json.loads(e).get("error") for e in events[:-1]), r.text
    else:
        assert r.json()["choices"], r.text


def still_serving(http: httpx.Client, path: str) -> None:
    good = ({"prompt": "hello", "max_tokens": 2} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    r = http.post(path, json=good)
    SENT["requests"] += 1
    assert r.status_code == 200, r.text


ENDPOINTS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


@settings(max_examples=2 * EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(case=st.one_of(*(bodies(model).map(lambda body, path=path: (path, body))
                        for path, model in ENDPOINTS.items())))
def test_fuzz_generation_endpoints(server: ServerThread, case: tuple[str, bytes]) -> None:
    path, body = case
    with httpx.Client(base_url=server.url, timeout=60) as http:
        check(http.post(path, content=body), body)
        still_serving(http, path)


def test_no_block_leaks_after_fuzzing(server: ServerThread) -> None:
    kv = server.wait_idle().kv  # blocks still used are those conversation pins hold (bodies with a conversation_id)
    assert kv.used_blocks == kv.pinned_blocks
