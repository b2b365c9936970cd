"""The native decoder layer (``models/native_layer.py``, ``ops/csrc/decoder_layer.cpp``) against the
module path it replaces: the same runner script (a fresh prefill, extends over a shared cached
prefix, batched decodes with shared blocks, a step that mixes a fresh prefill with decodes) on two
runners of the same weights, native layers on and off; every step's logits must be equal bit for
bit (the op calls the modules' own kernels in their order), and the native layer must have run.
Against transformers, the model tests (``test_models_llama.py`` and the others) run with native
layers on, the runner's default."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from pagedkv.models.loader import load_model
from pagedkv.models.native_layer import NativeLayer, op_available
from pagedkv.ops import cascade
from pagedkv.runner import ModelRunner, SeqChunk
from pagedkv_testing.hf_checkpoints import TinyAllocator, make_hf_checkpoint
from pagedkv_testing.quantized_gguf import write_gguf

pytestmark = pytest.mark.skipif(not op_available(), reason="native kernels unavailable")

Q = gguf.GGMLQuantizationType


def _script(runner: ModelRunner, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    """Every step's logits over a fixed script (greedy tokens of this runner's own logits)."""
    bs = runner.block_size
    gen = torch.Generator().manual_seed(seed)
    alloc = TinyAllocator(runner.num_blocks, seed)
    shared = 3 * bs  # A's first three blocks, full: the prefix B and C hold too
    prompt_a = torch.randint(3, vocab, (shared + 2,), generator=gen).tolist()
    groups = len(runner.cache.groups)  # a hybrid model's other KV groups: a table each, shared alike
    tables = {"a": [alloc.take(-(-(shared + 40) // bs)) for _ in range(groups)]}
    tables["b"] = [t[:3] + alloc.take(-(-40 // bs)) for t in tables["a"]]
    tables["c"] = [t[:3] + alloc.take(-(-40 // bs)) for t in tables["a"]]
    tables["d"] = [alloc.take(-(-60 // bs)) for _ in range(groups)]
    pos = {"a": len(prompt_a)}
    outs: list[torch.Tensor] = []

    def step(chunks: list[tuple[str, list[int]]]) -> None:
        logits = runner.execute([SeqChunk(ids, pos[name] - len(ids), tables[name][0],
                                          group_tables=tuple(tables[name][1:])) for name, ids in chunks])
        outs.append(logits)
        for (name, _), row in zip(chunks, logits):
            last[name] = int(row.argmax())

    last: dict[str, int] = {}
    pos["a"] = len(prompt_a)
    step([("a", prompt_a)])  # a fresh prefill: module path
    own = {n: torch.randint(3, vocab, (5,), generator=gen).tolist() for n in "bc"}
    for n in "bc":
        pos[n] = shared + 5
    step([("b", own["b"]), ("c", own["c"])])  # extends over the cached shared prefix
    for _ in range(6):  # decodes: a, b, c share A's first blocks
        for n in "abc":
            pos[n] += 1
        step([(n, [last[n]]) for n in "abc"])
    prompt_d = torch.randint(3, vocab, (7,), generator=gen).tolist()
    pos["d"] = len(prompt_d)
    for n in "ab":
        pos[n] += 1
    step([("a", [last["a"]]), ("b", [last["b"]]), ("d", prompt_d)])  # a fresh prefill among decodes
    for _ in range(3):
        for n in "abcd":
            pos[n] += 1
        step([(n, [last[n]]) for n in "abcd"])
    return outs


def _compare(load: Callable[[], Any], monkeypatch: pytest.MonkeyPatch, expect_native: bool = True,
             **runner: Any) -> None:
    calls: list[bool] = []  # per native layer call: whether the step had shared runs (a cascade plan)
    call = NativeLayer.__call__

    def counted(self: NativeLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, args: tuple
                ) -> torch.Tensor:
        calls.append(bool(args[12]))
        return call(self, x, cos, sin, args)

    monkeypatch.setattr(NativeLayer, "__call__", counted)
    monkeypatch.setattr(cascade, "MIN_SAVED_TOKENS", 1)  # this script's small shared prefix attended once too
    results = {}
    for on in (False, True):
        loaded = load()
        calls.clear()
        r = ModelRunner(loaded, num_blocks=600 // runner["block_size"] + 32, native_layers=on, **runner)
        results[on] = _script(r, loaded.config.vocab_size)
        used = len(calls)
        if not on:
            assert used == 0
    assert (used > 0) == expect_native, f"native layer calls: {used}"
    assert any(calls) == expect_native  # the shared prefix's blocks attended once for b and c (and a)
    assert len(results[True]) == len(results[False])
    for i, (a, b) in enumerate(zip(results[False], results[True])):
        assert torch.equal(a, b), f"step {i}: max diff {float((a - b).abs().max())}"


@pytest.mark.parametrize("case", ["llama-bs16", "llama-no-head-pack-bs1", "qwen2-bias-bs4", "qwen3-qk-norm-bs4",
                                  "mistral-window-bs2", "llama-q8_0-bs4", "llama-int8-kv-bs4", "llama-d24-fp8-kv-bs3",
                                  "gemma3-bs4", "gemma2-softcap-bs2"])
def test_native_layers_equal_the_modules_on_hf_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           case: str) -> None:
    model_type = case.split("-")[0]
    bs = int(case.rsplit("bs", 1)[1])
    overrides: dict[str, Any] = {}
    runner: dict[str, Any] = {"block_size": bs}
    quantization = "auto"
    if model_type == "qwen2":
        overrides["attention_bias"] = True
    if model_type == "mistral":
        overrides["sliding_window"] = 6
    if "d24" in case:  # head_dim 24: no Hadamard basis, so the 8-bit blocks are stored unrotated
        overrides |= {"hidden_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2}
    if "q8_0" in case:
        quantization = "q8_0"
    if "int8-kv" in case:
        runner["kv_cache_dtype"] = "int8"
    if "fp8-kv" in case:
        runner["kv_cache_dtype"] = "fp8_e4m3"
    if "no-head-pack" in case:
        runner["pack_lm_head"] = False
    folder = make_hf_checkpoint(tmp_path, model_type, seed=3, **overrides)
    _compare(lambda: load_model(str(folder), quantization=quantization), monkeypatch, **runner)


@pytest.mark.parametrize("types", ["Q4_1", "Q4_0", "Q5_1", "Q4_K+Q6_K"])
def test_native_layers_equal_the_modules_on_packed_gguf_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                types: str) -> None:
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    k_quant = "_K" in types
    mapping = ({"attn_q.weight": Q.Q4_K, "attn_k.weight": Q.Q4_K, "attn_v.weight": Q.Q6_K,
                "attn_output.weight": Q.Q4_K, "ffn_gate.weight": Q.Q4_K, "ffn_up.weight": Q.Q4_K,
                "ffn_down.weight": Q.Q6_K} if k_quant else {"weight": Q[types]})
    path = tmp_path / f"{types}.gguf"
    hidden, ffn = (256, 256) if k_quant else (64, 96)
    write_gguf(path, mapping, tied=False, hidden=hidden, ffn=ffn)
    _compare(lambda: load_model(str(path)), monkeypatch, block_size=4)


def test_layers_the_op_does_not_cover_run_as_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixture-of-experts layers are not packed; a float16 KV pool under float32 weights is not a
    step the op takes: both run as modules, with the same results as with native layers off."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    moe = tmp_path / "mixtral.gguf"
    write_gguf(moe, {}, experts=4)  # Mixtral's layout: a router and four experts a layer
    assert ModelRunner(load_model(str(moe)), num_blocks=8).model.native_layers == [None, None]
    _compare(lambda: load_model(str(moe)), monkeypatch, expect_native=False, block_size=4)
    llama = make_hf_checkpoint(tmp_path / "llama", "llama", seed=2)
    _compare(lambda: load_model(str(llama)), monkeypatch, expect_native=False, block_size=4,
             kv_cache_dtype="float16")


def test_a_runner_switched_off_stays_off_beside_another_on_the_same_model(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The packs live on the model; each runner's own switch decides whether its steps use them."""
    calls: list[int] = []
    call = NativeLayer.__call__
    monkeypatch.setattr(NativeLayer, "__call__", lambda self, *a: calls.append(1) or call(self, *a))
    loaded = load_model(str(make_hf_checkpoint(tmp_path, "llama", seed=5)))
    off = ModelRunner(loaded, num_blocks=8, native_layers=False)
    on = ModelRunner(loaded, num_blocks=8)  # packs the shared model's layers
    assert all(p is not None for p in loaded.model.native_layers)
    step = [SeqChunk([5, 6, 7], 0, [0, 1])]
    off.execute(step)
    off.execute([SeqChunk([8], 3, [0, 1])])
    assert calls == []
    on.execute(step)
    on.execute([SeqChunk([8], 3, [0, 1])])
    assert calls  # the decode step's layers


def test_the_runner_switch_and_lora_leave_the_modules(tmp_path: Path) -> None:
    folder = make_hf_checkpoint(tmp_path, "llama", seed=4)
    on = ModelRunner(load_model(str(folder)), num_blocks=8)
    assert all(p is not None for p in on.model.native_layers)
    off = ModelRunner(load_model(str(folder)), num_blocks=8, native_layers=False)
    assert off.model.native_layers == [None, None]
    plain = ModelRunner(load_model(str(folder)), num_blocks=8, attention_backend="plain")
    assert plain.model.native_layers == [None, None]
    lora = ModelRunner(load_model(str(folder)), num_blocks=8, max_loras=1)  # LoRA wrappers: not a known linear
    assert lora.model.native_layers == [None, None]
