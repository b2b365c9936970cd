"""Tenants on the server: API keys name them, each has its own prefix cache and KV quota."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagedkv.server.cli import read_api_keys
from pagedkv_testing.server import ServerThread, tiny_engine
from pagedkv_testing.tiny_model import write_tiny_model

PROMPT = "the quick brown fox jumps over the lazy dog " * 6


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    model = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    engine = tiny_engine(model, block_size=16, num_kv_blocks=128, max_model_len=512, seed=0,
                         tenant_kv_quota=["team-a=0.5"], default_tenant_kv_quota=0.25)
    with ServerThread(engine, served_model_names=["tiny"],
                      api_keys={"key-a": "team-a", "key-b": "team-b"}) as s:
        yield s


def _cached(server: ServerThread, key: str, salt: str | None = None) -> int:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_each_key_is_a_tenant_with_its_own_cache(server: ServerThread) -> None:
    _cached(server, "key-a")
    assert _cached(server, "key-a") > 0  # the tenant's own prefix cache
    assert _cached(server, "key-b") == 0  # same prompt, another tenant: nothing of team-a's
    assert _cached(server, "key-b", salt="team-a") == 0  # a salt cannot name another tenant
    assert _cached(server, "key-a", salt="x") == 0  # a salt subdivides within the tenant
    assert _cached(server, "key-a", salt="x") > 0
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=30,
                   headers={"Authorization": "Bearer key-c"})
    assert r.status_code == 401


def test_tenant_metrics_name_only_known_tenants(server: ServerThread) -> None:
    _cached(server, "key-b")
    server.wait_idle()
    text = httpx.get(server.url + "/metrics", timeout=30).text
    held = {line.split('tenant="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("pagedkv_tenant_kv_blocks{")}
    assert set(held) == {"team-a", "team-b"} and held["team-a"] > 0 and held["team-b"] > 0
    assert 'pagedkv_tenant_kv_quota_blocks{model_name="tiny",tenant="team-a"} 64.0' in text
    assert 'pagedkv_tenant_kv_quota_blocks{model_name="tiny",tenant="team-b"} 32.0' in text


def test_salt_tenants_are_not_labels(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny")
    engine = tiny_engine(model, block_size=16, num_kv_blocks=64, max_model_len=512, default_tenant_kv_quota=0.5)
    with ServerThread(engine, served_model_names=["tiny"]) as server:  # no keys: the salt is the tenant
        for salt in ("secret-one", "secret-two"):
            r = httpx.post(server.url + "/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "cache_salt": salt})
            assert r.status_code == 200
        server.wait_idle()
        text = httpx.get(server.url + "/metrics", timeout=30).text
    assert "secret" not in text and 'tenant="other"' in text


def test_api_keys_from_flags_and_file(tmp_path: Path) -> None:
    assert read_api_keys(["k"], None) == {"k": None}  # one key: no tenant, as before
    assert read_api_keys(["k1", "k2"], None) == {"k1": "key1", "k2": "key2"}
    f = tmp_path / "keys.json"
    f.write_text(json.dumps({"sk-a": "team-a", "sk-b": "team-b"}))
    assert read_api_keys([], str(f)) == {"sk-a": "team-a", "sk-b": "team-b"}
    for bad, message in (({"sk-a": ""}, "non-empty tenant"), ([1, 2], "JSON object"), ({}, "JSON object")):
        f.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            read_api_keys([], str(f))
    f.write_text(json.dumps({"k": "t"}))
    with pytest.raises(ValueError, match="given twice"):
        read_api_keys(["k"], str(f))
    with pytest.raises(ValueError, match="cannot read"):
        read_api_keys([], str(tmp_path / "missing.json"))


def test_return_cache_details_never_reveals_another_tenant(server: ServerThread) -> None:
    prompt = "a prompt only team-a has sent before " * 4

    def details(key: str) -> dict:
        r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "return_cache_details": True})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]

    first = details("key-a")["cache_details"]["first_miss"]  # (BOS may be shared with its earlier prompts)
    assert first["reason"] in ("never_seen", "partial_block") and first["block"] == 0
    again = details("key-a")
    assert again["cache_details"]["hit_tokens"] == again["cached_tokens"] > 0
    assert again["cache_details"]["first_miss"] is None
    other = details("key-b")  # the same prompt from another tenant: as if never sent
    assert other["cached_tokens"] == 0
    assert other["cache_details"]["hit_tokens"] == 0 and other["cache_details"]["first_miss"] == first
    server.wait_idle()
    text = httpx.get(server.url + "/metrics", timeout=30).text  # counted as its caller was told, too
    assert "different_tenant" not in text
    assert (f'pagedkv_prefix_cache_first_miss_total{{model_name="tiny",reason="{first["reason"]}",tenant="team-b"}}'
            in text)
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": "Bearer key-a"}, timeout=60,
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
    assert "cache_details" not in r.json()["usage"]["prompt_tokens_details"]  # only when asked


def test_conversation_pins_over_http(server: ServerThread) -> None:
    headers = {"Authorization": "Bearer key-a"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "remember the number seven " * 5}],
            "max_tokens": 4, "conversation_id": "chat-42", "pin_ttl_s": 30}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    server.wait_idle()
    assert server.engine_stats().kv.pins >= 1
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "pin_ttl_s": 10 ** 6}, headers=headers,
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "pin_ttl_s"
