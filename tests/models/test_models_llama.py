"""Whole-model tests: tiny random llama/mistral/qwen2/qwen3/phi3 checkpoints, pagedkv vs transformers
(float32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedkv.models import load_model
from pagedkv.runner import ModelRunner, SeqChunk
from pagedkv_testing.hf_checkpoints import (
    TinyAllocator,
    check_greedy_both_ways,
    hf_greedy,
    hf_logits,
    load_hf_reference,
    make_hf_checkpoint,
    paged_greedy,
)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}

# name -> (model_type, constructor overrides, config.json edits, keys dropped from config.json)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any] | None, tuple[str, ...]]] = {
    "llama_gqa": ("llama", {}, None, ()),
    "llama_tied": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1}, None, ()),
    "qwen2_bias": ("qwen2", {"tie_word_embeddings": True}, None, ()),
    "qwen2_untied": ("qwen2", {"tie_word_embeddings": False, "num_key_value_heads": 4}, None, ()),
    "mistral": ("mistral", {"sliding_window": None}, None, ()),
    "mistral_sliding_window_8": ("mistral", {"sliding_window": 8}, None, ()),
    "head_dim_48": ("llama", {"hidden_size": 96, "num_attention_heads": 2, "num_key_value_heads": 1}, None, ()),
    "head_dim_80": ("llama", {"hidden_size": 160, "num_attention_heads": 2, "num_key_value_heads": 2}, None, ()),
    "head_dim_not_hidden_over_heads": ("llama", {"head_dim": 24}, None, ()),
    "llama_attention_bias": ("llama", {"attention_bias": True}, None, ()),
    "llama3_rope_parameters_layout": (
        "llama", {"rope_parameters": {"rope_theta": 50000.0, **LLAMA3_ROPE}}, None, ()),
    "llama3_rope_old_layout": (
        "llama", {}, {"rope_theta": 50000.0, "rope_scaling": {**LLAMA3_ROPE}}, ("rope_parameters",)),
    "linear_rope_old_layout_type_key": (
        "llama", {}, {"rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 4.0}},
        ("rope_parameters",)),
    # qwen3: per-head q/k RMSNorm; head_dim decoupled from hidden_size / heads
    "qwen3_head_dim_24": ("qwen3", {"head_dim": 24, "tie_word_embeddings": True}, None, ()),
    "qwen3_bias_mqa": ("qwen3", {"head_dim": 40, "attention_bias": True, "num_key_value_heads": 1}, None, ()),
    # phi3: fused qkv_proj / gate_up_proj in the checkpoint; LongRoPE; partial rotary (Phi-4-mini)
    "phi3": ("phi3", {}, None, ()),
    "phi3_longrope": ("phi3", {"original_max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
        "long_factor": [1.0, 1.5, 2.2, 3.0, 4.1, 5.5, 7.2, 9.0]}}, None, ()),
    "phi3_partial_rotary_window": ("phi3", {"partial_rotary_factor": 0.5, "sliding_window": 9}, None, ()),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return {}


def _case(name: str, tmp_path_factory: pytest.TempPathFactory, cache: dict[str, Any]) -> Any:
    if name not in cache:
        model_type, overrides, edit, drop = CASES[name]
        folder = make_hf_checkpoint(tmp_path_factory.mktemp(name), model_type, seed=len(name),
                                    config_json_edit=edit, drop_keys=drop, **overrides)
        cache[name] = (load_hf_reference(folder), load_model(str(folder)))
    return cache[name]


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_logits_match_transformers(name: str, tmp_path_factory: pytest.TempPathFactory,
                                           built: dict[str, Any]) -> None:
    ref, loaded = _case(name, tmp_path_factory, built)
    assert loaded.config.model_type == CASES[name][0]
    ids = _prompt(40, loaded.config.vocab_size, 1)
    runner = ModelRunner(loaded, block_size=4, num_blocks=64)
    table = TinyAllocator(64).take(10)
    got = runner.execute([SeqChunk(ids, 0, table)], return_all_logits=True)
    want = hf_logits(ref, ids)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    last = runner.execute([SeqChunk(ids[:7], 0, table)])
    torch.testing.assert_close(last[0], hf_logits(ref, ids[:7])[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("native", [True, False], ids=["native", "plain"])
@pytest.mark.parametrize("name", list(CASES))
def test_greedy_32_tokens_match_transformers(name: str, tmp_path_factory: pytest.TempPathFactory,
                                             built: dict[str, Any], native: bool) -> None:
    """Both attention paths: the native kernel (where it builds) and plain PyTorch; whole prompts
    batched (ragged decode) and prompts in 6-token prefill chunks mixed with the others' decodes."""
    ref, loaded = _case(name, tmp_path_factory, built)
    vocab = loaded.config.vocab_size
    prompts = [_prompt(n, vocab, 10 + n) for n in (13, 21, 5)]
    check_greedy_both_ways(loaded, prompts, [hf_greedy(ref, p, 32) for p in prompts], native=native,
                           num_blocks=128, chunk=6)


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_bias", "head_dim_not_hidden_over_heads"])
def test_prefix_cache_hit_matches_transformers(name: str, tmp_path_factory: pytest.TempPathFactory,
                                               built: dict[str, Any]) -> None:
    ref, loaded = _case(name, tmp_path_factory, built)
    vocab = loaded.config.vocab_size
    block_size = 4
    prefix = _prompt(12, vocab, 3)  # 3 full blocks
    suffixes = [_prompt(n, vocab, 20 + n) for n in (1, 6, 9)]
    runner = ModelRunner(loaded, block_size=block_size, num_blocks=96)
    alloc = TinyAllocator(96, seed=5)
    # request 0 computes the prefix blocks (as a prefill of its own) ...
    prefix_blocks = alloc.take(3)
    runner.execute([SeqChunk(prefix, 0, prefix_blocks)])
    # ... and later requests reuse them: their tables start with the same block ids
    got = paged_greedy(runner, [prefix + s for s in suffixes], 32, chunk=5, alloc=alloc,
                       shared_prefix=(prefix_blocks, len(prefix)))
    want = [hf_greedy(ref, prefix + s, 32) for s in suffixes]
    assert got == want


def test_copy_on_write_fork_continues_identically(tmp_path_factory: pytest.TempPathFactory,
                                                  built: dict[str, Any]) -> None:
    ref, loaded = _case("llama_gqa", tmp_path_factory, built)
    ids = _prompt(10, loaded.config.vocab_size, 7)  # 2 full blocks of 4 + a partial third
    runner = ModelRunner(loaded, block_size=4, num_blocks=32, num_host_blocks=8)
    parent = [5, 9, 2, 11, 30, 31, 1, 4, 6, 7, 8, 12]
    first = runner.execute([SeqChunk(ids, 0, parent)])
    tok = int(first[0].argmax())
    # fork: share blocks 5, 9; copy the partial block 2 -> 17 (copy-on-write)
    runner.copy_blocks([(2, 17)])
    child = [5, 9, 17, 20, 21, 22, 23, 24, 25, 26, 27, 28]
    a = runner.execute([SeqChunk([tok], 10, parent), SeqChunk([tok], 10, child)])
    torch.testing.assert_close(a[0], a[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a[0], hf_logits(ref, ids + [tok])[-1], atol=1e-4, rtol=1e-4)
    # swap the child's private block out, clobber it, swap it back in: same logits
    runner.swap_out([(17, 3)])
    runner.cache.kv[:, :, 17].fill_(123.0)
    runner.swap_in([(3, 17)])
    b = runner.execute([SeqChunk([tok], 10, child)])
    torch.testing.assert_close(b[0], a[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("native", [False, True])
def test_decode_length_buckets_match_sequences_run_alone(tmp_path_factory: pytest.TempPathFactory,
                                                         built: dict[str, Any], native: bool) -> None:
    """Very ragged contexts split the decode batch into several length groups (plain path; the
    native kernel takes them in one call); each sequence's logits must equal a batch of one, and
    the decodes must interleave with a prefill chunk."""
    from pagedkv.ops import native as native_ops
    if native and not native_ops.available():
        pytest.skip("native kernels unavailable")
    _, loaded = _case("llama_gqa", tmp_path_factory, built)
    vocab = loaded.config.vocab_size
    lens = [3, 40, 250, 251, 2, 180]
    runner = ModelRunner(loaded, block_size=8, num_blocks=256, native_attention=native)
    alloc = TinyAllocator(256, seed=9)
    tables = [alloc.take(-(-(n + 1) // 8)) for n in lens]
    prompts = [_prompt(n, vocab, 50 + n) for n in lens]
    runner.execute([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)])
    extra_table = alloc.take(4)
    chunks = [SeqChunk([7 + i], n, t) for i, (n, t) in enumerate(zip(lens, tables))]
    mixed = chunks[:3] + [SeqChunk(_prompt(20, vocab, 99), 0, extra_table)] + chunks[3:]
    assert len(runner.prepare(mixed).decode_groups) > 1 or native
    together = runner.execute(mixed)
    together = torch.cat([together[:3], together[4:]])
    for i, c in enumerate(chunks):
        alone = runner.execute([c])
        torch.testing.assert_close(together[i], alone[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_packed_lm_head_matches_plain(tmp_path: Any, tied: bool) -> None:
    from pagedkv.models.packed_linear import PackedLinear, pack_lm_head, packing_available

    folder = make_hf_checkpoint(tmp_path, "llama", tie_word_embeddings=tied)
    plain, packed = load_model(str(folder)), load_model(str(folder))
    ids = _prompt(30, plain.config.vocab_size, 4)
    a = ModelRunner(plain, block_size=8, num_blocks=8, pack_lm_head=False).execute(
        [SeqChunk(ids, 0, [0, 1, 2, 3])], return_all_logits=True)
    runner = ModelRunner(packed, block_size=8, num_blocks=8)
    b = runner.execute([SeqChunk(ids, 0, [0, 1, 2, 3])], return_all_logits=True)
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    if packing_available():
        assert isinstance(packed.model.lm_head, PackedLinear)
        assert pack_lm_head(packed.model)  # idempotent
    assert plain.model.lm_head is None if tied else isinstance(plain.model.lm_head, torch.nn.Linear)


@pytest.mark.parametrize("name,tied", [("llama", False), ("qwen2", True)])
def test_cpu_layout_at_load_matches_the_runners_and_frees_the_first_copies(
        tmp_path: Any, name: str, tied: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """load_model(cpu_layout=True) lays out the head and the fused projections as they are read
    (qwen2: q/k/v with a bias); the logits equal a plain load laid out by the runner, and no
    unpacked head or [out, in] projection is left alive once the loader is done with it."""
    import weakref

    from torch import nn

    import pagedkv.models.weights as weights
    from pagedkv.models.hf_loader import iter_safetensors, iter_safetensors_entries, safetensors_files
    from pagedkv.models.packed_linear import InputMajorLinear, PackedLinear, packing_available

    # two shards, the head in the last one: the readers still give the head and embedding first
    folder = make_hf_checkpoint(tmp_path, name, tie_word_embeddings=tied, max_shard_size="100KB")
    files = safetensors_files(folder)
    assert len(files) > 1
    for reader in (iter_safetensors, iter_safetensors_entries):
        names = [n for n, _ in reader(files)]
        firsts = 1 if tied else 2
        assert all(n.endswith(("lm_head.weight", "embed_tokens.weight")) for n in names[:firsts])
        assert not any(n.endswith(("lm_head.weight", "embed_tokens.weight")) for n in names[firsts:])
    replaced: list[weakref.ref[torch.Tensor]] = []
    real_input_major = weights.input_major

    alive_at_next: list[int] = []  # first copies still alive each time the next one is replaced

    def watched(parent: nn.Module, child: str) -> bool:
        alive_at_next.append(sum(r() is not None for r in replaced))
        replaced.append(weakref.ref(getattr(parent, child).weight))
        return real_input_major(parent, child)

    monkeypatch.setattr(weights, "input_major", watched)
    laid = load_model(str(folder), quantization="none", cpu_layout=True)
    layers = laid.model.layers
    assert len(replaced) == 2 * len(layers) and alive_at_next == [0] * len(replaced)  # freed as it goes
    assert all(isinstance(m, InputMajorLinear) for layer in layers
               for m in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj))
    if packing_available():
        assert isinstance(laid.model.lm_head, PackedLinear)
        assert (laid.model.lm_head.weight is not None) == tied  # an untied head's first copy is gone
    plain = load_model(str(folder), quantization="none")
    ids = _prompt(30, plain.config.vocab_size, 5)
    a = ModelRunner(plain, block_size=8, num_blocks=8).execute([SeqChunk(ids, 0, [0, 1, 2, 3])],
                                                               return_all_logits=True)
    b = ModelRunner(laid, block_size=8, num_blocks=8).execute([SeqChunk(ids, 0, [0, 1, 2, 3])],
                                                              return_all_logits=True)
    assert torch.equal(a, b)
    q8 = load_model(str(folder), quantization="q8_0", cpu_layout=True).model  # quantized after: no layout
    assert not isinstance(q8.lm_head, PackedLinear) and not isinstance(q8.layers[0].mlp.gate_up_proj,
                                                                        InputMajorLinear)


@pytest.mark.parametrize("rows", [1, 5, 9, 13, 33, 100, 257])
def test_packed_linear_pads_rows_to_buckets_without_changing_the_result(rows: int) -> None:
    from pagedkv.models.packed_linear import PackedLinear, packing_available, padded_rows

    bucket = padded_rows(rows)
    assert rows <= bucket <= rows * 1.25 and padded_rows(bucket) == bucket
    if not packing_available():
        pytest.skip("oneDNN packing unavailable")
    gen = torch.Generator().manual_seed(rows)
    w, b, x = torch.randn(70, 24, generator=gen), torch.randn(70, generator=gen), torch.randn(rows, 24, generator=gen)
    out = PackedLinear(w, b)(x)
    assert out.shape == (rows, 70)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_packed_linear_warm_up_runs_every_bucket_once() -> None:
    from pagedkv.models.packed_linear import PackedLinear, packing_available

    if not packing_available():
        pytest.skip("oneDNN packing unavailable")
    head = PackedLinear(torch.randn(70, 24), None)
    seen = []
    head.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
    buckets = head.warm_up(64)
    assert buckets == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64] == seen


@pytest.mark.parametrize("bias", [False, True])
def test_input_major_linears_match_plain(bias: bool) -> None:
    """The runner stores q/k/v and gate/up input-major: same outputs, same weight values, and the
    conversion is idempotent."""
    from torch import nn

    from pagedkv.models.packed_linear import InputMajorLinear, transpose_wide_linears

    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(24, 40, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 24, generator=gen))
    moved = InputMajorLinear(lin.weight, lin.bias)
    for rows in (1, 7, 33):
        x = torch.randn(rows, 24, generator=gen)
        torch.testing.assert_close(moved(x), lin(x), atol=1e-5, rtol=1e-5)
    assert torch.equal(moved.weight, lin.weight) and moved.weight_t.is_contiguous()
    folder_model = nn.Module()
    layer = nn.Module()
    layer.self_attn, layer.mlp = nn.Module(), nn.Module()
    layer.self_attn.qkv_proj, layer.mlp.gate_up_proj = nn.Linear(8, 12), nn.Linear(8, 16, bias=False)
    folder_model.layers = nn.ModuleList([layer])
    assert transpose_wide_linears(folder_model) == 2 and transpose_wide_linears(folder_model) == 0


def test_longrope_engine_picks_long_factors_beyond_the_original_context(tmp_path: Any) -> None:
    """Phi-3 LongRoPE: an engine serving more than the original context (64 here) uses the long
    factors for every position, as transformers does for a sequence past it; one serving at most
    64 uses the short ones."""
    from pagedkv import LLM, SamplingParams

    overrides = CASES["phi3_longrope"][1]
    folder = make_hf_checkpoint(tmp_path, "phi3", seed=4, **overrides)
    ref = load_hf_reference(folder)
    vocab = 256
    long_prompt, short_prompt = _prompt(90, vocab, 7), _prompt(30, vocab, 8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(folder), block_size=4, num_kv_blocks=64)  # max_model_len 256 > 64: long factors
    assert llm.generate([long_prompt], params)[0].outputs[0].token_ids == hf_greedy(ref, long_prompt, 8)
    short = LLM(str(folder), block_size=4, num_kv_blocks=64, max_model_len=64)
    assert short.generate([short_prompt], params)[0].outputs[0].token_ids == hf_greedy(ref, short_prompt, 8)
