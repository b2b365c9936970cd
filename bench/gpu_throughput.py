"""Throughput of benchmark cases a, b, c (``../shared/BENCHMARKS.md``) on random weights, any device.

For each model shape, a random-weight Hugging Face folder (config.json + model.safetensors, no
tokenizer: the workloads are token ids) is written to a temporary directory and served by an
engine on ``--device`` in ``--dtype``; each case runs ``--repeat`` times (greedy, ignore_eos) and
reports output tokens per second (the median). Shapes: ``smollm2-135m`` (the default model's,
the benchmark shape), ``llama-1b`` (Llama 3.2 1B's: 16 layers, hidden 2048, 32 heads, 8 KV
heads), ``tiny`` (for a quick check on a CPU), or any ``pagedkv size`` preset name.

    python bench/gpu_throughput.py --device cuda --dtype bfloat16            # scripts/gpu_check.sh
    .venv/bin/python bench/gpu_throughput.py --device cpu --dtype float32 --shapes tiny --cases a

Last line: one JSON object: ``<shape>_<case>_tok_s`` per shape and case, the device's name,
the dtype, and the seconds it all took.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pagedkv.benchmark import build_workload, run_pagedkv
from pagedkv.engine import LLMEngine
from pagedkv.model_shape import ModelShape

SHAPES = {
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512),
    "llama-1b": dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=8192, vocab_size=128256),
}


def shape_config(name: str) -> dict:
    if name in SHAPES:
        return {**SHAPES[name], "max_position_embeddings": 4096}
    from pagedkv.sim.presets import PRESETS
    if name not in PRESETS:
        raise SystemExit(f"unknown shape {name!r}: {sorted(SHAPES)} or a preset {sorted(PRESETS)}")
    s: ModelShape = PRESETS[name]
    return dict(num_hidden_layers=s.num_hidden_layers, hidden_size=s.hidden_size,
                num_attention_heads=s.num_attention_heads, num_key_value_heads=s.num_key_value_heads,
                intermediate_size=s.intermediate_size, vocab_size=s.vocab_size,
                max_position_embeddings=min(s.max_position_embeddings, 8192),
                tie_word_embeddings=bool(getattr(s, "tie_word_embeddings", False)))


def write_random_model(folder: Path, cfg: dict, dtype: torch.dtype, device: str, seed: int = 0) -> Path:
    """A Llama folder with random weights of ``cfg``'s shape (O(1) activations), made on ``device``."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    h, heads, kvh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, inter, vocab = h // heads, cfg["intermediate_size"], cfg["vocab_size"]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "head_dim": d, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": str(dtype)[6:],
              "tie_word_embeddings": cfg.get("tie_word_embeddings", False), **cfg}
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) / shape[-1] ** 0.5).to(dtype)

    tensors = {"model.embed_tokens.weight": rand(vocab, h) * h ** 0.5, "model.norm.weight": torch.ones(h, dtype=dtype)}
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(vocab, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": rand(heads * d, h), p + "self_attn.k_proj.weight": rand(kvh * d, h),
                    p + "self_attn.v_proj.weight": rand(kvh * d, h), p + "self_attn.o_proj.weight": rand(h, heads * d),
                    p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
                    p + "mlp.down_proj.weight": rand(h, inter),
                    p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                    p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype)}
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--shapes", default="smollm2-135m,llama-1b")
    ap.add_argument("--cases", default="a,b,c")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--kv-cache-memory", default="8GiB")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    start = time.perf_counter()
    result: dict[str, object] = {"device": (torch.cuda.get_device_name(0) if args.device.startswith("cuda")
                                            else "cpu"), "dtype": args.dtype}
    with tempfile.TemporaryDirectory(prefix="pagedkv-gpu-bench-") as tmp:
        for shape in args.shapes.split(","):
            cfg = shape_config(shape)
            folder = write_random_model(Path(tmp) / shape, cfg, dtype, args.device)
            engine = LLMEngine.from_options(str(folder), device=args.device, dtype=args.dtype,
                                            kv_cache_memory=args.kv_cache_memory, kv_offloading_size=0,
                                            max_num_seqs=64, max_num_batched_tokens=4096)
            for case in args.cases.split(","):
                workload = build_workload(f"case_{case}", cfg["vocab_size"])
                rates = [run_pagedkv(engine, workload).tok_s for _ in range(args.repeat)]
                result[f"{shape.replace('-', '_').replace('.', '_')}_{case}_tok_s"] = round(statistics.median(rates), 1)
                print(f"{shape} case {case}: {statistics.median(rates):.1f} tok/s", flush=True)
            engine.close()
            del engine
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    result["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
