"""Latent KV (MLA) against a multi-head cache of the same attention: bytes, decode time, capacity, int8.

- ``latent_kv_ratio``: KV bytes per token the engine's pool allocates (``KVCache.device_bytes``) for
  a one-layer model with DeepSeek-V3's attention (128 heads, kv_lora_rank 512, qk_rope 64, qk_nope
  128, v 128), against a one-layer multi-head model whose pool holds the same attention's K and V
  (128 heads x (192 + 128) values a token: K and V heads of 160, the same bytes and the same
  multiply-adds per token, since the pool keeps K and V at one head size).
- ``absorbed_decode_speedup_{1k,4k,8k}``: decode attention at batch 1 with DeepSeek-V2-Lite's attention
  (16 heads, rank 512, rope 64, nope 128, v 128): absorbed latent decode (the K up-projection folded
  into the query, one 576-dim KV head read in place, the V up-projection after) against the
  multi-head paged cache (16 heads of 160), both through the engine's decode kernel (native where it
  builds, else the plain path), medians of interleaved runs.
- ``seqs_4k_latent`` / ``seqs_4k_mha``: 4k-token sequences an 80 GiB bfloat16 KV budget holds with
  DeepSeek-V3's 61 layers.
- ``int8_rel_err`` / ``int8_top1``: a tiny random DeepSeek-V3 (transformers-built) prefilled in two
  chunks with int8 latent blocks, against model-precision latent blocks: mean relative L2 error of
  the logits and top-1 agreement over every position (native kernels only; skipped otherwise).
- ``experts_q8_speedup_b{1,32}``: one MoE layer (``MoEMLP``: router, top-8 of 16 experts of
  Qwen3-30B-A3B's size, hidden 2048, expert width 768) at 1 and 32 tokens, experts kept 8-bit
  (``QuantExperts``, one kernel call per active expert over its slice) against float32 experts;
  ``experts_q8_bytes_ratio`` their weight bytes (float / 8-bit); ``experts_call_share_b1`` the time
  of the same layer with 32-wide experts (the per-call cost alone: what a batched kernel over all
  experts could save at most) against the 8-bit layer's at batch 1.

    .venv/bin/python bench/mla.py --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from pagedkv.models.config import ModelConfig, MoEConfig
from pagedkv.models.moe import MoEMLP
from pagedkv.models.quant_linear import QuantExperts, quantize_model, weight_bytes
from pagedkv.ops import DecodeMetadata, native, paged_decode_attention, write_kv
from pagedkv.ops.paged_attention import NativeMetadata, native_paged_attention
from pagedkv.runner.kv_cache import KVCache, num_blocks_for_memory

V3 = dict(hidden_size=7168, num_attention_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
          v_head_dim=128, q_lora_rank=1536, vocab_size=1024, intermediate_size=18432, max_position_embeddings=8192)


def v3_config(layers: int) -> ModelConfig:
    return ModelConfig.from_hf_dict({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                                     "num_hidden_layers": layers, **V3})


def mha_config(layers: int, heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers,
                                     "hidden_size": heads * head_dim, "num_attention_heads": heads,
                                     "num_key_value_heads": heads, "head_dim": head_dim, "vocab_size": 1024,
                                     "intermediate_size": 64, "max_position_embeddings": 8192})


def bytes_per_token(config: ModelConfig, dtype: str = "bfloat16") -> float:
    cache = KVCache(config, block_size=16, num_blocks=4, dtype=dtype)
    return cache.device_bytes / (4 * 16)


def _time(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def decode_case(ctx: int, args: argparse.Namespace) -> dict[str, Any]:
    """One decode query at ``ctx`` tokens of context: absorbed latent vs multi-head paged cache."""
    gen = torch.Generator().manual_seed(ctx)
    heads, rank, rope, nope, v_dim, mha_d, bs = 16, 512, 64, 128, 128, 160, args.block_size
    blocks = -(-ctx // bs)
    table = torch.randperm(blocks + 4, generator=gen)[:blocks].tolist()
    slots = torch.tensor(table)[torch.arange(ctx) // bs] * bs + torch.arange(ctx) % bs
    use_native = native.available() and not args.plain

    def cache(kv_heads: int, d: int, same: bool) -> tuple[torch.Tensor, torch.Tensor]:
        k_cache = torch.zeros(blocks + 4, bs, kv_heads, d)
        v_cache = k_cache if same else torch.zeros(blocks + 4, bs, kv_heads, d)
        k = torch.randn(ctx, kv_heads, d, generator=gen)
        write_kv(k_cache, v_cache, k, k if same else torch.randn(ctx, kv_heads, d, generator=gen), slots)
        return k_cache, v_cache

    lat_k, lat_v = cache(1, rank + rope, same=True)  # the latent, stored once
    mha_k, mha_v = cache(heads, mha_d, same=False)
    w_uk = torch.randn(heads, nope, rank, generator=gen) / nope ** 0.5
    w_uv = torch.randn(heads, v_dim, rank, generator=gen) / rank ** 0.5
    q = torch.randn(1, heads, nope + rope, generator=gen)
    q_mha = torch.randn(1, heads, mha_d, generator=gen)
    scale = (nope + rope) ** -0.5
    metas: dict[int, Any] = {}

    def attend(qq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        kvh, d = k_cache.shape[2], k_cache.shape[3]
        if use_native:
            meta = metas.setdefault(0, NativeMetadata.build([table], [0], [ctx]))
            out = torch.empty(1, heads, d)
            native_paged_attention(out, qq, k_cache, v_cache, meta, scale)
            return out
        meta = metas.setdefault(kvh, DecodeMetadata.build([table], [ctx], block_size=bs, num_heads=heads,
                                                          kv_heads=kvh, head_dim=d, dtype=torch.float32))
        return paged_decode_attention(qq, k_cache, v_cache, meta, scale)

    def absorbed() -> torch.Tensor:
        q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w_uk).transpose(0, 1)  # [1, H, rank]
        out = attend(torch.cat((q_lat, q[..., nope:]), dim=-1), lat_k, lat_v)
        return torch.bmm(out[..., :rank].transpose(0, 1), w_uv.transpose(1, 2))  # [H, 1, v]

    def multi_head() -> torch.Tensor:
        return attend(q_mha, mha_k, mha_v)

    for _ in range(args.warmup):
        absorbed()
        multi_head()
    t_lat, t_mha = [], []
    for _ in range(args.reps):  # interleaved: machine noise hits both alike
        t_lat.append(_time(absorbed))
        t_mha.append(_time(multi_head))
    lat, mha = statistics.median(t_lat), statistics.median(t_mha)
    return {"ctx": ctx, "absorbed_ms": lat * 1e3, "mha_ms": mha * 1e3, "speedup": mha / lat,
            "kernel": "native" if use_native else "plain"}


def int8_quality() -> dict[str, float] | None:
    """int8 latent blocks against model-precision ones on a tiny random DeepSeek-V3."""
    if not native.available():
        return None
    import tempfile
    from pathlib import Path

    import transformers

    from pagedkv.models import load_model
    from pagedkv.runner import ModelRunner, SeqChunk
    from pagedkv_testing.hf_checkpoints import randomize_

    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, n_group=4,
        topk_group=2, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    randomize_(model, 0)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(Path(tmp) / "m")
        loaded = load_model(str(Path(tmp) / "m"))
    ids = torch.randint(3, 256, (128,), generator=torch.Generator().manual_seed(1)).tolist()
    table = list(range(8))

    def logits(kv_dtype: str) -> torch.Tensor:
        runner = ModelRunner(loaded, block_size=16, num_blocks=8, kv_cache_dtype=kv_dtype)
        first = runner.execute([SeqChunk(ids[:64], 0, table)], return_all_logits=True)
        return torch.cat((first, runner.execute([SeqChunk(ids[64:], 64, table)], return_all_logits=True)))

    want, got = logits("auto"), logits("int8")
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).mean()
    return {"int8_rel_err": float(rel), "int8_top1": float((got.argmax(-1) == want.argmax(-1)).float().mean())}


def _moe_layer(hidden: int, inter: int, quantized: bool) -> MoEMLP:
    """A random Qwen3-MoE-style layer (16 experts, top 8, renormalized) of ``hidden`` x ``inter`` experts."""
    from types import SimpleNamespace

    moe = MoEConfig(num_experts=16, top_k=8, intermediate_size=inter, sparse_layers=frozenset({0}))
    layer = MoEMLP(SimpleNamespace(moe=moe, hidden_size=hidden))  # type: ignore[arg-type]  # reads two fields
    gen = torch.Generator().manual_seed(hidden)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    if quantized:
        quantize_model(layer)
        assert isinstance(layer.gate_up, QuantExperts)
    return layer.eval()


def experts_case(args: argparse.Namespace) -> dict[str, float]:
    """8-bit against float32 experts of one MoE layer, interleaved medians (the module docstring)."""
    hidden, inter = 2048, 768
    result: dict[str, float] = {}
    layers = {"float": _moe_layer(hidden, inter, False), "q8": _moe_layer(hidden, inter, True),
              "calls": _moe_layer(32, 32, True)}
    result["experts_q8_bytes_ratio"] = weight_bytes(layers["float"]) / weight_bytes(layers["q8"])
    for rows in (1, 32):
        x = {name: torch.randn(rows, 32 if name == "calls" else hidden) for name in layers}
        times: dict[str, list[float]] = {name: [] for name in layers}
        with torch.inference_mode():
            for rep in range(args.warmup + args.reps):
                for name, layer in layers.items():
                    t = _time(lambda: layer(x[name]))  # noqa: B023 - called at once
                    if rep >= args.warmup:
                        times[name].append(t)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        result[f"experts_q8_speedup_b{rows}"] = med["float"] / med["q8"]
        if rows == 1:
            result["experts_call_share_b1"] = med["calls"] / med["q8"]
        print(json.dumps({"experts_rows": rows, **{f"{k}_ms": v * 1e3 for k, v in med.items()}}))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--plain", action="store_true", help="the plain PyTorch decode path, not the native kernel")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {}
    latent, mha = bytes_per_token(v3_config(1)), bytes_per_token(mha_config(1, 128, 160))
    result.update(latent_bytes_per_token=latent, mha_bytes_per_token=mha, latent_kv_ratio=mha / latent)
    print(f"KV bytes per token, one layer, bf16: latent {latent:.0f}, multi-head {mha:.0f} -> {mha / latent:.1f}x")
    budget = "80GiB"
    for name, cfg in (("latent", v3_config(61)), ("mha", mha_config(61, 128, 160))):
        seqs = num_blocks_for_memory(cfg, 16, budget, "bfloat16") * 16 // 4096
        result[f"seqs_4k_{name}"] = seqs
    print(f"4k-token sequences in {budget} (61 layers, bf16): latent {result['seqs_4k_latent']}, "
          f"multi-head {result['seqs_4k_mha']}")
    for ctx in args.contexts:
        row = decode_case(ctx, args)
        print(json.dumps(row))
        result[f"absorbed_decode_speedup_{ctx // 1024}k"] = row["speedup"]
    quality = int8_quality()
    if quality is None:
        print("int8 latent blocks: skipped (native kernels unavailable)")
    else:
        result.update(quality)
        print(f"int8 latent blocks: relative logits error {quality['int8_rel_err']:.4f}, "
              f"top-1 agreement {quality['int8_top1']:.3f}")
    experts = experts_case(args)
    result.update(experts)
    print(f"experts 8-bit vs float32: {experts['experts_q8_speedup_b1']:.2f}x at 1 token, "
          f"{experts['experts_q8_speedup_b32']:.2f}x at 32; bytes {experts['experts_q8_bytes_ratio']:.2f}x fewer; "
          f"per-call share at 1 token {experts['experts_call_share_b1']:.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
