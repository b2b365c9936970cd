"""GGUF files of mixture-of-experts and MLA models (``models/gguf_loader.py``): tiny random models
made with transformers and converted once with llama.cpp's ``convert_hf_to_gguf.py``
(tests/data/make_moe_gguf.py; fixtures in tests/data/gguf/): ``deepseek2`` with the split
attn_k_b / attn_v_b and the fused attn_kv_b layouts, with and without q_lora_rank, ``qwen3moe``,
``qwen2moe`` and Mixtral as ``llama`` with experts. Each loads to the routing transformers reads
from the original config, and gives the original model's prefill logits (float32, whole and in
chunks of 6) and greedy tokens on both attention paths."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv.models import load_model
from pagedkv.models.config import ModelConfig
from pagedkv.models.errors import ModelLoadError
from pagedkv.models.gguf_loader import _join_parts
from pagedkv.runner import ModelRunner, SeqChunk
from pagedkv_testing.hf_checkpoints import TinyAllocator, check_greedy_both_ways, hf_greedy, hf_logits

gguf = pytest.importorskip("gguf")

DATA = Path(__file__).resolve().parents[1] / "data"
FULL = os.environ.get("PAGEDKV_MOE_FULL_MATRIX") == "1"  # docs/environment.md
_spec = importlib.util.spec_from_file_location("make_moe_gguf", DATA / "make_moe_gguf.py")
assert _spec is not None and _spec.loader is not None
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)
STEMS = list(make.MODELS)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return {"cache": tmp_path_factory.mktemp("gguf-cache")}


def _case(stem: str, cache: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    """(the transformers model the fixture was made from, the GGUF loaded by pagedkv)."""
    if stem not in cache:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PAGEDKV_CACHE_DIR", str(cache["cache"]))  # the conversion's cache
            cache[stem] = (make.build(stem), load_model(str(DATA / "gguf" / f"{stem}.gguf")))
    return cache[stem]


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("stem", STEMS)
def test_gguf_reads_as_the_original_config(stem: str, built: dict[str, Any]) -> None:
    ref, loaded = _case(stem, built)
    # the fixture carries the weights the reference is rebuilt with (same seed, same code)
    reader = gguf.GGUFReader(str(DATA / "gguf" / f"{stem}.gguf"))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    torch.testing.assert_close(torch.from_numpy(embd.data.copy()), ref.model.embed_tokens.weight.detach())
    want = ModelConfig.from_hf_dict({**ref.config.to_dict(), "architectures": [type(ref).__name__]})
    got: ModelConfig = loaded.config
    assert got.moe == want.moe
    for field in ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                  "qk_rope_head_dim", "v_head_dim", "rope_interleave", "vocab_size", "tie_word_embeddings"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.rope.rope_type == want.rope.rope_type and got.rope.factor == want.rope.factor
    assert got.attention_scale == pytest.approx(want.attention_scale, rel=1e-6)


@pytest.mark.parametrize("block_size", [1, 16, 64] if FULL else [16])
@pytest.mark.parametrize("stem", STEMS)
def test_prefill_logits_whole_and_in_chunks(stem: str, block_size: int, built: dict[str, Any]) -> None:
    ref, loaded = _case(stem, built)
    n = 45
    ids = _prompt(n, loaded.config.vocab_size, 1)
    want = hf_logits(ref, ids)
    num_blocks = 8 + n // block_size
    table = TinyAllocator(num_blocks).take(-(-n // block_size))
    runner = ModelRunner(loaded, block_size=block_size, num_blocks=num_blocks)
    got = runner.execute([SeqChunk(ids, 0, table)], return_all_logits=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    runner = ModelRunner(loaded, block_size=block_size, num_blocks=num_blocks)
    parts = [runner.execute([SeqChunk(ids[s:s + 6], s, table)], return_all_logits=True) for s in range(0, n, 6)]
    torch.testing.assert_close(torch.cat(parts), want, atol=1e-4, rtol=1e-4)


# default run: each fixture on one attention path, the paths alternating (both with PAGEDKV_MOE_FULL_MATRIX=1)
GREEDY = [(stem, native) for i, stem in enumerate(STEMS) for native in (True, False) if FULL or native == (i % 2 == 0)]


@pytest.mark.parametrize(("stem", "native"), GREEDY, ids=[f"{s}-{'native' if n else 'plain'}" for s, n in GREEDY])
def test_greedy_32_tokens_match_transformers(stem: str, native: bool, built: dict[str, Any]) -> None:
    ref, loaded = _case(stem, built)
    prompts = [_prompt(n, loaded.config.vocab_size, 10 + n) for n in (13, 5)]
    if (stem, "greedy") not in built:  # one reference for both attention paths
        built[stem, "greedy"] = [hf_greedy(ref, p, 32) for p in prompts]
    check_greedy_both_ways(loaded, prompts, built[stem, "greedy"], native=native, num_blocks=64, chunk=6)


def test_a_split_part_without_its_partner_is_refused() -> None:
    lone = [("model.layers.0.self_attn.k_b_proj", torch.zeros(2, 4, 3))]
    with pytest.raises(ModelLoadError, match="k_b_proj.*no partner.*convert it again"):
        list(_join_parts(iter(lone)))
