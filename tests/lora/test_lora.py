"""LoRA adapters (pagedkv/lora): outputs against PEFT + transformers with the adapter merged, many
adapters and base-model rows in one batch, the prefix cache keyed by adapter, refusals at load,
max_loras per step without starvation, faults and preemption.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedkv import LLM, LoRARequest, SamplingParams
from pagedkv.engine import LLMEngine
from pagedkv.lora import LoRAError
from pagedkv.lora.adapter import load_adapter
from pagedkv.models import load_model
from pagedkv.runner import ModelRunner, SeqChunk
from pagedkv_testing.hf_checkpoints import hf_greedy, hf_logits, load_hf_reference, make_hf_checkpoint
from pagedkv_testing.lora_adapters import make_adapter

pytest.importorskip("peft")

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2, 9, 100, 45, 7, 81, 12, 66, 3, 140, 29, 8, 77, 91, 4, 55],
           [9, 8, 7, 6, 5, 4, 3],
           [200, 150, 100, 50, 25, 12, 6, 3, 1, 99, 98, 97],
           [11, 22, 33, 44, 55, 66, 77, 88, 99, 110, 121]]
# three adapters of different ranks and targets (PEFT's names)
ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all": dict(r=8, lora_alpha=16, use_rslora=True,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp": dict(r=2, lora_alpha=4, target_modules=["o_proj", "gate_proj", "down_proj"],
                rank_pattern={"down_proj": 6}, alpha_pattern={"down_proj": 3}),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny llama checkpoint, three adapters saved by PEFT, and their merged references."""
    tmp = tmp_path_factory.mktemp("lora")
    base = make_hf_checkpoint(tmp, "llama", seed=0)
    refs = {name: make_adapter(base, tmp / name, seed=i + 1, **cfg) for i, (name, cfg) in enumerate(ADAPTERS.items())}
    refs[None] = load_hf_reference(base)
    reqs = {name: LoRARequest(name, i + 1, str(tmp / name)) for i, name in enumerate(ADAPTERS)}
    return {"base": base, "tmp": tmp, "refs": refs, "reqs": reqs}


def _llm(tiny: dict, **options) -> LLM:
    options = {"enable_lora": True, "max_loras": 3, "max_lora_rank": 8, "num_kv_blocks": 128, "block_size": 4,
               **options}
    return LLM(str(tiny["base"]), **options)


def test_three_adapters_and_base_in_one_batch_match_peft(tiny: dict) -> None:
    """Greedy 32 tokens of rows under three adapters and the base model, batched, equal PEFT's
    merged models; the logits of every position within 1e-4."""
    names = ["qv", "all", "mlp", None]
    want = [hf_greedy(tiny["refs"][n], p, 32) for n, p in zip(names, PROMPTS)]
    llm = _llm(tiny)
    outs = llm.generate(PROMPTS, GREEDY, lora_request=[tiny["reqs"][n] if n else None for n in names])
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    # logits: one forward pass mixing the four (prefill rows), against each reference
    runner = llm.engine.runner
    slots = llm.engine.lora.assign_slots(llm.engine.lora.resolve(tiny["reqs"][n]) for n in names[:3])
    chunks = [SeqChunk(p, 0, list(range(i * 8, i * 8 + 8)), all_logits=True,
                       lora_slot=slots[llm.engine.lora.resolve(tiny["reqs"][n]).key] if n else -1)
              for i, (n, p) in enumerate(zip(names[::-1], PROMPTS))]  # base rows first: the runner reorders
    logits = runner.execute(chunks)
    row = 0
    for n, p in zip(names[::-1], PROMPTS):
        ref = hf_logits(tiny["refs"][n], p)
        assert (logits[row:row + len(p)] - ref).abs().max() < 1e-4, n
        row += len(p)


def test_phi3_fused_qkv_and_gate_up_adapters(tmp_path: Path) -> None:
    """Phi-3's checkpoint names fuse q/k/v and gate/up: an adapter on them covers all their rows."""
    base = make_hf_checkpoint(tmp_path, "phi3", seed=3)
    ref = make_adapter(base, tmp_path / "ad", seed=4, r=4, lora_alpha=4,
                       target_modules=["qkv_proj", "gate_up_proj", "down_proj"])
    loaded = load_model(str(base))
    runner = ModelRunner(loaded, block_size=4, num_blocks=16, max_loras=1, max_lora_rank=4)
    weights = load_adapter("ad", 1, str(tmp_path / "ad"), runner.config, max_rank=4)
    assert weights.targets == ["down_proj", "gate_up_proj", "qkv_proj"]
    runner.set_lora_slot(0, weights)
    ids = PROMPTS[0]
    logits = runner.execute([SeqChunk(ids, 0, list(range(8)), all_logits=True, lora_slot=0)])
    assert (logits - hf_logits(ref, ids)).abs().max() < 1e-4


def test_quantized_gguf_base_keeps_its_weights_and_matches_dequantized(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """An adapter beside a Q8_0 base (weights stay int8) gives the logits of the same adapter on
    the dequantized float weights."""
    from pagedkv.lora.layers import LoRALinear
    from pagedkv.models.quant_linear import QuantLinear
    from pagedkv_testing.quantized_gguf import EXACT, write_gguf

    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_gguf(path, EXACT, tied=True)
    # an adapter for those shapes (hidden 64, 4 heads, 2 KV heads, FFN 96, 2 layers)
    hf = make_hf_checkpoint(tmp_path, "llama", seed=5, vocab_size=128)
    make_adapter(hf, tmp_path / "ad", seed=6, r=8, lora_alpha=16,
                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    ids = [5, 40, 77, 120, 9, 100, 33, 64, 3]
    out = {}
    for quant in ("none", "q8_0"):
        runner = ModelRunner(load_model(str(path), quantization=quant), block_size=4, num_blocks=16, max_loras=1,
                             max_lora_rank=8)
        runner.set_lora_slot(0, load_adapter("ad", 1, str(tmp_path / "ad"), runner.config, max_rank=8))
        qkv = runner.model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, LoRALinear) and isinstance(qkv.base, QuantLinear) == (quant == "q8_0")
        out[quant] = runner.execute([SeqChunk(ids, 0, list(range(4)), all_logits=True, lora_slot=0)])
        plain = runner.execute([SeqChunk(ids, 0, list(range(4, 8)), all_logits=True)])
        assert (out[quant] - plain).abs().max() > 1e-2  # the adapter changes the outputs
    assert (out["q8_0"] - out["none"]).abs().max() < 1e-4


def test_prefix_cache_never_mixes_adapters(tiny: dict) -> None:
    """The same prompt under A, B and the base: three outputs, each its reference's, no hit across
    adapters (miss reason different_adapter); a second request under A hits A's blocks."""
    llm = _llm(tiny)
    prompt = PROMPTS[0] * 2  # 38 tokens: 9 full blocks of 4
    order = ["qv", "all", None, "qv"]
    outs = [llm.generate([prompt], GREEDY, lora_request=tiny["reqs"][n] if n else None)[0] for n in order]
    for n, o in zip(order, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(tiny["refs"][n], prompt, 32), n
    assert len({tuple(o.outputs[0].token_ids) for o in outs[:3]}) == 3
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 36]
    assert outs[1].cache_details.reason == "different_adapter"
    assert outs[1].cache_details.caller_reason == "different_adapter"
    assert outs[2].cache_details.reason == "different_adapter"


def test_reloaded_adapter_with_new_weights_never_hits_old_blocks(tiny: dict, tmp_path: Path) -> None:
    """Unload, change the weights in the folder, load under the same name: no hit on the old
    version's blocks, and the outputs are the new weights'."""
    folder = tmp_path / "swap"
    shutil.copytree(tiny["tmp"] / "qv", folder)
    engine: LLMEngine = _llm(tiny).engine
    engine.lora.add(LoRARequest("swap", 9, str(folder)))
    prompt = PROMPTS[2] * 3

    def run(rid: str):
        engine.add_request(rid, prompt, GREEDY, lora_request="swap")
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    return out

    first = run("a")
    again = run("b")
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    engine.lora.remove("swap")
    with pytest.raises(LoRAError) as err:
        engine.add_request("c", prompt, GREEDY, lora_request="swap")
    assert err.value.status == 404 and "swap" in str(err.value)
    ref = make_adapter(tiny["base"], folder, seed=42, **ADAPTERS["qv"])  # new weights, same folder
    engine.lora.add(LoRARequest("swap", 9, str(folder)))
    third = run("d")
    assert third.num_cached_tokens == 0
    assert list(third.outputs[0].token_ids) == hf_greedy(ref, prompt, 32)


def _write_config(folder: Path, **edits) -> None:
    path = folder / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(edits)
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize("edit, field", [({"use_dora": True}, "use_dora"),
                                         ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
                                         ({"target_modules": ["embed_tokens", "q_proj"]}, "embed_tokens"),
                                         ({"bias": "all"}, "bias"),
                                         ({"peft_type": "IA3"}, "peft_type")])
def test_unsupported_adapters_are_refused_naming_the_field(tiny: dict, tmp_path: Path, edit: dict,
                                                           field: str) -> None:
    folder = tmp_path / "bad"
    shutil.copytree(tiny["tmp"] / "qv", folder)
    _write_config(folder, **edit)
    engine = _llm(tiny).engine
    with pytest.raises(LoRAError, match=field):
        engine.lora.add(LoRARequest("bad", 5, str(folder)))


def test_rank_above_limit_and_foreign_shapes_are_refused(tiny: dict, tmp_path: Path) -> None:
    engine = _llm(tiny, max_lora_rank=4).engine
    with pytest.raises(LoRAError, match="max_lora_rank 4") as err:
        engine.add_request("r", [1, 2, 3], GREEDY, lora_request=tiny["reqs"]["all"])  # rank 8
    assert err.value.status == 400
    other = make_hf_checkpoint(tmp_path, "llama", seed=1, hidden_size=32, intermediate_size=48)
    make_adapter(other, tmp_path / "other", seed=1, r=2, target_modules=["q_proj"])
    with pytest.raises(LoRAError, match="trained for another model"):
        engine.lora.add(LoRARequest("other", 7, str(tmp_path / "other")))
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        engine.lora.add(LoRARequest("nothing", 8, str(tmp_path)))
    plain = LLM(str(tiny["base"]), num_kv_blocks=32)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate([[1, 2, 3]], GREEDY, lora_request=tiny["reqs"]["qv"])


def test_max_loras_per_step_and_no_starvation(tiny: dict) -> None:
    """max_loras=1: a step never runs two adapters; a request of another adapter waiting behind a
    stream of new requests of the running one is still served (they queue behind it)."""
    engine = _llm(tiny, max_loras=1).engine
    reqs = tiny["reqs"]
    short = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("a0", PROMPTS[1], short, lora_request=reqs["qv"])
    engine.add_request("b", PROMPTS[1], short, lora_request=reqs["all"])
    finished: list[str] = []
    for step in range(200):
        if step < 40:
            engine.add_request(f"a{step + 1}", PROMPTS[1], short, lora_request=reqs["qv"])
        out = engine.scheduler.schedule.__self__  # the scheduler: check the running set each step
        assert len({g.lora_key for g in out.running if g.lora_key}) <= 1
        for o in engine.step():
            if o.finished:
                finished.append(o.request_id)
        if not engine.has_unfinished_requests():
            break
    assert "b" in finished and finished.index("b") < 10
    assert len(finished) == 42


def test_faults_and_preemption_with_adapters_give_the_clean_outputs(tiny: dict) -> None:
    names = ["qv", "all", "mlp", None] * 2
    prompts = PROMPTS * 2
    loras = [tiny["reqs"][n] if n else None for n in names]
    clean = _llm(tiny).generate(prompts, GREEDY, lora_request=loras)
    want = [list(o.outputs[0].token_ids) for o in clean]
    assert want[:4] == [hf_greedy(tiny["refs"][n], p, 32) for n, p in zip(names[:4], PROMPTS)]
    tight = _llm(tiny, num_kv_blocks=40, preemption_mode="recompute", debug_integrity=True)
    got = tight.generate(prompts, GREEDY, lora_request=loras)
    assert tight.stats().preemptions_recompute > 0
    assert [list(o.outputs[0].token_ids) for o in got] == want
    swap = _llm(tiny, num_kv_blocks=40, preemption_mode="swap")
    assert [list(o.outputs[0].token_ids) for o in swap.generate(prompts, GREEDY, lora_request=loras)] == want
    assert swap.stats().preemptions_swap > 0
    faulty = _llm(tiny, fault_injection="seed=3,rate=0.1")
    outs = faulty.generate(prompts, GREEDY, lora_request=loras)
    assert faulty.stats().faults_fired > 0
    assert [list(o.outputs[0].token_ids) for o in outs if o.error is None] == \
        [w for w, o in zip(want, outs) if o.error is None]


def test_kv_events_carry_the_adapter(tiny: dict) -> None:
    """BlockStored of an adapter's blocks names it (vLLM's lora_id and lora_name); the base model's none."""
    from pagedkv.kv_events import BlockStored
    from pagedkv.server.kv_events import encode_event

    llm = _llm(tiny, kv_events=True)
    prompt = PROMPTS[0]
    llm.generate([prompt], GREEDY, lora_request=tiny["reqs"]["qv"])
    llm.generate([prompt], GREEDY)
    stored = [e for e in llm.engine.kv.events.take() if isinstance(e, BlockStored)]
    key = llm.engine.lora.resolve(tiny["reqs"]["qv"]).key
    assert {e.lora_name for e in stored} == {key, None}
    wire = [encode_event(e) for e in stored]
    ids = {w[5] for w in wire if w[7] == key}
    assert len(ids) == 1 and isinstance(next(iter(ids)), int)
    assert all(w[5] is None for w in wire if w[7] is None)


def test_even_runs_take_the_batched_path_and_agree_with_per_run_products(tiny: dict) -> None:
    """Decode rows spread evenly over consecutive slots run as two batched matmuls per layer
    (``LoRABatch.uniform``); the logits equal those of the per-run path (uneven runs)."""
    from pagedkv.lora.layers import LoRABatch

    batch = LoRABatch()
    batch.set(((0, 2, 4), (1, 4, 6), (2, 6, 8)))
    assert batch.uniform == (0, 3, 2, 2)
    batch.set(((0, 2, 4), (2, 4, 6)))  # slots not consecutive
    assert batch.uniform is None
    llm = _llm(tiny)
    engine = llm.engine
    slots = engine.lora.assign_slots(engine.lora.resolve(tiny["reqs"][n]) for n in ("qv", "all", "mlp"))
    order = [slots[engine.lora.resolve(tiny["reqs"][n]).key] for n in ("qv", "all", "mlp")]
    assert sorted(order) == [0, 1, 2]
    p = PROMPTS[1]
    even = [SeqChunk(p, 0, list(range(i * 4, i * 4 + 4)), lora_slot=s) for i, s in enumerate([0, 0, 1, 1, 2, 2])]
    uneven = even + [SeqChunk(p, 0, list(range(24, 28)), lora_slot=2)]
    a = engine.runner.execute(even)
    b = engine.runner.execute(uneven)
    assert (a - b[:6]).abs().max() < 1e-5 and (b[6] - b[5]).abs().max() < 1e-5
    # chunks out of slot order: logits come back in the chunks' order, by chunk or for every token
    mixed = [SeqChunk(p, 0, list(range(i * 4, i * 4 + 4)), lora_slot=s) for i, s in enumerate([2, -1, 0])]
    by_chunk = engine.runner.execute(mixed)
    every = engine.runner.execute(mixed, return_all_logits=True)
    alone = [engine.runner.execute([c], return_all_logits=True) for c in mixed]
    for i, one in enumerate(alone):
        assert (every[i * len(p):(i + 1) * len(p)] - one).abs().max() < 1e-5
        assert (by_chunk[i] - one[-1]).abs().max() < 1e-5


def test_idle_adapters_kept_up_to_max_cpu_loras_and_requests_checked(tiny: dict) -> None:
    """max_cpu_loras bounds the adapters kept read while idle (the least recently used leaves
    first; a request keeps the weights it holds); LoRARequest checks its fields (vLLM's rules)."""
    engine = _llm(tiny, max_loras=1, max_cpu_loras=1).engine
    qv = engine.lora.resolve(tiny["reqs"]["qv"])
    mlp = engine.lora.resolve(tiny["reqs"]["mlp"])
    assert list(engine.lora.idle) == ["mlp"]
    again = engine.lora.resolve(tiny["reqs"]["qv"])  # read again, the same identity
    assert again is not qv and again.key == qv.key and list(engine.lora.idle) == ["qv"]
    assert mlp.modules  # still usable by the request that holds it
    assert {a.name for a in engine.lora.known()} == {"qv", "mlp"}
    with pytest.raises(ValueError, match="max_cpu_loras"):
        _llm(tiny, max_loras=2, max_cpu_loras=1)
    with pytest.raises(LoRAError, match="lora_int_id"):
        LoRARequest("x", 0, "/tmp")
    with pytest.raises(LoRAError, match="lora_path"):
        LoRARequest("x", 1, "")
