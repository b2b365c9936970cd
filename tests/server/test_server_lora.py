"""LoRA adapters over HTTP through openai-python: ``model`` selects the adapter, /v1/models lists
adapters with their parent, runtime load / unload with and without the flag and the key, errors
(404 unknown adapter, 400 rank above the limit), and the adapters' metrics."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from pagedkv.sampling_params import SamplingParams
from pagedkv.server.lora import parse_lora_modules, register_lora_modules
from pagedkv_testing.lora_adapters import make_adapter
from pagedkv_testing.server import ServerThread, tiny_engine
from pagedkv_testing.tiny_model import write_tiny_model

pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KEY = "sk-lora"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("server-lora")
    base = write_tiny_model(tmp / "base")
    make_adapter(base, tmp / "sql", seed=1, r=4, lora_alpha=8, target_modules=ALL, std=0.5)
    make_adapter(base, tmp / "chat", seed=2, r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"], std=0.5)
    make_adapter(base, tmp / "wide", seed=3, r=16, lora_alpha=16, target_modules=["q_proj"])
    return {"base": base, "tmp": tmp}


def _engine(model: dict):
    engine = tiny_engine(model["base"], enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=256)
    register_lora_modules(engine, parse_lora_modules([f"sql={model['tmp'] / 'sql'}"]))
    return engine


def test_model_selects_the_adapter_and_models_lists_it(model: dict) -> None:
    prompt = "the quick brown fox"
    ref = _engine(model)  # the same requests offline
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref.add_request("base", prompt, greedy)
    ref.add_request("sql", prompt, greedy, lora_request="sql")
    done = {}
    while ref.has_unfinished_requests():
        for out in ref.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].text
    assert done["base"] != done["sql"]
    with ServerThread(_engine(model), served_model_names=["tiny"], api_key=KEY) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"tiny", "sql"}
        assert cards["sql"].parent == "tiny" and cards["sql"].root == str(model["tmp"] / "sql")
        for name, want in (("tiny", done["base"]), ("sql", done["sql"])):
            out = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0.0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == want, name
            assert out.model == name  # the adapter's name when one ran it (vLLM's)
        chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hello"}],
                                              max_tokens=4)
        assert chat.choices[0].message.content is not None
        assert chat.model == "sql"
        streamed = client.completions.create(model="sql", prompt=prompt, max_tokens=3, stream=True)
        assert {chunk.model for chunk in streamed} == {"sql"}
        with pytest.raises(openai.NotFoundError, match="nosuch"):
            client.completions.create(model="nosuch", prompt=prompt, max_tokens=2)
        metrics = httpx.get(f"{server.url}/metrics").text
        assert "vllm:lora_requests_info{" in metrics and 'max_lora="2"' in metrics
        assert 'pagedkv_lora_requests_total{adapter="sql",model_name="tiny"} 3.0' in metrics


def test_runtime_load_and_unload_need_the_flag_and_the_key(model: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    tmp = model["tmp"]
    with ServerThread(_engine(model), served_model_names=["tiny"], api_key=KEY) as server:
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(tmp / "chat")},
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 404  # off without the flag
    with ServerThread(_engine(model), served_model_names=["tiny"], api_key=KEY,
                      allow_lora_updates=True) as server:
        url, auth = server.url, {"Authorization": f"Bearer {KEY}"}
        client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
        body = {"lora_name": "chat", "lora_path": str(tmp / "chat")}
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=body).status_code == 401
        r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth)
        assert r.status_code == 200 and "chat" in r.text
        assert {m.id for m in client.models.list().data} == {"tiny", "sql", "chat"}
        assert client.completions.create(model="chat", prompt="hello", max_tokens=3).choices[0].text is not None
        again = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth)
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        wide = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "wide", "lora_path": str(tmp / "wide")},
                          headers=auth)
        assert wide.status_code == 400 and "max_lora_rank 8" in wide.json()["error"]["message"]
        missing = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp / "nope")},
                             headers=auth)
        assert missing.status_code == 400
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 401
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat"}, headers=auth).status_code == 200
        gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "chat"}, headers=auth)
        assert gone.status_code == 404 and "chat" in gone.json()["error"]["message"]
        with pytest.raises(openai.NotFoundError, match="chat"):
            client.completions.create(model="chat", prompt="hello", max_tokens=2)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # vLLM's switch
    with ServerThread(_engine(model), served_model_names=["tiny"]) as server:
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(tmp / "chat")})
        assert r.status_code == 200


def test_bad_lora_modules_refuse_to_start(model: dict, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_lora_modules(["justaname"])
    with pytest.raises(ValueError, match="enable-lora"):
        register_lora_modules(tiny_engine(model["base"], num_kv_blocks=64), [("a", str(model["tmp"] / "sql"), None)])
    engine = tiny_engine(model["base"], enable_lora=True, max_lora_rank=8, num_kv_blocks=64)
    with pytest.raises(ValueError, match="max_lora_rank"):
        register_lora_modules(engine, parse_lora_modules([f'{{"name": "w", "path": "{model["tmp"] / "wide"}"}}']))
