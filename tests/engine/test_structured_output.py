"""Structured output (JSON schema, regex, choice) on a tiny random model, whose unconstrained
samples are garbage: every completion that finishes with "stop" must match, with random sampling,
n > 1, next to unconstrained requests (which must not change by a bit), under forced preemption,
and through the real ``openai`` client."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch

from pagedkv import SamplingParams, StructuredOutput
from pagedkv.engine import LLMEngine, RequestRejectedError
from pagedkv.engine.structured_output import apply_bitmask, unpack_bitmask
from pagedkv_testing.server import ServerThread, run_engine, tiny_engine
from pagedkv_testing.tiny_model import write_tiny_model

pytestmark = pytest.mark.timeout(180)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{2,5}-[0-9]{1,4}(\.[xy])?"
CHOICES = ["yes", "no", "maybe so", "a+b (c)"]


def matches(so: StructuredOutput, text: str) -> bool:
    if so.regex is not None:
        return re.fullmatch(so.regex, text) is not None
    if so.choice is not None:
        return text in so.choice
    value = json.loads(text)
    jsonschema.validate(value, so.json if so.json is not None else {"type": "object"})
    return True


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def run(engine: LLMEngine, requests: dict[str, SamplingParams], prompt: str = "hello world") -> dict:
    return run_engine(engine, [(rid, prompt, params) for rid, params in requests.items()])


KINDS = {"json": StructuredOutput(json=SCHEMA), "json_object": StructuredOutput(json_object=True),
         "regex": StructuredOutput(regex=REGEX), "choice": StructuredOutput(choice=CHOICES)}


@pytest.mark.parametrize("kind", list(KINDS))
def test_random_sampling_matches_the_grammar(model_dir: Path, kind: str) -> None:
    so = KINDS[kind]
    engine = tiny_engine(model_dir, num_kv_blocks=400, seed=0)
    requests = {f"r{seed}": SamplingParams(temperature=1.0, seed=seed, n=3, max_tokens=80, structured_output=so)
                for seed in range(4)}
    outs = run(engine, requests)
    completions = [c for o in outs.values() for c in o.outputs]
    stopped = [c for c in completions if c.finish_reason == "stop"]
    assert len(stopped) >= len(completions) // 2, [(c.finish_reason, c.text) for c in completions]
    for c in stopped:
        assert c.token_ids[-1] in engine.outputs.eos_token_ids
        assert matches(so, c.text), c.text
    if kind != "json_object":  # (this model's favourite object is {})
        assert len({c.text for c in completions}) > 1  # the forks sampled on their own


def test_unconstrained_requests_are_unchanged_by_a_constrained_neighbour(model_dir: Path) -> None:
    others = {"greedy": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              "seeded": SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True, n=2),
              "penalized": SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=24, ignore_eos=True)}
    alone = run(tiny_engine(model_dir, num_kv_blocks=400, seed=0), others)
    constrained = {"json": SamplingParams(temperature=1.0, seed=1, max_tokens=40, structured_output=KINDS["json"]),
                   "json-penalized": SamplingParams(temperature=0.0, presence_penalty=1.0, max_tokens=40,
                                                    structured_output=KINDS["regex"])}
    mixed = run(tiny_engine(model_dir, num_kv_blocks=400, seed=0), {**constrained, **others})
    for rid in others:
        assert [c.token_ids for c in mixed[rid].outputs] == [c.token_ids for c in alone[rid].outputs], rid
    for rid, params in constrained.items():
        c = mixed[rid].outputs[0]
        assert c.finish_reason != "stop" or matches(params.structured_output, c.text), c.text


def test_preemption_does_not_advance_the_grammar_twice(model_dir: Path) -> None:
    """Forced preemption (recompute and swap) and faults: the same seeded outputs as a clean run."""
    requests = {f"{kind}{seed}": SamplingParams(temperature=1.0, seed=seed, n=2, max_tokens=40, structured_output=so)
                for kind, so in KINDS.items() for seed in range(2)}
    prompts = "the quick brown fox jumps over the lazy dog " * 2
    clean = run(tiny_engine(model_dir, num_kv_blocks=400, seed=0), requests, prompts)
    preemptions = 0
    for mode, seed in [("recompute", 0), ("recompute", 1), ("swap", 2)]:
        engine = tiny_engine(model_dir, block_size=4, num_kv_blocks=48, max_num_batched_tokens=48,
                             swap_space=0.0002, preemption_mode=mode, seed=0, debug_integrity=True,
                             fault_injection=f"seed={seed},rate=0.15")
        got = run(engine, requests, prompts)
        for rid in requests:
            assert [c.token_ids for c in got[rid].outputs] == [c.token_ids for c in clean[rid].outputs], (mode, rid)
        stats = engine.stats()
        preemptions += stats.preemptions_recompute + stats.preemptions_swap
    assert preemptions > 0


def test_bad_grammars_and_beam_search_are_rejected(model_dir: Path) -> None:
    engine = tiny_engine(model_dir, num_kv_blocks=64, seed=0)
    for so in [StructuredOutput(regex="(ab"), StructuredOutput(json={"type": "nonsense"}),
               StructuredOutput(regex=r"[^\s\S]")]:
        with pytest.raises(RequestRejectedError) as info:
            engine.add_request("x", "hi", SamplingParams(structured_output=so))
        assert info.value.param == "structured_output"
    with pytest.raises(RequestRejectedError, match="beam search"):
        engine.add_request("b", "hi", SamplingParams(structured_output=KINDS["regex"]), beam_width=2)
    assert not engine.has_unfinished_requests()
    for bad in [dict(), dict(regex="a", choice=["a"]), dict(choice=[]), dict(choice="ab"), dict(json=[1]),
                dict(json="{not json")]:
        with pytest.raises(ValueError):
            StructuredOutput(**bad)


def test_bitmask_unpacking_against_a_reference() -> None:
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 5), dtype=torch.int32, generator=g)
    for vocab in (150, 160, 170):  # inside, at and past the bitmask's 160 bits
        want = torch.tensor([[t < 160 and bool((int(words[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab)]
                             for r in range(3)])
        assert torch.equal(unpack_bitmask(words, vocab), want)
        logits = torch.randn(3, vocab, generator=g)
        assert torch.equal(apply_bitmask(logits, words), torch.where(want, logits, float("-inf")))


# ---------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerThread]:
    engine = tiny_engine(model_dir, block_size=16, num_kv_blocks=512, max_model_len=512, seed=0)
    with ServerThread(engine, served_model_names=["tiny"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def test_openai_client_json_schema(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    stopped = 0
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a person"}],
                                           response_format=fmt, n=2, temperature=1.0, seed=seed, max_tokens=80)
        for choice in r.choices:
            if choice.finish_reason == "stop":
                stopped += 1
                jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert stopped >= 3
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "json"}],
                                       response_format={"type": "json_object"}, temperature=1.0, seed=5,
                                       max_tokens=80)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("extra,check", [
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
])
def test_vllm_guided_fields(client: openai.OpenAI, extra: dict, check) -> None:
    r = client.completions.create(model="tiny", prompt="answer:", n=3, temperature=1.0, seed=3, max_tokens=60,
                                  extra_body=extra)
    texts = [c.text for c in r.choices if c.finish_reason == "stop"]
    assert texts and all(check(t) for t in texts), [(c.finish_reason, c.text) for c in r.choices]


@pytest.mark.parametrize("body,param", [
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: x"}}, "structured_outputs"),
])
def test_bad_structured_output_is_400(server: ServerThread, body: dict, param: str) -> None:
    r = httpx.post(f"{server.base_url}/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = httpx.post(f"{server.base_url}/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2,
                                                            "response_format": {"type": "text"}})
    assert ok.status_code == 200
