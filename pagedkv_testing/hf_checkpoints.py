"""Shared helpers for the model/loader tests: tiny random HF checkpoints and greedy decoding loops.

Imported explicitly (``from pagedkv_testing.hf_checkpoints import ...``); pytest does not collect it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from pagedkv.runner import ModelRunner, SeqChunk

BASE: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
    bos_token_id=1, eos_token_id=2,
)


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) activations (HF's 0.02 init gives near-uniform logits and greedy ties)."""
    gen = torch.Generator().manual_seed(seed)
    # gemma: norms scale by (1 + w) and embeddings are multiplied by sqrt(hidden)
    gemma = "Gemma" in type(model).__name__
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / (math.sqrt(p.shape[-1]) if gemma else 1.0))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))


def make_hf_checkpoint(tmp_path: Path, model_type: str = "llama", seed: int = 0,
                       config_json_edit: dict[str, Any] | None = None, drop_keys: tuple[str, ...] = (),
                       max_shard_size: str | None = None, **overrides: Any) -> Path:
    """Save a tiny random transformers model to ``tmp_path/model`` (safetensors) and return the folder.

    ``config_json_edit`` rewrites config.json after saving (e.g. to the older rope layout);
    ``drop_keys`` removes keys from it.
    """
    import transformers

    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
           "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
           "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM)}[model_type]
    base = {**BASE, "pad_token_id": 0} if model_type == "phi3" else BASE
    config = cls[0](**{**base, **overrides})
    torch.manual_seed(seed)
    model = cls[1](config).eval()
    randomize_(model, seed)
    folder = tmp_path / "model"
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    if config_json_edit or drop_keys:
        path = folder / "config.json"
        cfg = json.loads(path.read_text())
        for k in drop_keys:
            cfg.pop(k, None)
        cfg.update(config_json_edit or {})
        path.write_text(json.dumps(cfg, indent=2))
    return folder


def load_hf_reference(folder: Path) -> torch.nn.Module:
    """The transformers model read back from ``folder`` (float32, eager attention)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()


@torch.inference_mode()
def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` logits of a full forward pass."""
    return model(torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """Greedy tokens by full recompute each step (no cache: the simplest possible reference)."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(hf_logits(model, seq)[-1].argmax()))
    return seq[len(ids):]


class TinyAllocator:
    """Hands out block ids 0..n-1 in a shuffled order so block tables are never contiguous."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()

    def take(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        assert len(out) == n, "test allocator ran out of blocks"
        return out


def check_greedy_both_ways(loaded: Any, prompts: list[list[int]], want: list[list[int]], *, native: bool,
                           num_blocks: int, chunk: int) -> None:
    """``loaded``'s greedy tokens equal ``want`` with whole prompts batched (block size 4) and with
    prompts cut into ``chunk``-token prefill chunks mixed with the others' decodes (block size 3),
    on the native kernel or the plain PyTorch path (skipped where the kernel cannot be built)."""
    import pytest

    from pagedkv.ops import native as native_ops

    if native and not native_ops.available():
        pytest.skip("native kernels unavailable")
    n = len(want[0])
    runner = ModelRunner(loaded, block_size=4, num_blocks=num_blocks, native_attention=native)
    assert paged_greedy(runner, prompts, n) == want
    runner = ModelRunner(loaded, block_size=3, num_blocks=num_blocks, native_attention=native)
    assert paged_greedy(runner, prompts, n, chunk=chunk) == want


def paged_greedy(runner: ModelRunner, prompts: list[list[int]], n: int, *, chunk: int | None = None,
                 alloc: TinyAllocator | None = None, shared_prefix: tuple[list[int], int] | None = None
                 ) -> list[list[int]]:
    """Greedy-decode several prompts together: prefill in chunks of ``chunk`` tokens (all at once when
    None), then batched decode. Every step mixes whatever each sequence needs next.

    ``shared_prefix`` = (block ids, num tokens) already computed in the cache for every prompt
    (a prefix-cache hit): those tokens are skipped and their blocks head each block table.
    """
    bs = runner.block_size
    alloc = alloc or TinyAllocator(runner.num_blocks)
    prefix_blocks, prefix_len = shared_prefix or ([], 0)
    tables: list[list[int]] = []
    num_groups = len(runner.cache.groups)  # a hybrid model's KV groups each need a table
    group_tables: list[tuple[list[int], ...]] = []
    for p in prompts:
        total = len(p) + n
        tables.append(prefix_blocks + alloc.take(-(-total // bs) - len(prefix_blocks)))
        group_tables.append(tuple(alloc.take(-(-total // bs)) for _ in range(num_groups - 1)))
    done = [prefix_len] * len(prompts)  # tokens already in the cache
    seqs = [list(p) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    while any(len(o) < n for o in outs):
        chunks, owners = [], []
        for i, seq in enumerate(seqs):
            if len(outs[i]) >= n:
                continue
            todo = seq[done[i]:]
            if chunk is not None and len(todo) > chunk:
                todo = todo[:chunk]
            chunks.append(SeqChunk(todo, done[i], tables[i], group_tables=group_tables[i]))
            owners.append(i)
        logits = runner.execute(chunks)
        for row, (i, c) in enumerate(zip(owners, chunks)):
            done[i] += len(c.token_ids)
            if done[i] == len(seqs[i]):  # the chunk reached the end: its last logits pick a token
                tok = int(logits[row].argmax())
                outs[i].append(tok)
                seqs[i].append(tok)
    return outs
