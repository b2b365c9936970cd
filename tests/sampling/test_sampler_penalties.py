"""Repetition, presence and frequency penalties, logit_bias, and generation_config.json defaults.

The batched sampler against a plain per-row reference (exact equality of the processed logits);
rows without penalties untouched in a mixed batch; greedy decoding through the engine against
transformers' ``generate(repetition_penalty=...)`` and a recompute loop; validation; the HTTP
fields; the defaults of a model's generation_config.json in ``LLM`` and the server.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.engine import RequestRejectedError
from pagedkv.sampling.sampler import Sampler, SampleRow, apply_penalties, make_generator
from pagedkv.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedkv_testing.hf_checkpoints import hf_logits, load_hf_reference, make_hf_checkpoint
from pagedkv_testing.server import ServerThread, tiny_engine
from pagedkv_testing.tiny_model import write_tiny_model

pytestmark = pytest.mark.timeout(300)

VOCAB = 40
F32 = torch.float32


def reference(row: torch.Tensor, p: SamplingParams, token_ids: list[int], prompt_len: int) -> torch.Tensor:
    """One row by the rules, token by token (float32 scalars, the same operations in the same order)."""
    x = row.clone()
    for t, b in (p.logit_bias or {}).items():
        x[t] = x[t] + torch.tensor(b, dtype=F32)
    rep = torch.tensor(p.repetition_penalty, dtype=F32)
    if p.repetition_penalty != 1.0:
        for t in set(token_ids):
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    counts = Counter(token_ids[prompt_len:])
    for t, c in counts.items():
        x[t] = x[t] - torch.tensor(p.frequency_penalty, dtype=F32) * torch.tensor(float(c), dtype=F32)
    for t in counts:
        x[t] = x[t] - torch.tensor(p.presence_penalty, dtype=F32)
    return x


def random_params(rng: random.Random, **extra) -> SamplingParams:
    pick = rng.random
    return SamplingParams(
        repetition_penalty=rng.choice([1.0, 1.0, 0.5, 1.3, 2.0, rng.uniform(0.1, 3)]),
        presence_penalty=rng.choice([0.0, 0.0, -2.0, 0.7, rng.uniform(-2, 2)]),
        frequency_penalty=rng.choice([0.0, 0.0, 2.0, -0.3, rng.uniform(-2, 2)]),
        logit_bias={rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randrange(4))} if pick() < 0.5
        else None, **extra)


def random_history(rng: random.Random) -> tuple[list[int], int]:
    prompt_len = rng.randrange(1, 12)
    ids = [rng.randrange(VOCAB) for _ in range(prompt_len + rng.randrange(0, 15))]
    return ids, prompt_len


@pytest.mark.parametrize("seed", range(40))
def test_batched_penalties_equal_the_per_row_reference(seed: int) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    m = rng.randrange(1, 7)
    logits = torch.randn(m, VOCAB, generator=gen) * 4
    logits[0, rng.randrange(VOCAB)] = float("-inf")  # a token the model rules out stays out
    rows = []
    for i in range(m):
        ids, prompt_len = random_history(rng)
        rows.append(SampleRow(i, random_params(rng), None, ids, prompt_len))
    got = apply_penalties(logits.clone(), rows)
    for i, r in enumerate(rows):
        want = reference(logits[i], r.params, list(r.token_ids), r.prompt_len)
        assert torch.equal(got[i], want), (i, r.params)


@pytest.mark.parametrize("name,value", [("repetition_penalty", 1.7), ("presence_penalty", 1.5),
                                        ("frequency_penalty", 0.8), ("logit_bias", {3: -5.0, 7: 2.5})])
def test_each_penalty_alone(name: str, value) -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    ids, prompt_len = [3, 4, 5, 3, 7, 7, 7, 9], 3
    p = SamplingParams(**{name: value})
    got = apply_penalties(logits.clone(), [SampleRow(0, p, None, ids, prompt_len)])[0]
    assert torch.equal(got, reference(logits[0], p, ids, prompt_len))
    changed = set(torch.nonzero(got != logits[0]).flatten().tolist())
    expected = {"repetition_penalty": {3, 4, 5, 7, 9}, "logit_bias": {3, 7}}.get(name, {3, 7, 9})  # output: 3, 7, 9
    assert changed == expected
    if name == "frequency_penalty":  # count-weighted: 7 appears three times in the output
        assert torch.allclose(logits[0, 7] - got[7], torch.tensor(3 * 0.8))


def test_mixed_batch_leaves_other_rows_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, VOCAB, generator=gen)
    before = logits.clone()
    plain = [SampleRow(0, SamplingParams(temperature=0.0), None, [1, 2, 3], 2),
             SampleRow(2, SamplingParams(temperature=0.8, seed=4, logprobs=3), make_generator(4), [5, 5], 1),
             SampleRow(4, SamplingParams(temperature=1.0, top_k=5, seed=9), make_generator(9), [7], 1)]
    penalized = [SampleRow(1, SamplingParams(temperature=0.0, repetition_penalty=1.9), None, [1, 2, 3, 3], 2),
                 SampleRow(3, SamplingParams(temperature=0.7, seed=2, presence_penalty=2.0, logit_bias={0: 9.0}),
                           make_generator(2), [0, 1, 1], 1),
                 # shares logits row 2 with a plain row, not its history
                 SampleRow(2, SamplingParams(temperature=0.0, frequency_penalty=2.0), None, [5, 5, 6, 6], 1)]
    alone = Sampler(seed=3).prepare(logits, plain)
    alone_tokens = [alone.sample(r) for r in plain]
    plain = [SampleRow(r.row, r.params, make_generator(r.params.seed) if r.params.seed is not None else None,
                       r.token_ids, r.prompt_len) for r in plain]
    mixed = Sampler(seed=3).prepare(logits, [plain[0], penalized[0], plain[1], penalized[1], penalized[2], plain[2]])
    for r, want in zip(plain, alone_tokens):
        assert torch.equal(mixed.row_logits(r), before[r.row])  # the very values, not a processed copy
        assert mixed.sample(r) == want
    for r in penalized:
        assert torch.equal(mixed.row_logits(r), reference(before[r.row], r.params, r.token_ids, r.prompt_len))
    assert mixed.sample(penalized[0]).token == int(mixed.row_logits(penalized[0]).argmax())
    assert torch.equal(logits, before)  # the step's logits are not modified in place


def test_logprobs_are_the_models_and_greedy_follows_the_penalties() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, -1.0]])
    row = SampleRow(0, SamplingParams(temperature=0.0, logprobs=1, repetition_penalty=3.0), None, [1], 1)
    s = Sampler().sample(logits, [row])[0]
    assert s.token == 2  # 3.0 / 3 = 1.0 < 2.0
    assert s.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[2]))  # vLLM v1: raw logprobs


def test_tiny_repetition_penalty_cannot_break_the_sampler() -> None:
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5]])
    row = SampleRow(0, SamplingParams(temperature=0.5, repetition_penalty=1e-45, seed=1), make_generator(1),
                    [0, 1], 1)
    for _ in range(5):  # both overflow to +inf: exactly they are candidates
        assert Sampler().sample(logits, [row])[0].token in (0, 1)


def test_huge_repetition_penalty_keeps_a_masked_rows_seen_tokens_candidates() -> None:
    # A grammar allows only tokens 1 and 2 (the rest -inf), both seen and negative: times 1e38 they
    # overflowed to -inf and the request failed with "no finite logits" (a fuzzed server case).
    inf = float("inf")
    logits = torch.tensor([[-inf, -2.0, -1.0, -inf], [-inf, -2.0, -1.0, -inf]])
    rows = [SampleRow(0, SamplingParams(temperature=0.0, repetition_penalty=1.17e38), None, [1, 2], 1),
            SampleRow(1, SamplingParams(temperature=0.7, repetition_penalty=3e38, seed=2), make_generator(2),
                      [1, 2], 1)]
    out = apply_penalties(logits.clone(), rows)
    assert torch.isfinite(out[:, 1:3]).all() and torch.isneginf(out[:, [0, 3]]).all()
    sampled = Sampler().sample(logits, rows)
    assert sampled[0].token in (1, 2) and sampled[1].token in (1, 2)


def test_validation_names_the_field() -> None:
    cases = [({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": -1.0}, "repetition_penalty"),
             ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": float("nan")},
                                                                "frequency_penalty"),
             ({"logit_bias": {-1: 1.0}}, "logit_bias"), ({"logit_bias": {"x": 1.0}}, "logit_bias"),
             ({"logit_bias": {True: 1.0}}, "logit_bias"), ({"logit_bias": {3: 100.5}}, "logit_bias"),
             ({"logit_bias": {3: float("inf")}}, "logit_bias"), ({"logit_bias": [3]}, "logit_bias")]
    for kwargs, field in cases:
        with pytest.raises(ValueError, match=f"^{field}"):
            SamplingParams(**kwargs)
    p = SamplingParams(logit_bias={"12": 1, 4: -100})  # decimal strings (OpenAI's keys) become ints
    assert p.logit_bias == {12: 1.0, 4: -100.0} and hash(p) == hash(SamplingParams(logit_bias={12: 1.0}))


# ---------------------------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_hf_checkpoint(tmp_path_factory.mktemp("pen"), "llama", seed=3)
    return folder, load_hf_reference(folder), LLM(str(folder), block_size=4, num_kv_blocks=256)


def test_repetition_penalty_greedy_equals_transformers_generate(tiny) -> None:
    folder, ref, llm = tiny
    prompts = [[5, 6, 7, 5, 6], [9, 9, 9, 9, 9, 9, 9, 10], [40, 41]]
    ref.generation_config.eos_token_id = None  # as ignore_eos
    for penalty in (1.5, 0.7):
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                    repetition_penalty=penalty))
        for prompt, out in zip(prompts, outs):
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                repetition_penalty=penalty, pad_token_id=0)[0, len(prompt):].tolist()
            assert out.outputs[0].token_ids == want, penalty
    plain = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert plain[0].outputs[0].token_ids != outs[0].outputs[0].token_ids  # the penalty did change the argmax


def test_presence_frequency_greedy_equals_a_recompute_loop(tiny) -> None:
    folder, ref, llm = tiny
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=1.2, frequency_penalty=0.9,
                       repetition_penalty=1.1, logit_bias={17: 1.5})
    prompt = [4, 5, 6, 4, 5]
    seq = list(prompt)
    for _ in range(10):
        row = reference(hf_logits(ref, seq)[-1], p, seq, len(prompt))
        seq.append(int(row.argmax()))
    assert llm.generate([prompt], p)[0].outputs[0].token_ids == seq[len(prompt):]


def test_logit_bias_forces_and_bans_tokens(tiny) -> None:
    folder, ref, llm = tiny
    prompt = [8, 9, 10]
    forced = llm.generate([prompt], SamplingParams(temperature=1.0, seed=0, max_tokens=6, ignore_eos=True,
                                                   logit_bias={33: 100}, logprobs=0))[0].outputs[0]
    assert forced.token_ids == [33] * 6
    raw = torch.log_softmax(hf_logits(ref, prompt)[-1], -1)[33]
    assert forced.logprobs[0][33].logprob == pytest.approx(float(raw), abs=1e-3)  # the model's, unbiased
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    banned = set(greedy.token_ids)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                logit_bias=dict.fromkeys(banned, -100)))[0].outputs[0]
    assert not banned & set(out.token_ids)


def test_n_forks_keep_their_own_histories(tiny) -> None:
    folder, ref, llm = tiny
    p = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True, frequency_penalty=2.0,
                       presence_penalty=2.0)
    outs = llm.generate([[3, 4, 5]], p)[0].outputs
    assert len(outs) == 3 and all(len(o.token_ids) == 8 for o in outs)
    assert llm.generate([[3, 4, 5]], p)[0].outputs == outs  # seeded: reproducible


def test_logit_bias_outside_the_vocabulary_is_refused(tiny) -> None:
    folder, ref, llm = tiny
    with pytest.raises(RequestRejectedError, match="logit_bias") as info:
        llm.generate([[1, 2]], SamplingParams(logit_bias={256: 1.0}))
    assert info.value.param == "logit_bias"
    assert not llm.engine.has_unfinished_requests()


# ------------------------------------------------------------------------------------ generation_config
def write_generation_config(folder: Path, **values) -> Path:
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2,
                                                               "do_sample": True, **values}))
    return folder


def test_generation_config_defaults_in_llm(tmp_path: Path) -> None:
    folder = make_hf_checkpoint(tmp_path, "llama", seed=3)
    write_generation_config(folder, temperature=0.0, top_k=5, top_p=0.9, repetition_penalty=1.3,
                            max_new_tokens=7, min_p=None)
    llm = LLM(str(folder), block_size=4, num_kv_blocks=64)
    want = SamplingParams(temperature=0.0, top_k=5, top_p=0.9, repetition_penalty=1.3, max_tokens=7)
    assert llm.get_default_sampling_params() == want
    assert llm.generate([[5, 6, 7]])[0].outputs[0].token_ids == llm.generate([[5, 6, 7]], want)[0].outputs[0].token_ids

    (tmp_path / "other").mkdir()
    other = write_generation_config(tmp_path / "other", min_p=0.2, top_p=0)  # top_p 0 is invalid: dropped
    for setting, expected in (("vllm", SamplingParams()), (str(other), SamplingParams(min_p=0.2))):
        llm = LLM(str(folder), block_size=4, num_kv_blocks=64, generation_config=setting)
        assert llm.get_default_sampling_params() == expected
    with pytest.raises(ValueError, match="generation_config"):
        LLM(str(folder), block_size=4, num_kv_blocks=64, generation_config=str(tmp_path / "nowhere"))


def test_request_fields_override_the_defaults() -> None:
    defaults = {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.2, "max_tokens": 50}
    c = CompletionRequest.model_validate({"prompt": "x", "temperature": 0, "presence_penalty": 0.5,
                                          "logit_bias": {"7": -100}}).to_sampling_params(defaults)
    assert (c.temperature, c.top_p, c.repetition_penalty, c.max_tokens) == (0.0, 0.9, 1.2, 50)
    assert (c.presence_penalty, c.frequency_penalty, c.logit_bias) == (0.5, 0.0, {7: -100.0})
    c = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 3, "repetition_penalty": 1.0,
                                          "top_p": None}).to_sampling_params(defaults)
    assert (c.max_tokens, c.repetition_penalty, c.top_p) == (3, 1.0, 0.9)  # null is "left out"
    assert CompletionRequest.model_validate({"prompt": "x"}).to_sampling_params().max_tokens == 16
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert ChatCompletionRequest.model_validate(chat).to_sampling_params(defaults).max_tokens == 50
    assert ChatCompletionRequest.model_validate(chat).to_sampling_params().max_tokens is None
    assert ChatCompletionRequest.model_validate({**chat, "max_completion_tokens": 4}).to_sampling_params(
        defaults).max_tokens == 4


# ---------------------------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny-pen"))
    write_generation_config(folder, temperature=0.0, max_new_tokens=5, repetition_penalty=1.3)
    engine = tiny_engine(folder, block_size=16, num_kv_blocks=128, max_model_len=256, seed=0)
    with ServerThread(engine, served_model_names=["tiny"]) as s:
        yield s


def test_huge_repetition_penalty_with_a_regex_is_served(tmp_path: Path) -> None:
    # The fuzzed body that failed CI with a 500: an empty prompt, a regex, repetition_penalty 1.17e38.
    # (Not the module's server: its generation config makes "!" the EOS, which would end the text.)
    engine = tiny_engine(write_tiny_model(tmp_path), block_size=8, num_kv_blocks=64, seed=0)
    body = {"model": "tiny", "prompt": "", "repetition_penalty": 1.1673975398007479e+38,
            "guided_regex": "1\\u00cc1", "max_tokens": 8}
    with ServerThread(engine, served_model_names=["tiny"]) as server:
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("1\u00cc1", "stop")


def test_server_accepts_the_fields_and_applies_the_defaults(server: ServerThread) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    tok = server.engine.tokenizer
    token = tok.encode("quick", add_special_tokens=False)[0]
    r = client.completions.create(model="tiny", prompt="the lazy", max_tokens=4, temperature=0,
                                  logit_bias={str(token): 100}, presence_penalty=0.5, frequency_penalty=-0.5,
                                  extra_body={"repetition_penalty": 1.2, "ignore_eos": True})
    assert r.choices[0].text == tok.decode([token] * 4)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          logit_bias={str(token): 100}, max_completion_tokens=3,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == tok.decode([token] * 3)

    # generation_config.json: greedy, repetition_penalty 1.3, 5 tokens, unless the request says otherwise
    body = {"model": "tiny", "prompt": "a block table", "ignore_eos": True}
    default = httpx.post(f"{server.base_url}/completions", json=body).json()
    assert default["usage"]["completion_tokens"] == 5
    explicit = httpx.post(f"{server.base_url}/completions",
                          json={**body, "temperature": 0, "repetition_penalty": 1.3, "max_tokens": 5}).json()
    assert default["choices"][0]["text"] == explicit["choices"][0]["text"]
    assert httpx.post(f"{server.base_url}/completions", json={**body, "max_tokens": 2}).json()[
        "usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("extra,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": "high"}, "repetition_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "up"}}, "logit_bias"), ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias")])
def test_server_rejects_bad_values_naming_the_field(server: ServerThread, extra: dict, param: str) -> None:
    for path, body in (("completions", {"prompt": "hi", "max_tokens": 2}),
                       ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})):
        r = httpx.post(f"{server.base_url}/{path}", json={**body, **extra})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"].split(".")[0] == param, r.text  # "logit_bias.5": pydantic's path


@pytest.mark.parametrize("rep", [5e-324, 1e-300, 1e300])
def test_a_repetition_penalty_beyond_float32_keeps_masked_tokens_masked(rep: float) -> None:
    # Found by tests/server/test_server_fuzz.py: repetition_penalty=5e-324 rounds to 0 in float32,
    # and -inf * 0 (a token a grammar masked) was NaN, so the request failed with "no finite
    # logits"; 1e300 rounds to inf, and 0 * inf is NaN too.
    logits = torch.tensor([[2.0, -1.0, 0.0, float("-inf")]])
    row = SampleRow(0, SamplingParams(repetition_penalty=rep), None, token_ids=[0, 1, 2, 3], prompt_len=4)
    out = apply_penalties(logits.clone(), [row])
    assert not bool(out.isnan().any())
    assert out[0, 3] == float("-inf")  # still masked
    assert bool(torch.isfinite(out[0, 1:3]).all())  # the seen negative and zero logits stay finite
    assert out[0, 0] > 2.0 if rep < 1 else out[0, 0] < 2.0  # a positive logit moves the penalty's way
