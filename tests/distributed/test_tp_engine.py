"""The tensor-parallel engine end to end: ``tensor_parallel_size`` 2 gives what 1 gives (greedy
tokens equal, logprobs within 1e-4) over a fixed set of prompts with prefix hits, ``n > 1``, beam
search, swap and recompute preemption and evictions (fault injection), LoRA adapters, 8-bit KV
blocks and a disk-tier restart; a rank allocates what ``pagedkv size --tp`` says it holds; and failure
is loud (``test_tp_failure.py``: killed ranks).

One TP=1 and one TP=2 engine per configuration, each running the whole workload once. The
workers are spawned interpreters, so nothing here times work: these run in the parallel phase.
``PAGEDKV_FULL_MATRIX=1`` adds TP=3 (a model whose one KV head is replicated on every rank).
``PAGEDKV_TEST_DEVICE=cuda`` (``scripts/gpu_check.sh``'s TP stage, two GPUs or more) runs the same
on GPUs, the ranks joined by NCCL.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from pagedkv.engine import LLMEngine
from pagedkv.lora.request import LoRARequest
from pagedkv.memory.tiers.disk_files import read_fingerprint
from pagedkv.model_shape import kv_bytes_per_block
from pagedkv.sampling_params import SamplingParams
from pagedkv_testing.hf_checkpoints import make_hf_checkpoint

FULL = os.environ.get("PAGEDKV_FULL_MATRIX") == "1"  # docs/environment.md
DEVICE = os.environ.get("PAGEDKV_TEST_DEVICE", "cpu")  # scripts/gpu_check.sh: cuda, NCCL between the ranks' GPUs
PREFIX = [(5 * i + 7) % 200 + 3 for i in range(24)]  # shared by half the prompts: prefix hits
PROMPTS = [PREFIX + [(11 * i + j) % 240 + 3 for j in range(3 + i % 5)] if i % 2 else
           [(13 * i + 3 * j) % 240 + 3 for j in range(5 + 2 * i)] for i in range(16)]
BASE = {"block_size": 4, "threads": 1, "kv_offloading_size": 0.004, "debug_integrity": True, "device": DEVICE}


@pytest.fixture(autouse=True)
def _patient_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_TP_TIMEOUT_S", "120")  # a loaded CI box must never look like a hung rank


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("tp"), "llama", seed=3)  # 4 heads, 2 KV heads


def _workload(engine: LLMEngine, lora: LoRARequest | None = None) -> dict[str, Any]:
    """Every prompt greedy with logprobs; every third also n=3 seeded sampling; one beam search;
    with ``lora`` half the greedy ones through the adapter. Finished outputs by request id."""
    for i, prompt in enumerate(PROMPTS):
        greedy = SamplingParams(temperature=0, max_tokens=8 + i % 4, ignore_eos=True, logprobs=2)
        engine.add_request(f"g{i}", prompt, greedy, lora_request=lora if lora is not None and i % 2 else None)
        if i % 3 == 0:
            engine.add_request(f"n{i}", prompt, SamplingParams(temperature=0.8, n=3, seed=i, max_tokens=6,
                                                               ignore_eos=True))
    engine.add_request("beam", PROMPTS[1], SamplingParams(max_tokens=5, ignore_eos=True), beam_width=3)
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, "a request finished twice"
                done[out.request_id] = out
    assert engine.stats().kv.used_blocks == 0
    return done


def _assert_same(got: dict[str, Any], want: dict[str, Any], *, logprobs: bool = True) -> None:
    assert got.keys() == want.keys()
    for rid, out in want.items():
        assert [c.token_ids for c in got[rid].outputs] == [c.token_ids for c in out.outputs], rid
        if logprobs and rid.startswith("g"):
            for a, b in zip(got[rid].outputs[0].logprobs, out.outputs[0].logprobs):
                assert a.keys() == b.keys()
                assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a), rid


def _run(model: Path, tp: int, **options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(outputs, facts) of one engine's workload."""
    lora = options.pop("lora", None)
    engine = LLMEngine.from_options(str(model), tensor_parallel_size=tp, **{**BASE, **options})
    try:
        done = _workload(engine, lora)
        stats = engine.stats()
        facts = {"prefix_hits": stats.kv.prefix_hit_tokens,
                 "num_blocks": engine.runner.num_blocks, "bytes_per_block": engine.runner.bytes_per_block,
                 "payload_bytes": engine.runner.payload_bytes, "vocab": engine.runner.config.vocab_size,
                 "kv_heads": engine.runner.config.num_key_value_heads, "config": engine.runner.config,
                 "faults": dict(engine.faults.fired) if engine.faults is not None else {}}
    finally:
        engine.close()
    return done, facts


FAULTS = "seed=5,rate=0.3,kinds=recompute+swap+evict+alloc"


def test_tp2_equals_tp1_with_prefix_hits_forks_beams_preemption_and_lora(model: Path, tmp_path: Path) -> None:
    from pagedkv_testing.lora_adapters import make_adapter

    make_adapter(model, tmp_path / "ad", seed=1, r=4, lora_alpha=8,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    lora = LoRARequest("ad", 1, str(tmp_path / "ad"))  # half the greedy requests run through it
    options = {"num_kv_blocks": 48, "fault_injection": FAULTS, "enable_lora": True, "max_lora_rank": 8, "lora": lora}
    want, one = _run(model, 1, **options)
    got, two = _run(model, 2, **options)
    _assert_same(got, want)
    assert two["faults"].get("swap") and two["faults"].get("recompute")  # both preemptions happened
    assert two["prefix_hits"] > 0
    assert two["vocab"] == one["vocab"] and two["kv_heads"] == one["kv_heads"]  # the engine sees the whole model
    assert two["num_blocks"] == one["num_blocks"]
    assert two["bytes_per_block"] * 2 == one["bytes_per_block"]  # a rank holds half the KV heads
    assert two["payload_bytes"] == one["payload_bytes"]  # a block's payload: both shards
    # what `pagedkv size --tp 2` says a rank holds is what a rank allocates
    assert two["bytes_per_block"] == kv_bytes_per_block(two["config"], BASE["block_size"], "float32", tp=2)


def test_tp2_int8_blocks_and_a_disk_tier_restart(model: Path, tmp_path: Path) -> None:
    options = {"num_kv_blocks": 32, "kv_cache_dtype": "int8", "kv_offload_dir": str(tmp_path / "kv")}
    want, _ = _run(model, 1, **{**options, "kv_offload_dir": None})
    first, _ = _run(model, 2, **options)
    _assert_same(first, want, logprobs=False)  # (8-bit blocks: each rank's heads quantized as TP=1's)
    engine = LLMEngine.from_options(str(model), tensor_parallel_size=2, **{**BASE, **options})
    try:
        again = _workload(engine, None)
        hits = engine.stats().kv.disk_hit_tokens
    finally:
        engine.close()
    _assert_same(again, want, logprobs=False)
    assert hits > 0  # the restart read TP=2 blocks back from disk
    fingerprint = read_fingerprint(tmp_path / "kv")  # (a TP=1 engine's has no such key: it reads none of these)
    assert isinstance(fingerprint, dict) and fingerprint["fingerprint"]["tensor_parallel_size"] == "2"


@pytest.mark.skipif(not FULL, reason="PAGEDKV_FULL_MATRIX=1: TP=3")
def test_tp3_equals_tp1_with_a_replicated_kv_head(tmp_path: Path) -> None:
    folder = make_hf_checkpoint(tmp_path, "llama", seed=4, num_attention_heads=6, num_key_value_heads=1,
                                hidden_size=96, intermediate_size=96)
    options = {"num_kv_blocks": 48, "fault_injection": FAULTS}
    want, _ = _run(folder, 1, **options)
    got, facts = _run(folder, 3, **options)
    _assert_same(got, want)
    assert facts["kv_heads"] == 1
